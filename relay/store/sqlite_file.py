"""The SQLite file itself: one relay process per file (its `<path>.lock`), and read-only
connections for readers (`relay report`, a store's own queries) while the writer runs."""

from __future__ import annotations

import fcntl
import os
import pathlib
import sqlite3

from relay.store.schema import DbRow


class StoreLocked(OSError):
    """Another relay process holds the database (its `<path>.lock`)."""


def lock_path(path: str) -> str:
    return path + ".lock"


def take_lock(path: str) -> int:
    """An exclusive lock on `<path>.lock`, held (by the open descriptor) for as long as this
    process uses the database: a second relay on the same file must not run `recover()` on
    the first one's live admissions. StoreLocked if another process holds it."""
    name = lock_path(path)
    # A lock file that cannot be opened is reported as SQLite reports a path it cannot open.
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise sqlite3.OperationalError(
            f"unable to open database file: lock {name!r}: {exc.strerror}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLocked(
            f"store.path {path!r} is in use by another relay process "
            f"(it holds {name!r}); refusing to start"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_memory(path: str) -> bool:
    return path in (":memory:", "")


def open_readonly(path: str, timeout: float = 5.0) -> sqlite3.Connection:
    """A short-lived read-only connection with rows as dicts (safe while the writer runs)."""
    uri = pathlib.Path(path).absolute().as_uri() + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=timeout)
    conn.row_factory = dict_row
    return conn


def dict_row(cursor: sqlite3.Cursor, values: tuple[object, ...]) -> DbRow:
    """A row factory: the row as a dict of its columns."""
    return {d[0]: v for d, v in zip(cursor.description, values)}

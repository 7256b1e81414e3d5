"""Read-only access to the stored rows for `relay report`: a SQLite file (`[store].path`) or
the PostgreSQL table several relays share (`--db postgresql://...`; the password from libpq's
PGPASSWORD or ~/.pgpass, or with `--config` from the variable its `[store].password_env`
names; never the command line). The SQL is written once in SQLite's spelling; store.pg_sql
`portable` turns it into PostgreSQL's. A row is read with its id
(`row_id`), by which the report names a row it leaves out.
"""

from __future__ import annotations

import importlib
import os
import re
import sqlite3
from dataclasses import dataclass

from relay.config import is_pg_url
from relay.store import POSTGRES_EXTRA_HINT
from relay.store.schema import DbRow, Params
from relay.store.sqlite_file import is_memory, open_readonly

# The key a row's id is read under: SQLite's rowid, or the row_id of PostgreSQL's rows.
ROW_ID = "row_id"


@dataclass(frozen=True, slots=True)
class Db:
    """Where the rows are: a SQLite file or a PostgreSQL URL (`where`), and the password
    to connect with (None: libpq's own, PGPASSWORD or ~/.pgpass)."""

    where: str
    password: str | None = None


def row_id(db: str) -> str:
    """The SELECT term that reads a row's id under ROW_ID."""
    return ROW_ID if is_pg_url(db) else f"rowid AS {ROW_ID}"


def _text(value: bytes) -> str:
    """A TEXT value as SQLite gives it, decoded as far as it is UTF-8: another tool may
    have cast any bytes to TEXT, and one such value must not make the whole read fail."""
    return value.decode("utf-8", "replace")


def shown(db: str) -> str:
    """`db` as printed: a password someone put in a URL on the command line is masked."""
    return re.sub(r"^(\w+://[^:/@]*):[^@/]*@", r"\1:***@", db)


def errors() -> tuple[type[BaseException], ...]:
    """What a read may raise, for either engine (psycopg only if it is installed)."""
    try:
        import psycopg
    except ImportError:
        return (sqlite3.Error,)
    return (sqlite3.Error, psycopg.Error)


def missing(db: str) -> str | None:
    """Why there is nothing to read at `db` (None: go ahead)."""
    if is_pg_url(db):
        try:
            importlib.import_module("psycopg")
        except ImportError:
            return f"reading PostgreSQL needs the driver: {POSTGRES_EXTRA_HINT}"
        return None
    if is_memory(db) or not os.path.isfile(db):
        return (
            f"no database file at {db!r} (pass --db PATH, the [store].path of the relay, "
            "or --db postgresql://... its [store].url)"
        )
    return None


def fetch(db: Db, sql: str, params: Params = ()) -> list[DbRow]:
    if is_pg_url(db.where):
        import psycopg
        from psycopg.rows import dict_row

        from relay.store.pg_sql import portable

        # (A None password is left out: libpq's own.)
        with psycopg.connect(
            db.where, autocommit=True, row_factory=dict_row, password=db.password
        ) as conn:
            return conn.execute(portable(sql), params).fetchall()
    lite = open_readonly(db.where)
    lite.text_factory = _text
    try:
        rows: list[DbRow] = lite.execute(sql, params).fetchall()
        return rows
    finally:
        lite.close()


def columns(db: Db, table: str = "request") -> set[str]:
    if is_pg_url(db.where):
        return {
            r["column_name"]
            for r in fetch(
                db,
                "SELECT column_name FROM information_schema.columns WHERE table_name = ?",
                (table,),
            )
        }
    return {r["name"] for r in fetch(db, f"PRAGMA table_info({table})")}

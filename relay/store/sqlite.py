"""Durable request rows in SQLite, written by one thread off the event loop.

`put` (event-loop thread) only snapshots the row into a tuple and appends it to a deque: it
never blocks and never raises. `admit` is the one awaited write: a keyed request's admission
record (relay/durable.py), committed before its upstream is contacted and deleted in the
transaction that writes its row. One writer thread owns the writing connection; it wakes every
`flush_interval_s` (or at once when a batch is ready, or on flush/close/query), writes the
rows in transactions of up to `batch_max` rows, retries a failed batch with backoff (keeping
its rows), and prunes rows older than `retention_days` at start and about once an hour.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import fcntl
import os
import pathlib
import sqlite3
import threading
import time
from operator import attrgetter

from relay.observe.log import Log
from relay.store import admissions as durable
from relay.store.migrate import add_missing_columns

COLUMNS = (
    "ts",
    "request_id",
    "key_id",
    "path",
    "model",
    "stream",
    "upstream_requested",
    "upstream_served",
    "fallback_attempts",
    "status",
    "ok",
    "error_code",
    "queue_ms",
    "ttft_ms",
    "total_ms",
    "prompt_tokens",
    "completion_tokens",
    "tokens_source",
    "bytes_out",
    "client_closed",
    "error",
)
_TYPES = (
    "REAL",
    "TEXT",
    "TEXT",
    "TEXT",
    "TEXT",
    "INTEGER",
    "TEXT",
    "TEXT",
    "INTEGER",
    "INTEGER",
    "INTEGER",
    "TEXT",
    "REAL",
    "REAL",
    "REAL",
    "INTEGER",
    "INTEGER",
    "TEXT",
    "INTEGER",
    "INTEGER",
    "TEXT",
)
# Columns added after the first schema: databases of an older relay gain them at start
# (relay/migrate.py; `error` came with TLS upstreams, the timings with issue 13).
ADDED = (
    ("first_byte_ms", "REAL"),
    ("e2e_ms", "REAL"),
    ("tpot_ms", "REAL"),
    ("itl_p50_ms", "REAL"),
    ("itl_p99_ms", "REAL"),
    ("itl_max_ms", "REAL"),
    ("itl_hist", "TEXT"),
    ("prompt_ms", "REAL"),
    ("prompt_per_second", "REAL"),
    ("predicted_per_second", "REAL"),
)
COLUMNS += tuple(c for c, _ in ADDED)
_TYPES += tuple(t for _, t in ADDED)
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS request ("
    + ", ".join(f"{c} {t}" for c, t in zip(COLUMNS, _TYPES))
    + ")",
    "CREATE INDEX IF NOT EXISTS request_ts ON request (ts)",
    "CREATE INDEX IF NOT EXISTS request_key_ts ON request (key_id, ts)",
)
INSERT = f"INSERT INTO request ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)})"
_KEYS = COLUMNS + ("admission_id",)  # a queued row: its columns, then its admission (or None)
_TS = COLUMNS.index("ts")
_record_values = attrgetter(*COLUMNS)  # a Record's columns, in order
_PLAIN = (type(None), int, float, str, bytes)
OVERFLOW_MAX = 100_000
WARN_INTERVAL_S = 10.0


class StoreLocked(OSError):
    """Another relay process holds the database (its `<path>.lock`)."""


def lock_path(path: str) -> str:
    return path + ".lock"


def take_lock(path: str) -> int:
    """An exclusive lock on `<path>.lock`, held (by the open descriptor) for as long as this
    process uses the database: a second relay on the same file must not run `recover()` on
    the first one's live admissions. StoreLocked if another process holds it."""
    name = lock_path(path)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:  # as SQLite would say of a path it cannot open
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


def dict_row(cursor: sqlite3.Cursor, values: tuple) -> dict:
    return {d[0]: v for d, v in zip(cursor.description, values)}


def clean(values: tuple, now: float) -> tuple:
    """Make a snapshot insertable: bool -> 0/1 (int subclass), odd types -> str, ts defaults to now."""
    out = [v if type(v) in _PLAIN or isinstance(v, (int, float)) else str(v) for v in values]
    if out[_TS] is None:
        out[_TS] = now
    return tuple(out)


class Store:
    retry_base_s = 0.05  # first backoff after a failed batch; doubles up to retry_max_s
    retry_max_s = 2.0
    # How long SQLite waits for a lock held by another connection (a backup, an operator's
    # shell) before it reports "database is locked". Start-up (recovery, prune) waits long;
    # then row batches wait briefly (their own retry loop is the backoff) and admissions
    # more briefly still, so the one writer thread is never stuck for long in a busy wait
    # while a request waits for its admission.
    start_busy_s = 5.0
    row_busy_s = 0.25
    admit_busy_s = 0.1

    def __init__(
        self,
        path: str,
        retention_days: float = 30.0,
        batch_max: int = 500,
        queue_max: int = 10000,
        flush_interval_s: float = 0.2,
        *,
        overflow_max: int = OVERFLOW_MAX,
        prune_interval_s: float = 3600.0,
        log: Log | None = None,
    ) -> None:
        self.path = path
        self.log = log or Log()  # warnings are JSON log lines like every other
        self.retention_days = retention_days
        self.batch_max = max(1, batch_max)
        self.queue_max = max(1, queue_max)
        self.overflow_max = overflow_max
        self.flush_interval_s = flush_interval_s
        self.prune_interval_s = prune_interval_s
        self.rows_written = 0
        self.rows_dropped = 0
        self.rows_pruned = 0
        self.write_errors = 0
        self._accepted = 0  # rows put() took (only the loop thread writes it)
        self._settled = 0  # accepted rows committed or given up (writer thread only)
        self._queue: collections.deque = collections.deque()
        self._overflow: collections.deque = collections.deque()
        self._controls: collections.deque = collections.deque()  # (sql, params, future)
        self._admits: collections.deque = collections.deque()  # (values, loop, future)
        # admission ids: a random 31-bit prefix per process above a 32-bit counter (63 bits),
        # so two processes never reuse each other's ids even if they share a file
        self._admission_ids = (int.from_bytes(os.urandom(4), "big") >> 1) << 32
        self._lock_fd: int | None = None
        self.recovered = 0  # admissions left by a crash, turned into rows at start
        self._wake = threading.Event()
        self._abandon = threading.Event()
        self._settled_cv = threading.Condition()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._warned_at: dict[str, float] = {}

    # ---- event-loop side -------------------------------------------------------------
    def put(self, row: dict) -> None:
        self._put(tuple(map(row.get, _KEYS)))

    def put_record(self, rec, admission_id=None) -> None:
        """A settled request's row read straight off its `Record` (no dict in between: one C
        call reads the columns; a bool column is stored as the integer it is)."""
        self._put(_record_values(rec) + (admission_id,))

    def _put(self, values: tuple) -> None:
        if self._stopping:
            self._drop("store closed")
            return
        if len(self._queue) < self.queue_max and not self._overflow:
            self._queue.append(values)
        elif len(self._overflow) < self.overflow_max:
            self._overflow.append(values)
        else:
            self._drop("queue and overflow full")
            return
        self._accepted += 1
        if len(self._queue) >= self.batch_max and not self._wake.is_set():
            self._wake.set()

    def next_admission_id(self) -> int:
        """An id for `admit`: the caller keeps it before awaiting, so a cancelled caller's
        row still deletes the record, which is written all the same."""
        self._admission_ids += 1
        return self._admission_ids

    async def admit(
        self,
        admission_id: int,
        rec,
        prompt_tokens: int,
        completion_tokens: int,
        timeout: float | None = None,
        res=None,
    ) -> None:
        """Commit a request's admission record (relay/durable.py) before going on. (`res`,
        the local reservation, matters to a shared budget only: relay/store_pg.py.)

        RuntimeError if it could not be written; with `timeout`, TimeoutError if it is not
        committed by then (the record is still written when the writer gets to it, and the
        request's row deletes it all the same)."""
        if self._stopping or self._thread is None or not self._thread.is_alive():
            raise RuntimeError("store is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fut.add_done_callback(_retrieved)  # its outcome may come after the caller left
        self._admits.append(
            (durable.values(admission_id, rec, prompt_tokens, completion_tokens), loop, fut)
        )
        self._wake.set()
        if timeout is None:
            await fut
        else:
            await asyncio.wait_for(asyncio.shield(fut), timeout)

    async def maintain(self, app) -> None:
        """Background upkeep while the relay runs: nothing for one SQLite file (a shared
        store renews its leases here)."""

    @property
    def pending(self) -> int:
        return self._accepted - self._settled

    def _drop(self, why: str) -> None:
        with self._settled_cv:  # rows_dropped is also counted by the writer thread
            self.rows_dropped += 1
        self._warn("drop", f"dropping request rows ({why}); {self.rows_dropped} dropped so far")

    def _warn(self, kind: str, line: str) -> None:
        """One JSON log line (`store_warning`) per kind at most every WARN_INTERVAL_S."""
        now = time.monotonic()
        if now - self._warned_at.get(kind, -WARN_INTERVAL_S) < WARN_INTERVAL_S:
            return
        self._warned_at[kind] = now
        self.log.event(
            "store_warning",
            kind=kind,
            message=line,
            rows_dropped=self.rows_dropped,
            write_errors=self.write_errors,
        )

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._acquire()
        self._thread = threading.Thread(target=self._run, name="relay-store", daemon=False)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._closed = self._stopping = True
            self._unlock()
            raise self._start_error

    def flush(self, timeout: float = 5.0) -> None:
        target = self._accepted
        if self._settled >= target:
            return
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("store writer is not running")
        self._wake.set()
        with self._settled_cv:
            if not self._settled_cv.wait_for(lambda: self._settled >= target, timeout):
                raise TimeoutError(
                    f"store flush: {target - self._settled} rows not committed after {timeout}s"
                )

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        if self._thread is None and self._accepted:
            self.start()  # rows were accepted before start(): write them now
        self._closed = self._stopping = True
        if self._thread is None:
            return
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():  # stuck retrying a failing DB: give up the rest
            self._abandon.set()
            self._wake.set()
            self._thread.join()
        self._unlock()

    def _acquire(self) -> None:
        if not is_memory(self.path) and self._lock_fd is None:
            self._lock_fd = take_lock(self.path)  # before recover() touches the admissions

    def _unlock(self) -> None:
        """The writer is done with the database: another process may take it."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    # ---- reading ---------------------------------------------------------------------
    def query(self, sql: str, params=()) -> list[dict]:
        if not is_memory(self.path):
            conn = open_readonly(self.path)
            try:
                return conn.execute(sql, params).fetchall()
            finally:
                conn.close()
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("in-memory store: query needs the running writer")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._controls.append((sql, params, fut))
        self._wake.set()
        return fut.result(timeout=30.0)

    def usage_since(
        self, key_id: str | None, since_ts: float, served_only: bool = False
    ) -> tuple[int, int]:
        """(requests, tokens) of a key since a time; `served_only` counts only requests an
        upstream served (what a budget charges)."""
        count = f"SUM({durable.CHARGED})" if served_only else "COUNT(*)"
        row = self.query(
            f"SELECT COALESCE({count}, 0) AS n, COALESCE(SUM(COALESCE(prompt_tokens, 0)"
            " + COALESCE(completion_tokens, 0)), 0) AS tokens"
            " FROM request WHERE key_id IS ? AND ts >= ?",
            (key_id, since_ts),
        )[0]
        return int(row["n"]), int(row["tokens"])

    # ---- writer thread ---------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, timeout=self.start_busy_s, isolation_level=None, check_same_thread=False
        )
        conn.row_factory = dict_row
        if not is_memory(self.path):
            conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        for stmt in SCHEMA + durable.SCHEMA:
            conn.execute(stmt)
        add_missing_columns(conn, "request", tuple(zip(COLUMNS, _TYPES)))
        return conn

    def _open(self) -> sqlite3.Connection:
        """The writer's connection, ready for rows: schema, crash recovery, pruning."""
        conn = self._connect()
        self.recovered = durable.recover(conn)
        self._prune(conn)
        _busy(conn, self.row_busy_s)
        return conn

    def _run(self) -> None:
        try:
            conn = self._open()
        except BaseException as exc:  # reported to start()'s caller
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        next_prune = time.monotonic() + self.prune_interval_s
        try:
            while True:
                self._wake.wait(min(self.flush_interval_s, 1.0))
                self._wake.clear()
                if not threading.main_thread().is_alive():
                    self._stopping = True  # interpreter exit without close(): flush, then end
                self._serve_admits(conn)
                self._serve_controls(conn)
                self._drain(conn)
                if time.monotonic() >= next_prune:
                    next_prune = time.monotonic() + self.prune_interval_s
                    self._prune(conn)
                if self._abandon.is_set():
                    self._give_up()
                    break
                if self._stopping and not self._queue and not self._overflow:
                    break
        finally:
            self._serve_admits(conn)
            self._serve_controls(conn)
            conn.close()
            while self._controls:
                self._controls.popleft()[2].set_exception(RuntimeError("store closed"))

    def _take_batch(self) -> list[tuple]:
        batch: list[tuple] = []
        for source in (self._queue, self._overflow):
            while source and len(batch) < self.batch_max:
                batch.append(source.popleft())
        return batch

    def _drain(self, conn: sqlite3.Connection) -> None:
        while not self._abandon.is_set():
            batch = self._take_batch()
            if not batch:
                return
            # an admission queued before its row was put is on disk before the row's delete
            self._serve_admits(conn)
            self._write_with_retry(conn, batch)
            self._serve_admits(conn)
            self._serve_controls(conn)

    def _write_with_retry(self, conn: sqlite3.Connection, batch: list[tuple]) -> None:
        now = time.time()
        rows = [(clean(v[:-1], now), v[-1]) for v in batch]
        delay = self.retry_base_s
        while True:
            try:
                self._commit(conn, rows)
                self._settle(len(rows), written=True)
                return
            except sqlite3.OperationalError as exc:  # locked, disk full, I/O: keep the rows
                self.write_errors += 1
                self._warn("write", f"write failed ({exc}); retrying, rows kept")
            except sqlite3.Error as exc:  # a row SQLite refuses: isolate it
                self.write_errors += 1
                self._write_one_by_one(conn, rows, exc)
                return
            if self._backoff(conn, delay):
                self._settle(len(rows), written=False)
                return
            delay = min(delay * 2, self.retry_max_s)
            self._serve_admits(conn)
            self._serve_controls(conn)

    def _backoff(self, conn: sqlite3.Connection, delay: float) -> bool:
        """Wait `delay` before a batch is retried, serving admissions (and queries) as they
        come meanwhile: a request waiting for its admission is not held behind the backoff.
        True when close() gave up on the rows."""
        end = time.monotonic() + delay
        while not self._abandon.is_set() and (left := end - time.monotonic()) > 0:
            if self._wake.wait(left):
                self._wake.clear()
                self._serve_admits(conn)
                self._serve_controls(conn)
        return self._abandon.is_set()

    def _write_one_by_one(self, conn: sqlite3.Connection, rows: list[tuple], exc) -> None:
        for row in rows:
            try:
                self._commit(conn, [row])
                self._settle(1, written=True)
            except sqlite3.Error:
                self._settle(1, written=False)
        self._warn("reject", f"rows SQLite rejected were dropped ({exc})")

    def _commit(self, conn: sqlite3.Connection, rows: list[tuple]) -> None:
        """Rows as (values, admission id or None): each row replaces its admission."""
        conn.execute("BEGIN")
        try:
            self._insert(conn, [r for r, _ in rows])
            done = [(a,) for _, a in rows if a is not None]
            if done:
                conn.executemany(durable.DELETE, done)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _insert(self, conn: sqlite3.Connection, rows: list[tuple]) -> None:
        conn.executemany(INSERT, rows)

    def _settle(self, n: int, written: bool) -> None:
        with self._settled_cv:
            if written:
                self.rows_written += n
            else:
                self.rows_dropped += n
            self._settled += n
            self._settled_cv.notify_all()

    def _give_up(self) -> None:
        left = len(self._queue) + len(self._overflow)
        self._queue.clear()
        self._overflow.clear()
        if left:
            self._settle(left, written=False)
        self._warn("close", f"closed with the database failing; {self.rows_dropped} rows dropped")

    def _prune(self, conn: sqlite3.Connection) -> None:
        if self.retention_days <= 0:
            return
        cutoff = time.time() - self.retention_days * 86400.0
        try:
            self.rows_pruned += conn.execute("DELETE FROM request WHERE ts < ?", (cutoff,)).rowcount
        except sqlite3.Error as exc:
            self.write_errors += 1
            self._warn("prune", f"prune failed ({exc})")

    def _serve_admits(self, conn: sqlite3.Connection) -> None:
        """Commit every waiting admission in one transaction, then wake their callers."""
        if not self._admits:
            return
        waiting = []
        while self._admits:
            waiting.append(self._admits.popleft())
        error = None
        try:
            _busy(conn, self.admit_busy_s)  # a locked database: fail fast, the request waits
            try:
                durable.insert(conn, [v for v, _, _ in waiting])
            finally:
                _busy(conn, self.row_busy_s)
        except sqlite3.Error as exc:
            self.write_errors += 1
            self._warn("admit", f"admission records not written ({exc})")
            error = exc
        for _, loop, fut in waiting:
            try:
                loop.call_soon_threadsafe(_resolve, fut, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _serve_controls(self, conn: sqlite3.Connection) -> None:
        while self._controls:
            sql, params, fut = self._controls.popleft()
            try:
                fut.set_result(conn.execute(sql, params).fetchall())
            except BaseException as exc:
                fut.set_exception(exc)


def _busy(conn: sqlite3.Connection, seconds: float) -> None:
    conn.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")


def _retrieved(fut) -> None:
    """Mark an admission's outcome seen (its caller may have stopped waiting)."""
    if not fut.cancelled():
        fut.exception()


def _resolve(fut, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(RuntimeError(f"admission not durable: {error}"))

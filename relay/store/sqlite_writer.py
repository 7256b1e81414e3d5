"""The writing half of the SQLite store: the queue rows wait in, and the one writer thread
that owns the writing connection.

The writer wakes every `flush_interval_s` (or at once when a batch is ready, or on
flush/close/query), writes the rows in transactions of up to `batch_max` rows, retries a
failed batch with backoff (keeping its rows), commits admission records as they come (a
request waits for its own), and prunes rows older than `retention_days` at start and about
once an hour. A usage read (`_reads`) names a point of the row queue: it runs once every row
before that point is settled and before any row after it is written, so it sees the rows of
exactly the requests settled when it was asked. `store.sqlite.Store` is the event loop's
side of it.
"""

from __future__ import annotations

import collections
import os
import sqlite3
import threading
import time

from relay.observe.log import Log
from relay.store import admissions as durable
from relay.store.migrate import add_missing_columns
from relay.store.schema import COLUMN_TYPES, INSERT, SCHEMA, clean
from relay.store.sqlite_file import dict_row, is_memory

OVERFLOW_MAX = 100_000
WARN_INTERVAL_S = 10.0


class RowWriter:
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
        self._reads: collections.deque = collections.deque()  # (rows before, windows, future)
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
        add_missing_columns(conn, "request", COLUMN_TYPES)
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
            for waiting in (self._controls, self._reads):
                while waiting:
                    fut = waiting.popleft()[2]
                    if fut.set_running_or_notify_cancel():
                        fut.set_exception(RuntimeError("store closed"))

    def _take_batch(self) -> list[tuple]:
        batch: list[tuple] = []
        most = self.batch_max
        while self._reads and self._reads[0][2].cancelled():
            self._reads.popleft()
        if self._reads:  # not past the point a usage read waits at
            most = min(most, max(0, self._reads[0][0] - self._settled))
        for source in (self._queue, self._overflow):
            while source and len(batch) < most:
                batch.append(source.popleft())
        return batch

    def _drain(self, conn: sqlite3.Connection) -> None:
        while not self._abandon.is_set():
            self._serve_controls(conn)  # (a usage read due before these rows: now)
            batch = self._take_batch()
            if not batch:
                return
            # an admission queued before its row was put is on disk before the row's delete
            self._serve_admits(conn)
            self._write_with_retry(conn, batch)
            self._serve_admits(conn)

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
        while self._reads and self._reads[0][0] <= self._settled:
            _, windows, fut = self._reads.popleft()
            if not fut.set_running_or_notify_cancel():
                continue  # (its caller stopped waiting)
            try:
                fut.set_result([self._usage_at(conn, *w) for w in windows])
            except BaseException as exc:
                fut.set_exception(exc)

    def _usage_at(self, conn: sqlite3.Connection, key_id: str, since_ts: float) -> tuple:
        """A key's charged usage since a time, from the committed rows."""
        row = conn.execute(usage_sql(served_only=True), (key_id, since_ts)).fetchone()
        return int(row["n"]), int(row["tokens"])


def usage_sql(served_only: bool) -> str:
    """(n, tokens) of a key's rows since a time; `served_only` counts only the requests a
    budget charges (store.admissions CHARGED)."""
    count = f"SUM({durable.CHARGED})" if served_only else "COUNT(*)"
    return (
        f"SELECT COALESCE({count}, 0) AS n, COALESCE(SUM(COALESCE(prompt_tokens, 0)"
        " + COALESCE(completion_tokens, 0)), 0) AS tokens"
        " FROM request WHERE key_id IS ? AND ts >= ?"
    )


def _busy(conn: sqlite3.Connection, seconds: float) -> None:
    conn.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")


def _resolve(fut, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(RuntimeError(f"admission not durable: {error}"))

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

import asyncio
import collections
import concurrent.futures
import enum
import os
import sqlite3
import threading
import time
from typing import NamedTuple, TypedDict, TypeVar

from relay.observe.log import Log
from relay.store import admissions as durable
from relay.store.admissions import AdmissionId
from relay.store.migrate import add_missing_columns
from relay.store.schema import COLUMN_TYPES, INSERT, SCHEMA, DbRow, Params, Row, clean
from relay.store.sqlite_file import dict_row, is_memory

OVERFLOW_MAX = 100_000
WARN_INTERVAL_S = 10.0
T = TypeVar("T")
# A row in the writer's queue: its columns' values as they were taken (`clean` makes them
# storable), and its admission id (SQLite) or row id (PostgreSQL), or None.
Queued = tuple[tuple[object, ...], AdmissionId | None]
# A row to commit: its values, then the admission record it replaces (None: none).
Pending = tuple[Row, AdmissionId | None]


class Query(NamedTuple):
    """SQL the writer runs on its own connection (an in-memory database has no other)."""

    sql: str
    params: Params
    answer: concurrent.futures.Future[list[DbRow]]


class Admit(NamedTuple):
    """An admission record to commit; its caller waits for `answer` on `loop`."""

    values: durable.AdmissionValues
    loop: asyncio.AbstractEventLoop
    answer: asyncio.Future[None]


class UsageRead(NamedTuple):
    """The charged usage of each (key, since), read once the first `before` rows accepted
    are settled and before any later row is written."""

    before: int
    windows: list[tuple[str, float]]
    answer: concurrent.futures.Future[list[tuple[int, int]]]


class Settled(enum.Enum):
    """How accepted rows left the queue: committed, given up, or kept in the spill file
    (store.postgres), which counts as settled but neither written nor dropped."""

    WRITTEN = enum.auto()
    DROPPED = enum.auto()
    SPILLED = enum.auto()


class WarningKind(enum.StrEnum):
    """The `kind` of a `store_warning` log line."""

    DROP = "drop"
    WRITE = "write"
    REJECT = "reject"
    CLOSE = "close"
    PRUNE = "prune"
    ADMIT = "admit"
    SPILL = "spill"
    UNREACHABLE = "unreachable"
    MAINTAIN = "maintain"


class WriterOptions(TypedDict, total=False):
    """The writer's tuning, as RowWriter takes it (a subclass passes it on)."""

    batch_max: int
    queue_max: int
    flush_interval_s: float
    overflow_max: int
    prune_interval_s: float


class RowWriter:
    """The queue and the writer thread (see the module's docstring). Counters: rows
    written, dropped and pruned, and failed writes, in all."""

    # The first backoff after a failed batch; it doubles up to retry_max_s.
    retry_base_s = 0.05
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
        # Warnings are JSON log lines like every other.
        self.log = log or Log()
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
        # Rows put() took (only the loop thread writes it), and those of them committed or
        # given up (only the writer thread writes it).
        self._accepted = 0
        self._settled = 0
        self._queue: collections.deque[Queued] = collections.deque()
        self._overflow: collections.deque[Queued] = collections.deque()
        self._controls: collections.deque[Query] = collections.deque()
        self._admits: collections.deque[Admit] = collections.deque()
        self._reads: collections.deque[UsageRead] = collections.deque()
        # Admission ids: a random 31-bit prefix per process above a 32-bit counter (63 bits),
        # so two processes never reuse each other's ids even if they share a file.
        self._admission_ids = (int.from_bytes(os.urandom(4), "big") >> 1) << 32
        self._lock_fd: int | None = None
        # Admissions left by a crash, turned into rows at start.
        self.recovered = 0
        # The writer thread's connection, from `_open` on.
        self._db: sqlite3.Connection
        self._wake = threading.Event()
        self._abandon = threading.Event()
        self._settled_cv = threading.Condition()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._warned_at: dict[WarningKind, float] = {}

    def _warn(self, kind: WarningKind, line: str) -> None:
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

    def _open(self) -> None:
        """The writer's connection, ready for rows: schema, crash recovery, pruning."""
        self._db = conn = self._connect()
        self.recovered = durable.recover(conn)
        self._prune()
        _busy(conn, self.row_busy_s)

    def _disconnect(self) -> None:
        self._db.close()

    def _run(self) -> None:
        try:
            self._open()
        except BaseException as exc:
            # (reported to start()'s caller)
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve()
        finally:
            self._serve_admits()
            self._serve_controls()
            self._disconnect()
            while self._controls:
                _refuse(self._controls.popleft().answer)
            while self._reads:
                _refuse(self._reads.popleft().answer)

    def _serve(self) -> None:
        """Write what comes until the store stops (or close() gives up on the rows)."""
        next_prune = time.monotonic() + self.prune_interval_s
        while True:
            self._wake.wait(min(self.flush_interval_s, 1.0))
            self._wake.clear()
            # An interpreter exiting without close(): flush, then end.
            if not threading.main_thread().is_alive():
                self._stopping = True
            self._serve_admits()
            self._serve_controls()
            self._drain()
            if time.monotonic() >= next_prune:
                next_prune = time.monotonic() + self.prune_interval_s
                self._prune()
            if self._abandon.is_set():
                self._give_up()
                return
            if self._stopping and not self._queue and not self._overflow:
                return

    def _take_batch(self) -> list[Queued]:
        """The next rows to write, never past the point a usage read waits at."""
        batch: list[Queued] = []
        most = self.batch_max
        while self._reads and self._reads[0].answer.cancelled():
            self._reads.popleft()
        if self._reads:
            most = min(most, max(0, self._reads[0].before - self._settled))
        for source in (self._queue, self._overflow):
            while source and len(batch) < most:
                batch.append(source.popleft())
        return batch

    def _drain(self) -> None:
        """Write the queued rows, batch by batch. A usage read due before a batch is served
        first, and an admission queued before its row was put is on disk before the row
        deletes it."""
        while not self._abandon.is_set():
            self._serve_controls()
            batch = self._take_batch()
            if not batch:
                return
            self._serve_admits()
            self._write_with_retry(batch)
            self._serve_admits()

    def _write_with_retry(self, batch: list[Queued]) -> None:
        """Commit a batch. A failure that may pass (locked, disk full, I/O) keeps the rows and
        retries; a row SQLite refuses is isolated (`_write_one_by_one`)."""
        now = time.time()
        rows: list[Pending] = [(clean(values, now), aid) for values, aid in batch]
        delay = self.retry_base_s
        while True:
            try:
                self._commit(self._db, rows)
                self._settle(len(rows), Settled.WRITTEN)
                return
            except sqlite3.OperationalError as exc:
                self.write_errors += 1
                self._warn(WarningKind.WRITE, f"write failed ({exc}); retrying, rows kept")
            except sqlite3.Error as exc:
                self.write_errors += 1
                self._write_one_by_one(rows, exc)
                return
            if self._backoff(delay):
                self._settle(len(rows), Settled.DROPPED)
                return
            delay = min(delay * 2, self.retry_max_s)
            self._serve_admits()
            self._serve_controls()

    def _backoff(self, delay: float) -> bool:
        """Wait `delay` before a batch is retried, serving admissions (and queries) as they
        come meanwhile: a request waiting for its admission is not held behind the backoff.
        True when close() gave up on the rows."""
        end = time.monotonic() + delay
        while not self._abandon.is_set() and (left := end - time.monotonic()) > 0:
            if self._wake.wait(left):
                self._wake.clear()
                self._serve_admits()
                self._serve_controls()
        return self._abandon.is_set()

    def _write_one_by_one(self, rows: list[Pending], exc: sqlite3.Error) -> None:
        for row in rows:
            try:
                self._commit(self._db, [row])
                self._settle(1, Settled.WRITTEN)
            except sqlite3.Error:
                self._settle(1, Settled.DROPPED)
        self._warn(WarningKind.REJECT, f"rows SQLite rejected were dropped ({exc})")

    def _commit(self, conn: sqlite3.Connection, rows: list[Pending]) -> None:
        """Each row replaces its admission record, in one transaction."""
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

    def _insert(self, conn: sqlite3.Connection, rows: list[Row]) -> None:
        conn.executemany(INSERT, rows)

    def _settle(self, n: int, how: Settled) -> None:
        with self._settled_cv:
            if how is Settled.WRITTEN:
                self.rows_written += n
            elif how is Settled.DROPPED:
                self.rows_dropped += n
            self._settled += n
            self._settled_cv.notify_all()

    def _give_up(self) -> None:
        left = len(self._queue) + len(self._overflow)
        self._queue.clear()
        self._overflow.clear()
        if left:
            self._settle(left, Settled.DROPPED)
        self._warn(
            WarningKind.CLOSE, f"closed with the database failing; {self.rows_dropped} rows dropped"
        )

    def _prune(self) -> None:
        if self.retention_days <= 0:
            return
        cutoff = time.time() - self.retention_days * 86400.0
        try:
            self.rows_pruned += self._db.execute(
                "DELETE FROM request WHERE ts < ?", (cutoff,)
            ).rowcount
        except sqlite3.Error as exc:
            self.write_errors += 1
            self._warn(WarningKind.PRUNE, f"prune failed ({exc})")

    def _serve_admits(self) -> None:
        """Commit every waiting admission in one transaction, then wake their callers. A
        locked database fails the records fast (`admit_busy_s`): their requests wait."""
        if not self._admits:
            return
        waiting: list[Admit] = []
        while self._admits:
            waiting.append(self._admits.popleft())
        error = None
        try:
            _busy(self._db, self.admit_busy_s)
            try:
                durable.insert(self._db, [a.values for a in waiting])
            finally:
                _busy(self._db, self.row_busy_s)
        except sqlite3.Error as exc:
            self.write_errors += 1
            self._warn(WarningKind.ADMIT, f"admission records not written ({exc})")
            error = exc
        for admit in waiting:
            # A closed loop has nobody waiting any more.
            try:
                admit.loop.call_soon_threadsafe(_resolve, admit.answer, error)
            except RuntimeError:
                pass

    def _serve_controls(self) -> None:
        """Run the waiting queries, then the usage reads that are due (one whose caller
        stopped waiting is not read)."""
        while self._controls:
            sql, params, answer = self._controls.popleft()
            try:
                answer.set_result(self._db.execute(sql, params).fetchall())
            except BaseException as exc:
                answer.set_exception(exc)
        while self._reads and self._reads[0].before <= self._settled:
            read = self._reads.popleft()
            if not read.answer.set_running_or_notify_cancel():
                continue
            try:
                read.answer.set_result([self._usage_at(*w) for w in read.windows])
            except BaseException as exc:
                read.answer.set_exception(exc)

    def _usage_at(self, key_id: str, since_ts: float) -> tuple[int, int]:
        """A key's charged usage since a time, from the committed rows."""
        row = self._db.execute(usage_sql(served_only=True), (key_id, since_ts)).fetchone()
        return int(row["n"]), int(row["tokens"])


def usage_sql(served_only: bool) -> str:
    """(n, tokens) of a key's rows since a time; `served_only` counts only the requests a
    budget charges (store.admissions CHARGED); each figure clamped (store.admissions TOKENS)."""
    count = f"SUM({durable.CHARGED})" if served_only else "COUNT(*)"
    return (
        f"SELECT COALESCE({count}, 0) AS n, COALESCE(SUM({durable.TOKENS}), 0) AS tokens"
        " FROM request WHERE key_id IS ? AND ts >= ?"
    )


def _busy(conn: sqlite3.Connection, seconds: float) -> None:
    conn.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")


def _refuse(answer: concurrent.futures.Future[T]) -> None:
    """Fail a query or read the writer will not run (unless its caller stopped waiting)."""
    if answer.set_running_or_notify_cancel():
        answer.set_exception(RuntimeError("store closed"))


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(RuntimeError(f"admission not durable: {error}"))

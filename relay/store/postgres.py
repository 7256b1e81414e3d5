"""Request rows and budget leases in PostgreSQL, shared by any number of relays.

The same shape as the SQLite store (store.sqlite, which this extends): `put` snapshots a
row into a bounded deque on the loop thread and never blocks; one writer thread commits
batches. Every row carries a `row_id` unique across relays and restarts (this process's random
relay id and a counter; a keyed request's row id is its lease id), and the insert ignores a
row the table already has, so writing a row twice leaves it once.

While the server cannot be reached the relay keeps relaying: each batch goes to the spill
file (store.spill, fsync'd) instead, and so does whatever is queued when the relay stops.
The writer tries the server again every `reconnect_s`; once it answers, the spill is
replayed (at start too, before the relay serves) and then emptied - a crash between the
commit and the emptying replays rows the table already has, which changes nothing. A spill
file an older relay left, its rows short of the columns added since, replays as they read
NULL there.

Keyed requests take their reservation in the database (store.pg_budget); `maintain`
renews this relay's leases, turns leases of dead relays into charged rows, and refreshes
the local budget view that serves while the server is away.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import TYPE_CHECKING, Unpack

import psycopg
from psycopg.rows import TupleRow, dict_row

from relay.config import ConfigError, StoreConfig, store_connect
from relay.observe.log import Log
from relay.observe.record import Record
from relay.policy.budget import Budgets, Reservation, window_bounds
from relay.store import pg_sql
from relay.store.admissions import AdmissionId
from relay.store.pg_bound import Watchdog
from relay.store.pg_budget import ConnectKw, SharedBudget, Unavailable
from relay.store.schema import DbRow, Params, Row, clean, record_values
from relay.store.spill import Spill
from relay.store.sqlite import Store
from relay.store.sqlite_writer import Queued, Settled, WarningKind, WriterOptions

if TYPE_CHECKING:
    from relay.store.interface import RowStore

DEFAULT_SPILL = "relay-spill.jsonl"
_LOST = (psycopg.OperationalError, psycopg.InterfaceError)
_KEY = pg_sql.ROW_COLUMNS.index("key_id")


class BlockingKw(ConnectKw, total=False):
    """psycopg.connect's keyword arguments for a blocking connection: the server's, and
    its bounds."""

    connect_timeout: int
    options: str
    tcp_user_timeout: int
    keepalives_idle: int
    keepalives_interval: int
    keepalives_count: int


class PgUnreachable(OSError):
    """PostgreSQL could not be reached or set up when the relay started."""


class PgStore(Store):
    """Rows in PostgreSQL, the spill file while it is away, and the shared budget. Counters
    beside the SQLite store's: rows that went to the spill file, and rows replayed from it
    into the database, in all."""

    connect_timeout_s = 2
    reconnect_s = 0.5
    statement_timeout_ms = 10_000
    # A call the server does not answer (frozen: store.pg_bound) is cut off by the relay a
    # little after the server's own statement_timeout would have ended it; closing, within
    # close_grace_s (what is not written by then goes to the spill file).
    call_timeout_s = statement_timeout_ms / 1000 + 2.0
    close_grace_s = 2.0

    def __init__(
        self,
        url: str,
        kw: ConnectKw,
        spill_path: str = DEFAULT_SPILL,
        reservation_ttl_s: float = 30.0,
        retention_days: float = 30.0,
        log: Log | None = None,
        **opts: Unpack[WriterOptions],
    ) -> None:
        super().__init__(url, retention_days, log=log, **opts)
        # The store's blocking connections (the writer thread's, a read) are bounded by the
        # server (statement timeout), for a server that vanished from the network by TCP
        # itself, and for one that answers nothing by the relay (`watchdog`).
        self.blocking_kw: BlockingKw = {
            **kw,
            "connect_timeout": self.connect_timeout_s,
            "options": f"-c statement_timeout={self.statement_timeout_ms}",
            "tcp_user_timeout": self.statement_timeout_ms,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 3,
        }
        # This process: its leases and its row ids.
        self.relay_id = os.urandom(8).hex()
        self._ids = itertools.count(1)
        self.spill = Spill(spill_path)
        self.rows_spilled = 0
        self.rows_replayed = 0
        self.ttl = reservation_ttl_s
        self.shared = SharedBudget(kw, self.relay_id, reservation_ttl_s)
        # The writer thread's connection; None while the server is away.
        self._conn: psycopg.Connection[TupleRow] | None = None
        self._retry_at = 0.0
        self.watchdog = Watchdog()

    @classmethod
    def configured(cls, cfg: StoreConfig, log: Log) -> PgStore:
        if cfg.url is None:
            raise ConfigError("store.url: not set (SQLite's store.path is store.sqlite's)")
        given = store_connect(cfg)
        kw = ConnectKw(conninfo=given["conninfo"])
        if "password" in given:
            kw["password"] = given["password"]
        return cls(
            cfg.url,
            kw,
            cfg.spill_path or DEFAULT_SPILL,
            cfg.reservation_ttl_s,
            cfg.retention_days,
            log,
        )

    # ---- event-loop side -------------------------------------------------------------
    def next_admission_id(self) -> str:
        return f"{self.relay_id}-{next(self._ids)}"

    def put(self, row: dict[str, object]) -> None:
        """As the SQLite store's; a row with no lease gets a row id of its own."""
        if row.get("admission_id") is None:
            row["admission_id"] = self.next_admission_id()
        super().put(row)

    def put_record(self, rec: Record, admission_id: AdmissionId | None = None) -> None:
        """A settled request's row off its `Record`, as the SQLite store takes it (no dict
        in between); a keyed row's row id is its lease id, any other row gets one of its
        own."""
        if admission_id is None:
            admission_id = self.next_admission_id()
        self._put((record_values(rec), admission_id))

    @property
    def spilled(self) -> int:
        return self.spill.count

    async def admit(
        self,
        admission_id: AdmissionId,
        rec: Record,
        prompt_tokens: int,
        completion_tokens: int,
        timeout: float | None = None,
        res: Reservation | None = None,
    ) -> None:
        """Take the request's lease in the shared budget: BudgetExceeded if a window is
        full across all relays; RuntimeError if the server cannot be asked, or refused the
        call (a deadlock victim, ...): the caller serves on the local budget view."""
        if res is None:
            return
        try:
            exceeded = await self.shared.reserve(
                str(admission_id), res, rec, prompt_tokens, completion_tokens, time.time()
            )
        except Unavailable as exc:
            raise RuntimeError(f"shared budget not asked, the local view holds: {exc}") from None
        except psycopg.Error as exc:
            raise RuntimeError(
                f"shared budget failed, the local view holds: {_first(exc)}"
            ) from None
        if exceeded is not None:
            raise exceeded

    async def maintain(self, budgets: Budgets) -> None:
        """Every third of the lease time: renew this relay's leases, expire dead relays'
        leases, and re-seed the local budget view from the shared usage. While the server
        is away the writer spills and requests use the local view; the next round retries."""
        while True:
            await asyncio.sleep(max(0.02, self.ttl / 3))
            try:
                await self.shared.renew()
                await self.shared.expire()
                await self._reseed(budgets)
            except Unavailable:
                pass
            except psycopg.Error as exc:
                self.log.event("store_warning", kind=WarningKind.MAINTAIN, message=str(exc)[:300])

    async def _reseed(self, budgets: Budgets) -> None:
        """Each window of the local view set to the shared usage (a window a reload removed
        meanwhile is left alone)."""
        now = time.time()
        for key_id in list(budgets.keys):
            for kind in budgets.windows_of(key_id):
                start, _ = window_bounds(kind, now)
                used = await self.shared.usage(key_id, start)
                if kind in budgets.windows_of(key_id):
                    budgets.restore(key_id, kind, *used, time.time())

    async def aclose(self) -> None:
        await self.shared.close()
        await super().aclose()

    def close(self, timeout: float = 10.0) -> None:
        """As the SQLite store's, and a call the server does not answer ends (severed)
        within `close_grace_s`: the rows not written by then are spilled."""
        self.watchdog.cap(self.close_grace_s)
        super().close(timeout)

    # ---- reading ---------------------------------------------------------------------
    def query(self, sql: str, params: Params = ()) -> list[DbRow]:
        """SQLite-style SQL (`?`), read on a short-lived connection."""
        return self._read(pg_sql.portable(sql), params)

    def usage_since(
        self, key_id: str | None, since_ts: float, served_only: bool = False
    ) -> tuple[int, int]:
        row = self._read(pg_sql.USAGE if served_only else pg_sql.COUNT, (key_id, since_ts))[0]
        return int(row["n"]), int(row["tokens"])

    def _usage_at(self, key_id: str, since_ts: float) -> tuple[int, int]:
        """(writer thread) From the database - while rows wait in the spill file it cannot say."""
        if self.spill.count:
            raise PgUnreachable(f"store.url: {self.spill.count} rows wait in the spill file")
        return self.usage_since(key_id, since_ts, served_only=True)

    def _read(self, sql: str, params: Params) -> list[DbRow]:
        """Rows read on a connection of their own; an error is an OSError, as of a SQLite
        file that cannot be read."""
        try:
            with (
                psycopg.connect(**self.blocking_kw, autocommit=True, row_factory=dict_row) as conn,
                self.watchdog.within(conn, self.call_timeout_s),
            ):
                return conn.execute(sql, params).fetchall()
        except psycopg.Error as exc:
            raise PgUnreachable(f"store.url: {_first(exc)}") from None

    # ---- writer thread ---------------------------------------------------------------
    def _acquire(self) -> None:
        """The spill file's lock (one relay per spill file), a torn tail cut off."""
        self.spill.open()

    def _unlock(self) -> None:
        self.spill.close()

    def _open(self) -> None:
        try:
            self._conn = conn = psycopg.connect(**self.blocking_kw, autocommit=True)
            with self.watchdog.within(conn, self.call_timeout_s), conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (pg_sql.SCHEMA_LOCK,))
                for stmt in pg_sql.SETUP:
                    conn.execute(stmt)
        except psycopg.Error as exc:
            self._disconnect()
            raise PgUnreachable(f"store.url: {_first(exc)}") from None
        self.log.event(
            "store_postgres",
            relay_id=self.relay_id,
            url=self.path,
            spill_path=self.spill.path,
            spilled=self.spill.count,
        )
        self._replay()
        self._prune()

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _drain(self) -> None:
        self._reconnect()
        super()._drain()

    def _reconnect(self) -> None:
        """Connect again once `reconnect_s` has passed, and replay the spill file. Not while
        closing: what is left goes to the spill file, the next start sends it."""
        if self._conn is None:
            if self._stopping or time.monotonic() < self._retry_at:
                return
            try:
                self._conn = psycopg.connect(**self.blocking_kw, autocommit=True)
            except _LOST:
                self._retry_at = time.monotonic() + self.reconnect_s
                return
            self.log.event("store_reconnected", spilled=self.spill.count)
        if self.spill.count:
            self._replay()

    def _replay(self) -> None:
        rows = [widened(r) for r in self.spill.read()]
        if not rows:
            return
        try:
            for i in range(0, len(rows), self.batch_max):
                self._commit_pg(rows[i : i + self.batch_max])
        except _LOST as exc:
            self._lost(exc)
            return
        self.spill.clear()
        self.rows_replayed += len(rows)
        self.log.event("spill_replayed", rows=len(rows))

    def _write_with_retry(self, batch: list[Queued]) -> None:
        """Commit a batch, or spill it while the server is away (or rows wait in the spill
        file: they go first). A row the server refuses is isolated (`_write_one_by_one_pg`)."""
        now = time.time()
        rows = [_pg_row(q, now) for q in batch]
        if self._conn is not None and not self.spill.count:
            try:
                self._commit_pg(rows)
                self._settle(len(rows), Settled.WRITTEN)
                return
            except _LOST as exc:
                self._lost(exc)
            except psycopg.Error as exc:
                self.write_errors += 1
                self._write_one_by_one_pg(rows, exc)
                return
        self._to_spill(rows)

    def _write_one_by_one_pg(self, rows: list[Row], exc: psycopg.Error) -> None:
        for row in rows:
            try:
                self._commit_pg([row])
                self._settle(1, Settled.WRITTEN)
            except _LOST as lost:
                self._lost(lost)
                self._to_spill([row])
            except psycopg.Error:
                self._settle(1, Settled.DROPPED)
        self._warn(WarningKind.REJECT, f"rows PostgreSQL rejected were dropped ({_first(exc)})")

    def _to_spill(self, rows: list[Row]) -> None:
        """Append the rows to the spill file; a failure (disk full) keeps them and retries.
        Spilled, they are durable (locally): flush() need not wait for them."""
        delay = self.retry_base_s
        while True:
            try:
                self.spill.append(rows)
                break
            except OSError as exc:
                self.write_errors += 1
                self._warn(
                    WarningKind.SPILL, f"spill file not written ({exc}); retrying, rows kept"
                )
            if self._backoff(delay):
                self._settle(len(rows), Settled.DROPPED)
                return
            delay = min(delay * 2, self.retry_max_s)
        self.rows_spilled += len(rows)
        self._settle(len(rows), Settled.SPILLED)

    def _commit_pg(self, rows: list[Row]) -> None:
        """Rows (values, row id): each row in once, and its lease (if any) gone with it.
        The leases go first: a concurrent expiry of one of them (its relay_reserve or
        `expire` locks the lease, then inserts under the row's id) waits for this
        transaction and then finds nothing, instead of the two waiting on each other. The
        rows go in by key: each locks its key's usage_day row (pg_sql.USAGE_DAY), so two
        relays' batches lock them in one order and never wait on each other."""
        conn = self._conn
        # Only called with the connection up (`_write_with_retry`, `_replay`).
        assert conn is not None
        with (
            self.watchdog.within(conn, self.call_timeout_s),
            conn.transaction(),
            conn.cursor() as cur,
        ):
            cur.execute(pg_sql.DELETE_LEASES, ([r[-1] for r in rows],))
            ordered = sorted(rows, key=_by_key)
            cur.executemany(pg_sql.INSERT, ordered)

    def _lost(self, exc: BaseException) -> None:
        self.write_errors += 1
        self._warn(
            WarningKind.UNREACHABLE,
            f"PostgreSQL unreachable ({_first(exc)}); rows go to "
            f"the spill file {self.spill.path!r}",
        )
        try:
            if self._conn is not None:
                self._conn.close()
        except Exception:
            pass
        self._conn = None
        self._retry_at = time.monotonic() + self.reconnect_s

    def _give_up(self) -> None:
        """close() stopped waiting for the server: the rest goes to the spill file."""
        rows = []
        now = time.time()
        for source in (self._queue, self._overflow):
            while source:
                rows.append(_pg_row(source.popleft(), now))
        if rows:
            self._to_spill(rows)

    def _prune(self) -> None:
        """As the SQLite store's, while the server is up; a connection cut off is not used
        again."""
        if self.retention_days <= 0 or self._conn is None:
            return
        cutoff = time.time() - self.retention_days * 86400.0
        try:
            with self.watchdog.within(self._conn, self.call_timeout_s):
                self.rows_pruned += self._conn.execute(pg_sql.PRUNE, (cutoff,)).rowcount
        except _LOST as exc:
            self._lost(exc)
        except psycopg.Error as exc:
            self.write_errors += 1
            self._warn(WarningKind.PRUNE, f"prune failed ({_first(exc)})")


def _pg_row(queued: Queued, now: float) -> Row:
    """A queued row as PostgreSQL takes it: its columns, booleans as 0/1 (the columns are
    integers, as in SQLite), then its row id."""
    values, row_id = queued
    return tuple(int(v) if v is True or v is False else v for v in clean(values, now)) + (row_id,)


def widened(row: Row) -> Row:
    """A spilled row as the table takes it now: one an older relay spilled lacks the columns
    added since (columns are only ever added, at the end: store.schema ADDED), which read
    NULL, as its rows in the table do."""
    missing = len(pg_sql.ROW_COLUMNS) - len(row)
    if missing <= 0:
        return row
    return row[:-1] + (None,) * missing + row[-1:]


def _by_key(row: Row) -> str:
    key = row[_KEY]
    return key if isinstance(key, str) else ""


def _first(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


if TYPE_CHECKING:
    # Checked by mypy, free at run time: the PostgreSQL store is a RowStore.
    _checked: type[RowStore] = PgStore

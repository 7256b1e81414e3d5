"""Budgets shared by every relay on one PostgreSQL: the reservation is taken in the database.

`SharedBudget.reserve` runs `relay_reserve` (store.pg_sql) in one round trip on a small
pool of asyncio connections (psycopg's AsyncConnection on the relay's own loop): under a
per-key lock the database checks settled usage plus live leases against every window and
inserts the lease, so N relays against one key admit exactly the limit. A lease lives
`reservation_ttl_s`; `renew` (every third of it) keeps a live relay's leases, and the row that
settles a request deletes its lease in the same transaction (store.postgres).

A call gets `timeout_s` in all - a free connection, connecting, the answer - and a server
that does not answer in time is cut off (store.pg_bound: a frozen server accepts the
connection and never answers, so only the relay can end the wait). When the server cannot
be reached (refused, reset, or no answer in time) the call raises Unavailable - for
`retry_s` further calls fail fast without trying, and then, until one succeeds, one call at a
time asks while the others fail fast - and the caller serves on the relay's local budget
view (policy.budget), which `maintain` keeps seeded with the shared usage. `decision` is
the pure part: the function's answer -> None or BudgetExceeded.

psycopg is imported only where a call is made: the pure part is read without the driver.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypedDict, TypeVar

from relay.observe.record import Record
from relay.policy.budget import BudgetExceeded, Reservation
from relay.store import pg_sql
from relay.store.pg_bound import NoAnswer, bounded

if TYPE_CHECKING:
    from psycopg import AsyncConnection, AsyncCursor
    from psycopg.rows import TupleRow

T = TypeVar("T")


class ConnectKw(TypedDict, total=False):
    """psycopg.connect's keyword arguments for a server: its URL and the password (from
    the environment: config.pg_connect_kwargs)."""

    conninfo: str
    password: str


# What a call reads off its cursor once the statement ran.
Reader = Callable[["AsyncCursor[TupleRow]"], Awaitable[T]]


class Unavailable(RuntimeError):
    """The shared budget cannot be asked now (PostgreSQL unreachable)."""


def reserve_params(
    lease_id: str,
    relay_id: str,
    ttl: float,
    res: Reservation,
    rec: Record,
    prompt: int,
    completion: int,
) -> tuple[object, ...]:
    """relay_reserve's arguments: the lease, the request, the windows of `res` (the local
    reservation: its windows carry kind, start and limits)."""
    ws = res.windows
    return (
        lease_id,
        relay_id,
        res.key_id,
        res.tokens,
        ttl,
        rec.ts,
        rec.request_id,
        rec.path,
        rec.model,
        int(rec.stream),
        rec.upstream_requested,
        prompt,
        completion,
        [w.kind for w in ws],
        list(res.starts),
        [w.req_limit for w in ws],
        [w.tok_limit for w in ws],
    )


def decision(answer: str | None, res: Reservation, now: float) -> BudgetExceeded | None:
    """None: the lease is taken. Else the function named the full window and its usage
    ("daily_requests 10"): the BudgetExceeded a local refusal would raise (what the request
    asked of it: 1 request, or the tokens it reserves)."""
    if answer is None:
        return None
    limit, _, used = answer.partition(" ")
    kind, _, what = limit.rpartition("_")
    for w in res.windows:
        if w.kind == kind:
            if what == "requests":
                return BudgetExceeded(limit, int(used), 1, w.req_limit, w.end, now)
            return BudgetExceeded(limit, int(used), res.tokens, w.tok_limit, w.end, now)
    raise ValueError(f"relay_reserve answered {answer!r} for no window of the request")


class SharedBudget:
    """The shared budget's calls. `unavailable`: the calls that found the server
    unreachable, in all."""

    pool_size = 4

    def __init__(
        self,
        connect_kwargs: ConnectKw,
        relay_id: str,
        ttl: float,
        timeout_s: float = 2.0,
        retry_s: float = 0.5,
    ) -> None:
        self.kw = connect_kwargs
        self.relay_id = relay_id
        self.ttl = ttl
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.unavailable = 0
        self._idle: list[AsyncConnection[TupleRow]] = []
        self._sem: asyncio.Semaphore | None = None
        self._down_until = 0.0
        # The last call failed and none succeeded since; while so, a call asking the server
        # is `probing`.
        self._suspect = False
        self._probing = False

    async def reserve(
        self, lease_id: str, res: Reservation, rec: Record, prompt: int, completion: int, now: float
    ) -> BudgetExceeded | None:
        params = reserve_params(lease_id, self.relay_id, self.ttl, res, rec, prompt, completion)
        row = await self._one(pg_sql.RESERVE, params, _answer)
        return decision(row[0], res, now)

    async def renew(self) -> None:
        """Keep this relay's leases (in flight, or settled with the row not yet written)."""
        await self._one(pg_sql.RENEW, (self.ttl, self.relay_id), _nothing)

    async def expire(self) -> None:
        """Leases whose relay stopped renewing them become charged rows (any key)."""
        await self._one(pg_sql.EXPIRE_ALL, (), _nothing)

    async def usage(self, key_id: str, since_ts: float) -> tuple[int, int]:
        row = await self._one(pg_sql.USAGE, (key_id, since_ts), _answer)
        return int(row[0]), int(row[1])

    async def close(self) -> None:
        while self._idle:
            await self._idle.pop().close()

    # ---- the pool ------------------------------------------------------------------------
    async def _one(self, sql: str, params: tuple[object, ...], read: Reader[T]) -> T:
        """One statement on a pooled connection, all of it - the wait for a free connection,
        connecting, the answer (`read` off its cursor) - within `timeout_s` (store.pg_bound:
        a frozen server is cut off). After a failure, until a call succeeds, one call at a
        time asks the server; the others fail fast meanwhile, as they do for `retry_s` after
        each failure (and as does a call whose wait for a connection ends as the calls
        holding them fail, or one that finds the server went down while it waited)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.pool_size)
        self._check_down()
        try:
            async with asyncio.timeout_at(deadline):
                await self._sem.acquire()
        except TimeoutError:
            self._check_down()
            self.unavailable += 1
            raise Unavailable(f"PostgreSQL: no connection free within {self.timeout_s}s") from None
        try:
            self._check_down()
            probe = self._suspect
            if probe:
                self._probing = True
            try:
                answer = await self._ask(sql, params, read, deadline)
            finally:
                if probe:
                    self._probing = False
            self._suspect = False
            return answer
        finally:
            self._sem.release()

    async def _ask(
        self, sql: str, params: tuple[object, ...], read: Reader[T], deadline: float
    ) -> T:
        """The call on an idle connection, or a new one. A pooled connection that fails
        may have died with the server: the idle ones are dropped and a new one tries once;
        a new one that fails means the server is gone for now. A call cut off (severed) is
        not sent again: its statement may still run once the server wakes up."""
        loop = asyncio.get_running_loop()
        fresh = not self._idle
        while True:
            conn = self._idle.pop() if self._idle else await self._connect(deadline)
            try:
                answer = await bounded(conn, _call(conn, sql, params, read), deadline - loop.time())
            except NoAnswer:
                await self._drop_idle()
                self._failed()
                raise Unavailable(f"PostgreSQL: no answer within {self.timeout_s}s") from None
            except asyncio.CancelledError:
                # (severed by `bounded`)
                raise
            except BaseException as exc:
                await _discard(conn)
                if not _retryable(exc):
                    raise
                await self._drop_idle()
                if fresh:
                    self._failed()
                    raise Unavailable(f"PostgreSQL: {_why(exc)}") from None
                fresh = True
                continue
            self._idle.append(conn)
            return answer

    async def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for c in idle:
            await _discard(c)

    def _check_down(self) -> None:
        if time.monotonic() < self._down_until or (self._suspect and self._probing):
            self.unavailable += 1
            raise Unavailable("PostgreSQL unreachable (retrying shortly)")

    async def _connect(self, deadline: float) -> AsyncConnection[TupleRow]:
        import psycopg

        try:
            async with asyncio.timeout_at(deadline):
                return await psycopg.AsyncConnection.connect(
                    **self.kw, autocommit=True, connect_timeout=max(1, int(self.timeout_s))
                )
        except (OSError, TimeoutError, psycopg.Error) as exc:
            self._failed()
            raise Unavailable(f"PostgreSQL: {_why(exc)}") from None

    def _failed(self) -> None:
        self.unavailable += 1
        self._suspect = True
        self._down_until = time.monotonic() + self.retry_s


async def _answer(cur: AsyncCursor[TupleRow]) -> TupleRow:
    """The one row a function answers with (relay_reserve, relay_used)."""
    row = await cur.fetchone()
    assert row is not None
    return row


async def _nothing(cur: AsyncCursor[TupleRow]) -> None:
    """A statement that answers no row (renew, expire)."""


async def _call(
    conn: AsyncConnection[TupleRow], sql: str, params: tuple[object, ...], read: Reader[T]
) -> T:
    cur = await conn.execute(sql, params)
    return await read(cur)


def _retryable(exc: BaseException) -> bool:
    import psycopg

    return isinstance(
        exc, (psycopg.OperationalError, psycopg.InterfaceError, OSError, TimeoutError)
    )


def _why(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


async def _discard(conn: AsyncConnection[TupleRow]) -> None:
    try:
        await conn.close()
    except Exception:
        pass

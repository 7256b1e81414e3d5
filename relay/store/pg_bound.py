"""Client-side bounds on PostgreSQL calls: a server that does not answer is cut off by the relay.

A server that is down refuses or resets the connection: a call fails at once. A server that
is frozen (SIGSTOP, a host swapping itself to death) accepts the TCP connection and its kernel
ACKs every byte, but nothing ever answers: `statement_timeout` is the server's own and never
fires, TCP keepalives and `tcp_user_timeout` are satisfied by its kernel, and a call waits
until the server wakes up. Only the client can end that wait. `sever(conn)` shuts the
connection's socket down (both ways): the call blocked on it returns at once with an
OperationalError, as if the server had reset it, and the connection is broken for good - its
owner closes it and never uses it again (the descriptor stays the connection's until then, so
it cannot be reused under it).

- `Watchdog`: blocking calls (the writer thread's, a read): the connection is severed when
  the call runs past its deadline (or past the store's closing deadline, `cap`);
- `bounded`: an asyncio call (psycopg's AsyncConnection) awaited at most so long. The call
  runs in a task of its own that is never cancelled - psycopg answers a cancellation by
  asking the server to cancel the query and waiting for that, 10 s on a frozen server - but
  severed, and closed once it has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import socket
import threading
import time
from collections.abc import Awaitable, Iterator
from typing import Protocol, TypeVar

T = TypeVar("T")


class _Socket(Protocol):
    @property
    def socket(self) -> int: ...


class Severable(Protocol):
    """What the bounds touch of a psycopg connection, sync or async: its socket."""

    @property
    def pgconn(self) -> _Socket: ...


class AsyncSeverable(Severable, Protocol):
    """An asyncio connection: severed, then closed (`bounded`)."""

    async def close(self) -> None: ...


def sever(conn: Severable) -> None:
    """Shut the socket of a psycopg connection (sync or async) down: whatever waits on it
    returns now, with an error. Nothing if the connection is closed already (its socket
    cannot be read: nothing waits on it)."""
    try:
        fd = conn.pgconn.socket
    except Exception:
        return
    # A duplicate of the descriptor, shut down and closed: shutdown acts on the socket, and
    # the descriptor itself stays the connection's.
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


class Watchdog:
    """Severs a connection whose blocking call outlives its deadline. One thread, running
    only while some call is armed; any thread may arm calls (`within`). `severed`: the calls
    cut off, in all."""

    def __init__(self) -> None:
        self.severed = 0
        self._cv = threading.Condition()
        # The armed calls: token -> (deadline, connection).
        self._armed: dict[int, tuple[float, Severable]] = {}
        self._tokens = itertools.count()
        self._cap = math.inf
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def within(self, conn: Severable, seconds: float) -> Iterator[None]:
        """The block's calls on `conn` end within `seconds` (severed: OperationalError)."""
        with self._cv:
            token = next(self._tokens)
            self._armed[token] = (time.monotonic() + seconds, conn)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="relay-pg-watchdog", daemon=True
                )
                self._thread.start()
            self._cv.notify()
        try:
            yield
        finally:
            with self._cv:
                self._armed.pop(token, None)

    def cap(self, seconds: float) -> None:
        """From now on no call waits past `seconds` from now (the store is closing)."""
        with self._cv:
            self._cap = min(self._cap, time.monotonic() + seconds)
            self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while self._armed:
                now = time.monotonic()
                due = math.inf
                # Under the lock, an armed call is still in its block when it is severed.
                for token, (own_deadline, conn) in list(self._armed.items()):
                    deadline = min(own_deadline, self._cap)
                    if deadline <= now:
                        del self._armed[token]
                        sever(conn)
                        self.severed += 1
                    else:
                        due = min(due, deadline)
                if due < math.inf:
                    self._cv.wait(due - now)
            self._thread = None


class NoAnswer(TimeoutError):
    """A call on PostgreSQL did not end in time; its connection was severed."""


async def bounded(conn: AsyncSeverable, call: Awaitable[T], timeout: float) -> T:
    """Await `call` (a coroutine using `conn`) for at most `timeout` seconds. NoAnswer
    when it does not end in time; a cancelled caller is cancelled all the same. In both
    cases `conn` is severed and closed once the call has ended: the caller drops it."""
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait((task,), timeout=max(0.0, timeout))
    except asyncio.CancelledError:
        _abandon(conn, task)
        raise
    if not done:
        _abandon(conn, task)
        raise NoAnswer(f"no answer within {timeout:.2f}s")
    return task.result()


# Severed calls still ending (a strong reference to each).
_reaping: set[asyncio.Future[None]] = set()


def _abandon(conn: AsyncSeverable, task: asyncio.Future[T]) -> None:
    sever(conn)
    reaper = asyncio.ensure_future(_reap(conn, task))
    _reaping.add(reaper)
    reaper.add_done_callback(_reaping.discard)


async def _reap(conn: AsyncSeverable, task: asyncio.Future[T]) -> None:
    """Close the connection once its call has returned: closing it while the call still
    waits on its descriptor would pull the descriptor from under the event loop."""
    try:
        await task
    except BaseException:
        pass
    try:
        await conn.close()
    except Exception:
        pass

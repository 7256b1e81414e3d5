"""Slot accounting for one upstream: `parallel` slots, a bounded FIFO queue of waiters.

A slot is held from admission until the client has drained the response or gone. `Slot`
releases exactly once however many exit paths call `release()`; a freed slot passes straight
to the oldest waiter, so order is first come, first served.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from relay.store.admissions import AdmissionId


class Busy(Exception):
    """No slot: the queue is full, or none came free within the wait bound."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SlotsClosed(Exception):
    """The relay is shutting down: no slot will be handed out any more."""


class SlotLease(Protocol):
    """One slot held by a request: `release` gives it back, at most once however often it is
    called."""

    def release(self) -> None: ...


class Slots(Protocol):
    """An upstream's slots as the proxy takes them: the process's own `SlotPool`, or in a
    worker process the parent's, through the worker's link (relay.workers)."""

    @property
    def in_flight(self) -> int: ...

    @property
    def queued(self) -> int: ...

    def close(self) -> None: ...

    def resize(self, parallel: int, queue: int) -> None: ...

    async def acquire(self, timeout: float, admission: AdmissionId | None = None) -> SlotLease: ...


class Slot:
    __slots__ = ("pool", "released")

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool._free()


class SlotPool:
    def __init__(self, parallel: int, queue: int) -> None:
        self.parallel = parallel
        self.queue = queue
        self.in_flight = 0
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.closed = False

    def close(self) -> None:
        """No slot from now on: every waiter is told at once (the relay is draining)."""
        self.closed = True
        waiters, self.waiters = self.waiters, deque()
        for fut in waiters:
            if not fut.done():
                fut.set_exception(SlotsClosed())

    def resize(self, parallel: int, queue: int) -> None:
        """New bounds (a config reload): waiters take slots that the new bound frees; held
        slots above a lower bound are simply not handed on when released."""
        self.parallel, self.queue = parallel, queue
        while self.waiters and self.in_flight < self.parallel:
            fut = self.waiters.popleft()
            if not fut.done():
                self.in_flight += 1
                fut.set_result(None)

    @property
    def queued(self) -> int:
        return len(self.waiters)

    async def acquire(self, timeout: float, admission: AdmissionId | None = None) -> Slot:
        """A slot within `timeout` (Busy, SlotsClosed). `admission`: the request's admission
        record, by which a worker process finds the slot asked for with it (relay.workers)."""
        if self.closed:
            raise SlotsClosed()
        if self.in_flight < self.parallel and not self.waiters:
            self.in_flight += 1
            return Slot(self)
        if len(self.waiters) >= self.queue or timeout <= 0:
            raise Busy("queue full" if self.queue else "no free slot")
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Granted just as the wait ran out.
                return Slot(self)
            fut.cancel()
            self._forget(fut)
            raise Busy(f"no slot free within {timeout}s") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Granted, but the caller is gone: it is passed on.
                self._free()
            else:
                fut.cancel()
                self._forget(fut)
            raise
        return Slot(self)

    def _forget(self, fut: asyncio.Future[None]) -> None:
        try:
            self.waiters.remove(fut)
        except ValueError:
            pass

    def _free(self) -> None:
        while self.waiters and self.in_flight <= self.parallel:
            fut = self.waiters.popleft()
            if not fut.done():
                # The slot moves on: in_flight is unchanged.
                fut.set_result(None)
                return
        self.in_flight -= 1

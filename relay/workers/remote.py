"""A worker's link to its parent and its stand-ins for the parent's relay-wide state
(relay.workers.worker): the `Link` (answers awaited, messages sent, what the parent tells);
slots taken
from the parent's pools, budgets whose every check is the parent's, a store whose rows and
admission records go to the parent. Each speaks the interface of what it stands in for
(`SlotPool`, `Budgets`, the store), over the worker's `Link`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import time
from typing import Any

from relay.observe.record import field_values
from relay.observe.ui_state import generating
from relay.policy.budget import BudgetExceeded, Budgets, Reservation
from relay.proxy.dispatch import ADMIT_WAIT_S
from relay.proxy.slots import Busy, SlotsClosed
from relay.workers import wire

ANSWER_GRACE_S = 10.0  # past its own bound, a parent that has not answered is not answering
PARENT_GONE_EXIT = 3


class Link:
    """The worker's end of its socket to the parent: requests with answers, and messages."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.app: Any = None  # the WorkerApp it serves (its `told`, `log`)
        self.outbox = wire.Outbox(writer)
        self.send = self.outbox.send
        # slots asked for with a keyed request's admission (one round trip for both), by its
        # admission id: (upstream, the slot's exchange id, its answer)
        self.ahead: dict[int, tuple[str, int, asyncio.Future]] = {}

    def ask_later(self) -> tuple[int, asyncio.Future]:
        """An id and the future of an answer asked for inside another message."""
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[i] = fut
        return i, fut

    def ask(self, kind: str, *body) -> tuple[int, asyncio.Future]:
        i, fut = self.ask_later()
        self.send([kind, i, *body])
        return i, fut

    def forget(self, i: int) -> None:
        self.pending.pop(i, None)

    def give_back(self, i: int) -> None:
        """The slot of exchange `i` is not wanted (granted or not yet): the parent frees it."""
        self.forget(i)
        self.send(["unslot", i])

    def drop_ahead(self, admission) -> tuple[str, int, asyncio.Future] | None:
        """The slot asked for with an admission, no longer awaited here (the parent frees an
        unclaimed one when the row comes, and takes none for a refused admission)."""
        ahead = self.ahead.pop(admission, None)
        if ahead is not None:
            self.forget(ahead[1])
        return ahead

    async def run(self) -> None:
        """Read the parent's messages until it is gone; then this process ends at once (a
        worker that cannot hear its parent must not go on taking connections)."""
        try:
            while True:
                message = await wire.read(self.reader)
                if message is None:
                    break
                kind, body = message[0], message[1:]
                if kind in ("slot", "admit", "view"):
                    fut = self.pending.pop(body[0], None)
                    if fut is not None and not fut.done():
                        fut.set_result(body[1:])
                elif self.app is not None:
                    try:
                        self.app.told(kind, body)
                    except Exception as exc:  # a bug: said, and the link goes on
                        self.app.log.event(
                            "internal_error", error=f"{type(exc).__name__}: {exc}"[:300]
                        )
        except asyncio.CancelledError:
            raise
        except BaseException:
            pass
        os._exit(PARENT_GONE_EXIT)  # its streams cannot settle anywhere now


class RemoteSlot:
    __slots__ = ("i", "pool", "released")

    def __init__(self, pool: RemoteSlots, i: int) -> None:
        self.pool, self.i, self.released = pool, i, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool.in_flight -= 1
            self.pool.link.send(["free", self.i])


class RemoteSlots:
    """An upstream's slots as a worker takes them: from the parent's pool (`SlotPool`'s
    interface; `in_flight` and `queued` are this worker's share)."""

    def __init__(self, link: Link, name: str, parallel: int, queue: int) -> None:
        self.link, self.name = link, name
        self.parallel, self.queue = parallel, queue
        self.in_flight = 0
        self.waiters: set[asyncio.Future] = set()
        self.closed = False

    @property
    def queued(self) -> int:
        return len(self.waiters)

    def close(self) -> None:
        self.closed = True
        for fut in list(self.waiters):
            if not fut.done():
                fut.set_exception(SlotsClosed())

    def resize(self, parallel: int, queue: int) -> None:
        self.parallel, self.queue = parallel, queue  # (the parent's pool is resized there)

    async def acquire(self, timeout: float, admission=None) -> RemoteSlot:
        if self.closed:
            raise SlotsClosed()
        ahead = self.link.ahead.pop(admission, None) if admission is not None else None
        if ahead is not None and ahead[0] == self.name:
            _, i, fut = ahead  # asked for with the admission: its answer is on its way, or in
        else:
            if ahead is not None:  # (asked on another upstream: given back)
                self.link.give_back(ahead[1])
            i, fut = self.link.ask("slot", self.name, timeout)
        self.waiters.add(fut)
        try:
            try:  # (the parent answers within `timeout`; beyond, it is not answering)
                answer, why = await asyncio.wait_for(fut, timeout + ANSWER_GRACE_S)
            except TimeoutError:  # (a grant that comes after all goes back)
                self.link.give_back(i)
                answer, why = "busy", "the relay's slots did not answer"
        except BaseException:  # cancelled, or closed here: a slot granted meanwhile goes back
            self.link.give_back(i)
            raise
        finally:
            self.waiters.discard(fut)
        if answer == "ok":
            self.in_flight += 1
            return RemoteSlot(self, i)
        if answer == "closed":
            raise SlotsClosed()
        raise Busy(why)


class LooseBudgets(Budgets):
    """A worker's budgets: the keys and limits of its configuration, every check and every
    figure the parent's. `reserve` only says whether the request must be admitted there (a
    key with limits: `RemoteStore.admit`)."""

    def reserve(self, key_id: str, tokens: int, now: float) -> Reservation:
        kb = self.keys.get(key_id)
        limited = kb is not None and bool(kb.windows)
        return Reservation(key_id, tokens, settled=not limited, admitted_at=now)

    def settle(self, res: Reservation, requests: int, tokens: int, now: float) -> None:
        res.done = res.settled = True  # (charged by the parent, from the row)

    def restore(self, key_id: str, kind: str, requests: int, tokens: int, now: float) -> None:
        pass

    def usage(self, key_id: str, now: float) -> dict:
        return {}


class RemoteStore:
    """The store as a worker writes to it: rows and admissions go to the parent's."""

    rows_dropped = 0
    rows_written = 0
    recovered = 0
    pending = 0

    def __init__(self, link: Link, retention_days: float, app) -> None:
        self.link = link
        self.retention_days = retention_days
        self.app = app  # the worker: its configuration's slot wait (a reload changes it)
        self._ids = itertools.count(1)

    def start(self) -> None:
        pass

    def next_admission_id(self) -> int:
        return next(self._ids)  # (this worker's: the parent keeps its own for the record)

    async def admit(
        self,
        admission_id,
        rec,
        prompt_tokens: int,
        completion_tokens: int,
        timeout: float | None = None,
        res=None,
    ) -> None:
        ahead = None  # a request that takes a slot asks for it now: one round trip for both
        if generating(rec) and rec.upstream_requested is not None:
            j, answer_fut = self.link.ask_later()
            ahead = [rec.upstream_requested, self.app.config.dispatcher.pool_timeout_s, j]
            self.link.ahead[admission_id] = (rec.upstream_requested, j, answer_fut)
        i, fut = self.link.ask(
            "admit", admission_id, field_values(rec), prompt_tokens, completion_tokens, ahead
        )
        try:
            answer, details = await asyncio.wait_for(fut, ADMIT_WAIT_S + ANSWER_GRACE_S)
        finally:
            self.link.forget(i)
        if answer == "exceeded":
            self.link.drop_ahead(admission_id)  # (no slot was taken for it)
            limit, used, limit_value, resets_at = details
            raise BudgetExceeded(limit, used, limit_value, resets_at, time.time())
        if answer == "timeout":
            raise TimeoutError(details)
        if answer != "ok":
            raise RuntimeError(details)

    def usage_read(self, windows: list) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result([(0, 0) for _ in windows])  # (the parent rebuilds its budgets)
        return fut

    def usage_since(self, key_id, since_ts: float, served_only: bool = False):
        return 0, 0

    async def maintain(self, app) -> None:
        pass

    async def aclose(self) -> None:
        writer = self.link.writer
        self.link.outbox.flush()
        if not writer.is_closing():
            await writer.drain()  # every row is with the parent before this process ends

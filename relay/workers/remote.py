"""A worker's link to its parent and its stand-ins for the parent's relay-wide state
(relay.workers.worker): the `Link` (answers awaited, messages sent, what the parent tells);
slots taken from the parent's pools, budgets whose every check is the parent's, a store whose
rows and admission records go to the parent. Each speaks the interface of what it stands in
for (`Slots`, `Budgets`, the store), over the worker's `Link`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import time
from collections.abc import Callable
from typing import Protocol

from relay.observe.log import Log
from relay.observe.record import Record
from relay.observe.ui_state import Trended
from relay.policy.affinity import Reuse, Want
from relay.policy.budget import Budgets, Reservation
from relay.policy.routing import Pool
from relay.proxy.dispatch import ADMIT_WAIT_S
from relay.proxy.slots import Busy, SlotsClosed
from relay.store.admissions import AdmissionId
from relay.workers import wire
from relay.workers.ahead import Asked
from relay.workers.wire import AdmitVerdict, SlotVerdict

# Past its own bound, a parent that has not answered is not answering.
ANSWER_GRACE_S = 10.0
PARENT_GONE_EXIT = 3


class Hearer(Protocol):
    """What the link tells of the parent's messages that are not answers: the worker's app."""

    @property
    def log(self) -> Log: ...

    def told(self, message: wire.Told) -> None: ...


class Link:
    """The worker's end of its socket to the parent: requests with answers, and messages."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.outbox: wire.Outbox[wire.ToParent] = wire.Outbox(writer)
        self.send = self.outbox.send
        exchanges = itertools.count(1)
        self.slot_answers: wire.Answers[wire.SlotAnswer] = wire.Answers(exchanges)
        self.admit_answers: wire.Answers[wire.AdmitAnswer | wire.AdmitRefused] = wire.Answers(
            exchanges
        )
        self.view_answers: wire.Answers[wire.ViewAnswer] = wire.Answers(exchanges)
        self.ahead = Asked(self.slot_answers, self.unslot)

    def ask_slot(
        self, pool: Pool, want: Want, timeout: float, exclude: frozenset[str], key: str | None
    ) -> tuple[int, asyncio.Future[wire.SlotAnswer]]:
        i, fut = self.slot_answers.expect()
        exclude_names = tuple(sorted(exclude))
        self.send(wire.SlotAsk(i, pool.name, timeout, pool.members, exclude_names, want, key))
        return i, fut

    def unslot(self, i: int) -> None:
        """The slot of exchange `i` is not wanted (granted or not yet): the parent frees it."""
        self.slot_answers.forget(i)
        self.send(wire.Unslot(i))

    async def run(self, hearer: Hearer) -> None:
        """Read the parent's messages until it is gone; then this process ends at once (a
        worker that cannot hear its parent must not go on taking connections, and its streams
        cannot settle anywhere now)."""
        try:
            while (message := await wire.read(self.reader, wire.FROM_PARENT)) is not None:
                self._heard(hearer, message)
        except asyncio.CancelledError:
            raise
        except BaseException:
            pass
        os._exit(PARENT_GONE_EXIT)

    def _heard(self, hearer: Hearer, message: wire.ToWorker) -> None:
        match message:
            case wire.SlotAnswer():
                self.slot_answers.answered(message.id, message)
            case wire.AdmitAnswer() | wire.AdmitRefused():
                self.admit_answers.answered(message.id, message)
            case wire.ViewAnswer():
                self.view_answers.answered(message.id, message)
            case _:
                try:
                    hearer.told(message)
                except Exception as exc:
                    # A bug: it is said, and the link goes on.
                    hearer.log.event("internal_error", error=f"{type(exc).__name__}: {exc}"[:300])


class RemoteSlot:
    __slots__ = ("i", "position", "released", "slots")

    def __init__(self, slots: RemoteSlots, i: int, position: int = 0) -> None:
        self.slots, self.i, self.released = slots, i, False
        self.position = position

    @property
    def member(self) -> str:
        return self.slots.name

    def release(self, reuse: Reuse | None = None) -> None:
        if not self.released:
            self.released = True
            self.slots.in_flight -= 1
            self.slots.link.send(wire.Free(self.i, reuse))


class RemoteSlots:
    """An upstream's slots as a worker sees them (the `Slots` protocol): its share of the
    parent's, `in_flight` and `queued` (the requests of this worker waiting for a pool it is
    a member of), and the bounds it was configured with."""

    def __init__(self, link: Link, name: str, parallel: int, queue: int) -> None:
        self.link, self.name = link, name
        self.parallel, self.queue = parallel, queue
        self.in_flight = 0
        self.waiters: set[asyncio.Future[wire.SlotAnswer]] = set()
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
        """New bounds, as the parent's pool has them (it is resized there)."""
        self.parallel, self.queue = parallel, queue


class RemoteBoard:
    """The parent's board as a worker takes slots from it (the `Balancer` protocol): each
    slot one round trip, its release a message; `slots_of` names this worker's share of
    each upstream's slots."""

    def __init__(self, link: Link, slots_of: Callable[[str], RemoteSlots | None]) -> None:
        self.link = link
        self.slots_of = slots_of

    def ahead(self, admission: AdmissionId, pool: Pool, want: Want, key: str | None = None) -> None:
        self.link.ahead.plan(admission, pool, want, key)

    async def acquire(
        self,
        pool: Pool,
        want: Want,
        timeout: float,
        exclude: frozenset[str] = frozenset(),
        admission: AdmissionId | None = None,
        key: str | None = None,
    ) -> RemoteSlot:
        """A slot of the parent's board (Busy, SlotsClosed): the one asked for with the
        request's admission when there is one (relay.workers.ahead), else one asked now. The
        parent answers within `timeout`; past that and a grace, it is not answering, and a
        grant that comes after all goes back."""
        members = [m for m in map(self.slots_of, pool.members) if m is not None]
        if any(m.closed for m in members):
            raise SlotsClosed()
        link = self.link
        asked = link.ahead.take(admission, pool, exclude, key) if admission is not None else None
        i, fut = asked if asked is not None else link.ask_slot(pool, want, timeout, exclude, key)
        for m in members:
            m.waiters.add(fut)
        try:
            try:
                answer = await asyncio.wait_for(fut, timeout + ANSWER_GRACE_S)
            except TimeoutError:
                link.unslot(i)
                answer = wire.SlotAnswer(i, SlotVerdict.BUSY, "the relay's slots did not answer")
        except BaseException:
            # Cancelled, or closed here: a slot granted meanwhile goes back.
            link.unslot(i)
            raise
        finally:
            for m in members:
                m.waiters.discard(fut)
        if answer.verdict is SlotVerdict.OK:
            slots = self.slots_of(answer.member)
            if slots is None:
                # A member this worker's configuration no longer has: it goes back.
                link.send(wire.Free(i))
                raise Busy(f"upstream {answer.member} is gone (a reload removed it)")
            slots.in_flight += 1
            return RemoteSlot(slots, i, answer.position)
        if answer.verdict is SlotVerdict.CLOSED:
            raise SlotsClosed()
        raise Busy(answer.why, answer.position)


class LooseBudgets(Budgets):
    """A worker's budgets: the keys and limits of its configuration, every check and every
    figure the parent's. `reserve` only says whether the request must be admitted there (a
    key with limits: `RemoteStore.admit`); the parent charges it, from the row."""

    def reserve(self, key_id: str, tokens: int, now: float) -> Reservation:
        return Reservation(key_id, tokens, empty=not self.limited(key_id), admitted_at=now)

    def spend(self, res: Reservation, requests: int, tokens: int, now: float) -> None:
        res.spent = res.empty = True

    def restore(self, key_id: str, kind: str, requests: int, tokens: int, now: float) -> None:
        pass


class RemoteStore:
    """The store as a worker writes to it: rows and admissions go to the parent's, which
    rebuilds its budgets from its own rows. `slot_wait`: the worker's configured wait for a
    slot (a reload changes it), for the slot asked for with an admission."""

    recovered = 0
    rows_written = 0
    rows_dropped = 0
    pending = 0
    spilled: int | None = None

    def __init__(self, link: Link, retention_days: float, slot_wait: Callable[[], float]) -> None:
        self.link = link
        self.retention_days = retention_days
        self.slot_wait = slot_wait
        self._admission_ids = itertools.count(1)

    def start(self) -> None:
        pass

    def next_admission_id(self) -> AdmissionId:
        """This worker's own number for the admission (the parent's store numbers its
        record): the row and the slot asked for with it name it."""
        return next(self._admission_ids)

    async def admit(
        self,
        admission_id: AdmissionId,
        rec: Record,
        prompt_tokens: int,
        completion_tokens: int,
        timeout: float | None = None,
        res: Reservation | None = None,
    ) -> None:
        """The parent reserves and commits the admission record, as one process's store does
        (BudgetExceeded, TimeoutError, RuntimeError); a request that takes a slot asks for it
        in the same message."""
        ahead = self.link.ahead.ask(admission_id, self.slot_wait())
        i, fut = self.link.admit_answers.expect()
        self.link.send(wire.Admit(i, admission_id, rec, prompt_tokens, completion_tokens, ahead))
        try:
            answer = await asyncio.wait_for(fut, ADMIT_WAIT_S + ANSWER_GRACE_S)
        finally:
            self.link.admit_answers.forget(i)
        match answer:
            case wire.AdmitRefused():
                self.link.ahead.forget(admission_id)
                raise answer.error(time.time())
            case wire.AdmitAnswer(verdict=AdmitVerdict.OK):
                return
            case wire.AdmitAnswer(verdict=AdmitVerdict.TIMEOUT):
                raise TimeoutError(answer.why)
            case _:
                raise RuntimeError(answer.why)

    def send_row(self, rec: Record, admission: AdmissionId | None, trend: Trended) -> None:
        """The row goes to the parent, which charges its key and keeps it (`App.put_row`), and
        gives back a slot asked for with its admission that the request did not take."""
        if admission is not None:
            self.link.ahead.forget(admission)
        self.link.send(wire.Row(rec, admission, trend))

    def put_record(self, rec: Record, admission_id: AdmissionId | None = None) -> None:
        self.send_row(rec, admission_id, Trended.NONE)

    def usage_since(
        self, key_id: str | None, since_ts: float, served_only: bool = False
    ) -> tuple[int, int]:
        return 0, 0

    def usage_read(
        self, windows: list[tuple[str, float]]
    ) -> concurrent.futures.Future[list[tuple[int, int]]]:
        fut: concurrent.futures.Future[list[tuple[int, int]]] = concurrent.futures.Future()
        fut.set_result([(0, 0) for _ in windows])
        return fut

    async def maintain(self, budgets: Budgets) -> None:
        pass

    async def aclose(self) -> None:
        """Every row is with the parent before this process ends."""
        writer = self.link.writer
        self.link.outbox.flush()
        if not writer.is_closing():
            await writer.drain()

"""What each worker holds of the parent's relay-wide state, and the parent's answers to its
requests for it: slots from the one `SlotPool` of each upstream, a keyed request's reservation
and admission record, the row that settles both. A worker that is gone gives everything back
(`reclaim`). The parent (relay.workers.parent) is a `Parent`: its budgets, store and upstreams
are those of one relay process.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Protocol

from relay.observe.metrics import Registry
from relay.observe.record import CRASHED, Record
from relay.observe.ui_state import Trended
from relay.policy.affinity import Reuse
from relay.policy.budget import BudgetExceeded, Budgets, Reservation
from relay.proxy.dispatch import ADMIT_WAIT_S
from relay.proxy.settle import charge
from relay.proxy.slots import Board, Busy, SlotLease, SlotsClosed
from relay.store.admissions import AdmissionId
from relay.workers import wire
from relay.workers.ahead import Promised
from relay.workers.liveness import Hearing
from relay.workers.wire import AdmitVerdict, SlotVerdict


class AdmissionStore(Protocol):
    """What the holdings use of the parent's store: the admission record's id and commit."""

    def next_admission_id(self) -> AdmissionId: ...

    async def admit(
        self,
        admission_id: AdmissionId,
        rec: Record,
        prompt_tokens: int,
        completion_tokens: int,
        timeout: float | None = None,
        res: Reservation | None = None,
    ) -> None: ...


class Parent(Protocol):
    """What the holdings use of the parent."""

    @property
    def board(self) -> Board: ...

    @property
    def budgets(self) -> Budgets: ...

    @property
    def store(self) -> AdmissionStore: ...

    @property
    def budget_generations(self) -> list[tuple[float, int]]:
        """(wall time, budgets' generation) after each reload (`unlimited`)."""

    def put_row(
        self, rec: Record, admission: AdmissionId | None = None, trend: Trended = Trended.NONE
    ) -> None: ...

    def track(self, task: asyncio.Task[None]) -> None: ...


@dataclass
class Admitted:
    """A keyed request's admission, from its reservation until its row. `rec` is what the
    admission record says (a crash row is made of it); `written`, the record's commit."""

    record_id: AdmissionId
    res: Reservation
    rec: Record
    prompt: int
    completion: int
    written: asyncio.Task[None] | None = None

    def then(self, step: Callable[[], None]) -> None:
        """`step()` once the record is committed (or refused): a row that replaces it must
        not reach the store's writer first, or the record would outlive the request."""
        if self.written is None or self.written.done():
            step()
        else:
            self.written.add_done_callback(lambda _task: step())


@dataclass
class Worker:
    """One worker process as the parent holds it: the slot requests still waiting and the
    slots granted, by the worker's exchange id; its admissions, by its admission id; the
    figures and reloads asked of it; its last metrics; what the parent heard of it
    (`hearing`), and when it was found not answering (`lost_at`: it is being killed)."""

    index: int
    proc: asyncio.subprocess.Process
    writer: asyncio.StreamWriter
    started_at: float
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    held: dict[int, SlotLease] = field(default_factory=dict)
    admissions: dict[AdmissionId, Admitted] = field(default_factory=dict)
    promised: Promised = field(init=False)
    figures_asked: wire.Answers[wire.Figures] = field(init=False)
    reloads: wire.Answers[wire.Reloaded] = field(init=False)
    figures: Registry | None = None
    gone: bool = False
    pid: int = 0
    outbox: wire.Outbox[wire.ToWorker | wire.Configure] = field(init=False)
    hearing: Hearing = field(init=False)
    lost_at: float | None = None

    def __post_init__(self) -> None:
        self.outbox = wire.Outbox(self.writer)
        self.hearing = Hearing(self.started_at)
        self.promised = Promised(self.unslot)
        asks = itertools.count(1)
        self.figures_asked = wire.Answers(asks)
        self.reloads = wire.Answers(asks)

    @property
    def serving(self) -> bool:
        return self.ready.is_set() and not self.gone and self.lost_at is None

    def send(self, message: wire.ToWorker | wire.Configure) -> None:
        if not self.gone:
            self.outbox.send(message)

    def unslot(self, i: int) -> None:
        """The worker's waiter left: its request (still queued) is cancelled, or its slot
        given back. A slot the pool granted meanwhile is handed on by `SlotPool`."""
        task = self.waiting.pop(i, None)
        if task is not None:
            task.cancel()
        self.free(i)

    def free(self, i: int, reuse: Reuse | None = None) -> None:
        slot = self.held.pop(i, None)
        if slot is not None:
            slot.release(reuse)


def ask_slot(app: Parent, w: Worker, ask: wire.SlotAsk) -> None:
    """The worker's request waits for a slot of the pool it names."""
    w.waiting[ask.id] = asyncio.get_running_loop().create_task(_grant(app, w, ask))


async def _grant(app: Parent, w: Worker, ask: wire.SlotAsk) -> None:
    """A slot from the one board, and the answer to the worker."""
    i = ask.id
    try:
        slot = await app.board.acquire(
            ask.of, ask.want, ask.timeout_s, frozenset(ask.exclude), key=ask.key
        )
    except Busy as exc:
        w.send(wire.SlotAnswer(i, SlotVerdict.BUSY, exc.reason, position=exc.position))
        return
    except SlotsClosed:
        w.send(wire.SlotAnswer(i, SlotVerdict.CLOSED))
        return
    finally:
        w.waiting.pop(i, None)
    if w.gone:
        slot.release()
        return
    w.held[i] = slot
    w.send(wire.SlotAnswer(i, SlotVerdict.OK, member=slot.member, position=slot.position))


def admit(app: Parent, w: Worker, msg: wire.Admit) -> None:
    """A keyed request's reservation, as `Dispatcher._admit` takes it: here, in the order the
    worker's messages came (its row, even in the same read, finds it); then its admission
    record's commit, in a task (`commit`). The slot asked for with it is asked of its pool at
    once: admitted, one round trip for both; refused, none is taken."""
    rec = msg.rec
    assert rec.key_id is not None
    try:
        res = app.budgets.reserve(rec.key_id, msg.prompt + msg.completion, time.time())
    except BudgetExceeded as exc:
        w.send(wire.AdmitRefused.of(msg.id, exc))
        return
    if msg.ahead is not None:
        ask_slot(app, w, msg.ahead)
        w.promised.promise(msg.admission, msg.ahead)
    if res.empty:
        # The key has no limits here (a reload removed them): there is nothing to hold.
        w.send(wire.AdmitAnswer(msg.id, AdmitVerdict.OK))
        return
    adm = Admitted(app.store.next_admission_id(), res, rec, msg.prompt, msg.completion)
    w.admissions[msg.admission] = adm
    adm.written = _task(app, commit(app, w, msg, adm))


async def commit(app: Parent, w: Worker, msg: wire.Admit, adm: Admitted) -> None:
    """Commit the admission record, then answer the worker."""
    try:
        await app.store.admit(
            adm.record_id, adm.rec, adm.prompt, adm.completion, ADMIT_WAIT_S, res=adm.res
        )
    except BudgetExceeded as exc:
        # A shared store: the key is spent across the relays. The worker takes no slot for
        # a refused request, and the reservation is settled once (a row may have come first).
        if w.admissions.get(msg.admission) is adm:
            del w.admissions[msg.admission]
        w.promised.end(msg.admission)
        app.budgets.spend(adm.res, 0, 0, time.time())
        w.send(wire.AdmitRefused.of(msg.id, exc))
        return
    except TimeoutError:
        w.send(
            wire.AdmitAnswer(msg.id, AdmitVerdict.TIMEOUT, f"not committed within {ADMIT_WAIT_S}s")
        )
        return
    except Exception as exc:
        # The store fails (RuntimeError), or a bug: the worker is answered all the same.
        w.send(
            wire.AdmitAnswer(msg.id, AdmitVerdict.NOT_DURABLE, f"{type(exc).__name__}: {exc}"[:300])
        )
        return
    w.send(wire.AdmitAnswer(msg.id, AdmitVerdict.OK))


def row(app: Parent, w: Worker, msg: wire.Row) -> None:
    """A settled request's row: its reservation replaced with what it used, then kept as one
    process keeps it (`App.put_row`: the page's figures, the store). A slot asked for with its
    admission was released already if the request took it; if not, it goes back now."""
    rec, admission = msg.rec, msg.admission
    adm = None
    if admission is not None:
        adm = w.admissions.pop(admission, None)
        w.promised.end(admission)
    if adm is None:
        if rec.key_id is not None:
            # A key without limits: charged to the windows a reload made meanwhile.
            app.budgets.spend(unlimited(app, rec), *charge(rec), time.time())
        app.put_row(rec, None, msg.trend)
        return
    app.budgets.spend(adm.res, *charge(rec), time.time())
    record_id = adm.record_id
    adm.then(lambda: app.put_row(rec, record_id, msg.trend))


def reclaim(app: Parent, w: Worker) -> int:
    """A worker is gone: what it held goes back (slots, waits), its admitted requests become
    crash rows charged their reservation (as a restart's recovery makes them); how many."""
    w.gone = True
    for task in w.waiting.values():
        task.cancel()
    w.waiting.clear()
    for slot in w.held.values():
        slot.release()
    w.held.clear()
    w.promised.clear()
    now = time.time()
    for adm in w.admissions.values():
        adm.rec.error_code = adm.rec.outcome = CRASHED
        adm.rec.ok = False
        adm.rec.set_reserved(adm.prompt, adm.completion)
        app.budgets.spend(adm.res, 1, adm.prompt + adm.completion, now)
        adm.then(_keeper(app, adm))
    crashed = len(w.admissions)
    w.admissions.clear()
    w.figures_asked.cancel()
    w.reloads.cancel()
    return crashed


def _keeper(app: Parent, adm: Admitted) -> Callable[[], None]:
    return lambda: app.put_row(adm.rec, adm.record_id)


def _task(app: Parent, coro: Coroutine[object, object, None]) -> asyncio.Task[None]:
    task = asyncio.get_running_loop().create_task(coro)
    app.track(task)
    return task


def unlimited(app: Parent, rec: Record) -> Reservation:
    """The reservation a key without limits took in the worker (nothing held), as the
    parent's budgets know it: the windows a reload created since the request began are
    charged its use when it settles (`Budgets.settle`), as in one process."""
    gen = 0
    for at, generation in app.budget_generations:
        if at <= rec.ts:
            gen = generation
    return Reservation(rec.key_id or "", 0, empty=True, gen=gen, admitted_at=rec.ts)

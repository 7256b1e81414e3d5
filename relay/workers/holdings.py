"""What each worker holds of the parent's relay-wide state, and the parent's answers to its
requests for it: slots from the one `SlotPool` of each upstream, a keyed request's reservation
and admission record, the row that settles both. A worker that is gone gives everything back
(`give_back`). `app`: the parent (relay.workers.parent), whose budgets, store and upstreams
are those of one relay process.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from relay.observe.metrics import Registry
from relay.observe.record import CRASHED, Record
from relay.policy.budget import BudgetExceeded, Reservation
from relay.proxy.dispatch import ADMIT_WAIT_S
from relay.proxy.settle import charge
from relay.proxy.slots import Busy, Slot, SlotsClosed
from relay.workers import wire


@dataclass
class _Admission:
    record_id: int | str  # the parent store's id of the admission record
    res: Reservation
    rec: Record  # what the record says (a crash row is made of it)
    prompt: int
    completion: int
    written: asyncio.Future | None = None  # the record's commit (`record`)
    slot: int | None = None  # the slot asked for with it (its exchange id), until the row

    def then(self, keep) -> None:
        """`keep()` once the record is committed (or refused): a row that replaces it must
        not reach the store's writer first, or the record would outlive the request."""
        if self.written is None or self.written.done():
            keep()
        else:
            self.written.add_done_callback(lambda _fut: keep())


@dataclass
class Worker:
    """One worker process as the parent holds it."""

    index: int
    proc: asyncio.subprocess.Process
    writer: asyncio.StreamWriter
    started: float
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: dict[int, asyncio.Task] = field(default_factory=dict)  # slot requests
    held: dict[int, Slot] = field(default_factory=dict)  # slots granted
    admissions: dict[int, _Admission] = field(default_factory=dict)  # by the worker's id
    unclaimed: dict[int, int] = field(default_factory=dict)  # admission id -> slot asked with it
    answers: dict[int, asyncio.Future] = field(default_factory=dict)  # figures, reloads
    figures: Registry | None = None  # its last metrics
    gone: bool = False
    pid: int = 0
    outbox: wire.Outbox = field(init=False)

    def __post_init__(self) -> None:
        self.outbox = wire.Outbox(self.writer)

    def send(self, message: list) -> None:
        if not self.gone:
            self.outbox.send(message)


async def slot(app, w: Worker, i: int, name: str, timeout: float) -> None:
    """A slot of the upstream `name` for the worker's request `i`, from the one pool."""
    up = app.upstreams.get(name) or next((u for u in app.retired if u.name == name), None)
    try:
        if up is None:
            raise Busy(f"upstream {name} is gone (a reload removed it)")
        slot = await up.slots.acquire(timeout)
    except Busy as exc:
        w.send(["slot", i, "busy", exc.reason])
        return
    except SlotsClosed:
        w.send(["slot", i, "closed", ""])
        return
    finally:
        w.waiting.pop(i, None)
    if w.gone:
        slot.release()
        return
    w.held[i] = slot
    w.send(["slot", i, "ok", ""])


def unslot(w: Worker, i: int) -> None:
    """The worker's waiter left: its request (still queued: cancelled) or its slot."""
    task = w.waiting.pop(i, None)
    if task is not None:
        task.cancel()  # (SlotPool hands a slot granted meanwhile on)
    slot = w.held.pop(i, None)
    if slot is not None:
        slot.release()


def admit(
    app,
    w: Worker,
    i: int,
    worker_id: int,
    values: list,
    prompt: int,
    completion: int,
    ahead: list | None = None,
) -> _Admission | None:
    """A keyed request's reservation, as `Dispatcher._admit` takes it: here, in the order the
    worker's messages came (its row, even in the same read, finds it); the admission record's
    commit is `record`'s, which the caller runs as a task (returned: what to commit).
    `ahead` [upstream, timeout, slot id]: the request takes a slot there, asked for at once
    (admitted: one round trip for both; refused: none is taken)."""
    rec = Record(*values)
    assert rec.key_id is not None
    try:
        res = app.budgets.reserve(rec.key_id, prompt + completion, time.time())
    except BudgetExceeded as exc:
        w.send(["admit", i, "exceeded", _exceeded(exc)])
        return None
    slot_id = None
    if ahead is not None:
        name, timeout, slot_id = ahead
        w.waiting[slot_id] = asyncio.get_running_loop().create_task(
            slot(app, w, slot_id, name, timeout)
        )
    if res.settled:  # (no limits here: a reload removed them) nothing to hold
        w.send(["admit", i, "ok", None])
        if slot_id is not None:
            w.unclaimed[worker_id] = slot_id
        return None
    adm = _Admission(app.store.next_admission_id(), res, rec, prompt, completion, slot=slot_id)
    w.admissions[worker_id] = adm
    return adm


async def record(app, w: Worker, i: int, worker_id: int, adm: _Admission) -> None:
    """Commit the admission record, then answer the worker."""
    try:
        await app.store.admit(
            adm.record_id, adm.rec, adm.prompt, adm.completion, ADMIT_WAIT_S, res=adm.res
        )
    except BudgetExceeded as exc:  # a shared store: spent across the relays
        if w.admissions.get(worker_id) is adm:
            del w.admissions[worker_id]
        if adm.slot is not None:  # (the worker takes no slot for a refused request)
            unslot(w, adm.slot)
        app.budgets.settle(adm.res, 0, 0, time.time())  # (once: a row first settled it)
        w.send(["admit", i, "exceeded", _exceeded(exc)])
        return
    except TimeoutError:
        w.send(["admit", i, "timeout", f"not committed within {ADMIT_WAIT_S}s"])
        return
    except Exception as exc:  # RuntimeError (the store fails), or a bug: never no answer
        w.send(["admit", i, "not_durable", f"{type(exc).__name__}: {exc}"[:300]])
        return
    w.send(["admit", i, "ok", None])


def row(app, w: Worker, values: list, worker_admission, trend: bool | None) -> None:
    """A settled request's row: its reservation replaced with what it used, then kept as one
    process keeps it (`App.keep`: the page's figures, the store)."""
    rec = Record(*values)
    adm = w.admissions.pop(worker_admission, None) if worker_admission is not None else None
    ahead = adm.slot if adm is not None else w.unclaimed.pop(worker_admission, None)
    if ahead is not None:  # asked for with the admission: released already if it was taken
        unslot(w, ahead)
    if adm is None:
        if rec.key_id is not None:  # a key without limits: charged to windows a reload made
            app.budgets.settle(unlimited(app, rec), *charge(rec), time.time())
        app.keep(rec, None, trend)
        return
    app.budgets.settle(adm.res, *charge(rec), time.time())
    adm.then(lambda: app.keep(rec, adm.record_id, trend))


def give_back(app, w: Worker) -> int:
    """A worker is gone: what it held goes back (slots, waits), its admitted requests become
    crash rows charged their reservation (as a restart's recovery makes them); how many."""
    w.gone = True
    for task in w.waiting.values():
        task.cancel()
    w.waiting.clear()
    for slot in w.held.values():
        slot.release()
    w.held.clear()
    now = time.time()
    for adm in w.admissions.values():
        rec = adm.rec
        rec.error_code = rec.outcome = CRASHED
        rec.ok = False
        rec.set_reserved(adm.prompt, adm.completion)
        app.budgets.settle(adm.res, 1, adm.prompt + adm.completion, now)
        adm.then(lambda rec=rec, adm=adm: app.keep(rec, adm.record_id))
    crashed = len(w.admissions)
    w.admissions.clear()
    for fut in w.answers.values():
        if not fut.done():
            fut.set_result(None)
    return crashed


def unlimited(app, rec: Record) -> Reservation:
    """The reservation a key without limits took in the worker (nothing held), as the
    parent's budgets know it: the windows a reload created since the request began are
    charged its use when it settles (`Budgets.settle`), as in one process."""
    gen = 0
    for at, generation in app.budget_generations:
        if at <= rec.ts:
            gen = generation
    return Reservation(rec.key_id or "", 0, settled=True, gen=gen, admitted_at=rec.ts)


def _exceeded(exc: BudgetExceeded) -> list:
    return [exc.limit, exc.used, exc.limit_value, exc.resets_at]

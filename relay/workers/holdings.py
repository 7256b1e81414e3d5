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
from relay.observe.record import CRASHED, RESERVED, Record
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
    answers: dict[int, asyncio.Future] = field(default_factory=dict)  # figures, reloads
    figures: Registry | None = None  # its last metrics
    gone: bool = False
    pid: int = 0
    outbox: wire.Outbox | None = None

    def send(self, message: list) -> None:
        if not self.gone:
            if self.outbox is None:
                self.outbox = wire.Outbox(self.writer)
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


async def admit(
    app, w: Worker, i: int, worker_id: int, values: list, prompt: int, completion: int
) -> None:
    """A keyed request's reservation and admission record, as `Dispatcher._admit`."""
    rec = Record(*values)
    assert rec.key_id is not None
    if w.gone:  # (it died since it asked: nothing to hold for it)
        return
    try:
        res = app.budgets.reserve(rec.key_id, prompt + completion, time.time())
    except BudgetExceeded as exc:
        w.send(["admit", i, "exceeded", _exceeded(exc)])
        return
    if res.settled:  # (no limits here: a reload removed them) nothing to hold
        w.send(["admit", i, "ok", None])
        return
    record_id = app.store.next_admission_id()
    w.admissions[worker_id] = _Admission(record_id, res, rec, prompt, completion)
    try:
        await app.store.admit(record_id, rec, prompt, completion, ADMIT_WAIT_S, res=res)
    except BudgetExceeded as exc:  # a shared store: spent across the relays
        w.admissions.pop(worker_id, None)
        app.budgets.settle(res, 0, 0, time.time())
        w.send(["admit", i, "exceeded", _exceeded(exc)])
        return
    except TimeoutError:
        w.send(["admit", i, "timeout", f"not committed within {ADMIT_WAIT_S}s"])
        return
    except RuntimeError as exc:
        w.send(["admit", i, "not_durable", str(exc)[:300]])
        return
    w.send(["admit", i, "ok", None])


def row(app, w: Worker, values: list, worker_admission, trend: bool | None) -> None:
    """A settled request's row: its reservation replaced with what it used, then kept as one
    process keeps it (`App.keep`: the page's figures, the store)."""
    rec = Record(*values)
    adm = w.admissions.pop(worker_admission, None) if worker_admission is not None else None
    if adm is not None:
        app.budgets.settle(adm.res, *charge(rec), time.time())
    app.keep(rec, adm.record_id if adm is not None else None, trend)


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
        rec.prompt_tokens, rec.completion_tokens = adm.prompt, adm.completion
        rec.tokens_source = RESERVED
        app.budgets.settle(adm.res, 1, adm.prompt + adm.completion, now)
        app.keep(rec, adm.record_id)
    crashed = len(w.admissions)
    w.admissions.clear()
    for fut in w.answers.values():
        if not fut.done():
            fut.set_result(None)
    return crashed


def _exceeded(exc: BudgetExceeded) -> list:
    return [exc.limit, exc.used, exc.limit_value, exc.resets_at]

"""The slot a keyed request asks for with its admission: one round trip for both.

A generating request of a key with limits is admitted (its reservation taken, its admission
record committed) before it takes a slot of its first upstream. A worker asks for both in
one message: its `Admit` carries the `SlotAsk`, which the parent takes as soon as the
reservation is taken, so the slot's answer is on its way with the admission's. A refused
admission takes no slot.

Worker side, `Asked` (one per link, relay.workers.remote): the slot asked for with each
admission, by the request's admission id. `RemoteStore.admit` asks; `RemoteSlots.acquire`
takes it, or gives it back when the request goes to another upstream first; a refused
admission forgets it (the parent took none); the request's row forgets one never taken.

Parent side, `Promised` (one per worker, relay.workers.holdings): the exchange asked with each
admission, until the row comes or the admission record is refused; either gives back a slot
the request did not take, granted or still queued (a slot it took and released is gone
already: giving it back again does nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from relay.policy.affinity import Want
from relay.policy.routing import Pool
from relay.store.admissions import AdmissionId
from relay.workers.wire import Answers, SlotAnswer, SlotAsk


class _Asked:
    __slots__ = ("ask", "future")

    def __init__(self, ask: SlotAsk, future: asyncio.Future[SlotAnswer]) -> None:
        self.ask, self.future = ask, future


class Asked:
    """A worker's slots asked for with admissions, by admission id: the pool a request will
    ask of (`plan`, before its admission), then the slot asked (`ask`, with it)."""

    __slots__ = ("_answers", "_asked", "_planned", "_unslot")

    def __init__(self, answers: Answers[SlotAnswer], unslot: Callable[[int], None]) -> None:
        self._answers = answers
        self._unslot = unslot
        self._planned: dict[AdmissionId, tuple[Pool, Want, str | None]] = {}
        self._asked: dict[AdmissionId, _Asked] = {}

    def plan(self, admission: AdmissionId, pool: Pool, want: Want, key: str | None) -> None:
        """The request of this admission takes a slot of `pool` first (it generates)."""
        self._planned[admission] = (pool, want, key)

    def ask(self, admission: AdmissionId, timeout_s: float) -> SlotAsk | None:
        """What the admission asks for with it: a slot of the pool planned, if any."""
        planned = self._planned.pop(admission, None)
        if planned is None:
            return None
        pool, want, key = planned
        i, fut = self._answers.expect()
        ask = SlotAsk(i, pool.name, timeout_s, pool.members, (), want, key)
        self._asked[admission] = _Asked(ask, fut)
        return ask

    def take(
        self, admission: AdmissionId, pool: Pool, exclude: frozenset[str], key: str | None
    ) -> tuple[int, asyncio.Future[SlotAnswer]] | None:
        """The exchange of the slot asked for with the admission, when it asked for what the
        request asks now; one asked for something else is given back (None: the caller asks
        for its own)."""
        asked = self._asked.pop(admission, None)
        if asked is None:
            return None
        if not asked.ask.asks_for(pool, exclude, key):
            self._unslot(asked.ask.id)
            return None
        return asked.ask.id, asked.future

    def forget(self, admission: AdmissionId) -> None:
        """The admission was refused (the parent took no slot), or the request's row is sent
        (the parent gives back one it did not take): its answer is no longer awaited."""
        self._planned.pop(admission, None)
        asked = self._asked.pop(admission, None)
        if asked is not None:
            self._answers.forget(asked.ask.id)


class Promised:
    """The parent's record of one worker's slots asked for with admissions: the slot's
    exchange id by the worker's admission id."""

    __slots__ = ("_exchanges", "_unslot")

    def __init__(self, unslot: Callable[[int], None]) -> None:
        self._unslot = unslot
        self._exchanges: dict[AdmissionId, int] = {}

    def promise(self, admission: AdmissionId, ask: SlotAsk) -> None:
        self._exchanges[admission] = ask.id

    def end(self, admission: AdmissionId) -> None:
        """The row came, or the admission record was refused: a slot the request did not
        take goes back."""
        i = self._exchanges.pop(admission, None)
        if i is not None:
            self._unslot(i)

    def clear(self) -> None:
        self._exchanges.clear()

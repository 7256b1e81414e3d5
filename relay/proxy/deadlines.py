"""Many deadlines kept by one loop timer: every open stream's stall guard, its heartbeat until
its first content event, its wait for the upstream's head.

A loop timer per deadline (uvloop: a TimerHandle and a libuv timer each, about 530 bytes) would
be most of what an idle stream's timers cost. Here a deadline is one heap entry, `[when,
owner]`, and a single loop timer is armed at the earliest of them. The owner is what fires
(`Due`: a stall guard, a reply's heartbeat, a wait for a head): it names its entry itself
(`deadline`), so a deadline costs no callback object, no id and no dict entry either (about
100 bytes an entry, where those made it 240: an idle stream keeps one or two). A deadline
fires at its own time, not rounded to a tick: the loop timer is re-armed whenever an earlier
deadline comes in.

`cancel` is O(1): the entry lets go of its owner and is skipped when it comes up (the heap is
rebuilt when skipped entries outnumber half the live ones plus 64, so a churn of short streams
cannot grow it; every stream cancels two at its start, the wait for its upstream's head and its
heartbeat, and with a looser bound what an idle stream holds would vary by up to two entries
with when the last rebuild came). Owners fire in deadline order, each in its own try (one
that fails is reported to the loop's exception handler and does not stop the others).

A deadline that comes due fires once the loop has polled for I/O after its timer: the timer
hands over to the ready queue twice, and the owners fire on the second pass. A loop kept busy
past a deadline (a long collection, a slow read callback) has not read what its upstreams sent
meanwhile, and uvloop runs due timers before it polls (libuv polls between two passes of the
ready queue; asyncio runs what a poll read before the next pass): a stall guard that decided in
the timer would cut a stream whose next bytes were already waiting in its socket.

The loop is only asked for `time()`, `call_at()` and `call_soon()`, so tests drive it with a
fake clock.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heapify, heappop, heappush
from typing import Protocol

# A loop timer may fire up to a clock tick early (uvloop counts whole ms).
_SLACK = 0.001


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """What the deadlines ask of the loop (a fake one in tests)."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None], /) -> Cancellable: ...

    def call_soon(self, callback: Callable[[], None], /) -> Cancellable: ...

    def call_exception_handler(self, context: dict[str, object], /) -> None: ...


class Due:
    """What a deadline fires (`fire`), with at most one deadline at a time: `deadline` is its
    heap entry while one is set."""

    __slots__ = ("deadline",)

    def __init__(self) -> None:
        self.deadline: Entry | None = None

    def fire(self) -> None:
        raise NotImplementedError

    def __lt__(self, other: Due) -> bool:
        # Two deadlines at the same time: either may fire first.
        return id(self) < id(other)


class _Gone(Due):
    """What a cancelled entry holds instead of its owner (which it no longer keeps alive)."""

    __slots__ = ()

    def fire(self) -> None:
        """Never called: a cancelled entry is skipped."""


_GONE = _Gone()
# [when, owner]: a list, so that a cancelled entry lets go of its owner (`_GONE` instead).
Entry = list[float | Due]


class Deadlines:
    __slots__ = ("_heap", "_live", "_loop", "_polling", "_timer", "_timer_at")

    def __init__(self, loop: Clock) -> None:
        self._loop = loop
        self._heap: list[Entry] = []
        self._live = 0
        self._timer: Cancellable | None = None
        self._timer_at = float("inf")
        # The timer has fired and the due owners wait for the loop's next poll.
        self._polling = False

    def __len__(self) -> int:
        return self._live

    def add(self, when: float, due: Due) -> None:
        """Call `due.fire()` at loop time `when`, instead of at its deadline before (if any)."""
        entry: Entry = [when, due]
        old = due.deadline
        if old is None:
            self._live += 1
        else:
            old[1] = _GONE
        due.deadline = entry
        heappush(self._heap, entry)
        if when < self._timer_at:
            self._arm(when)

    def cancel(self, due: Due) -> None:
        """`due` is not fired (harmless if it has no deadline)."""
        entry = due.deadline
        if entry is None:
            return
        entry[1] = _GONE
        due.deadline = None
        self._live -= 1
        if len(self._heap) > self._live * 3 // 2 + 64:
            self._heap = [e for e in self._heap if e[1] is not _GONE]
            heapify(self._heap)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        if not self._polling:
            self._polling = True
            self._loop.call_soon(self._after_one_pass)

    def _after_one_pass(self) -> None:
        self._loop.call_soon(self._fire_due)

    def _fire_due(self) -> None:
        self._polling = False
        heap = self._heap
        due: list[Due] = []
        now = self._loop.time() + _SLACK
        while heap and _when(heap[0]) <= now:
            owner = heappop(heap)[1]
            if owner is not _GONE:
                assert isinstance(owner, Due)
                owner.deadline = None
                self._live -= 1
                due.append(owner)
        while heap and heap[0][1] is _GONE:
            heappop(heap)
        # Armed for what is left first: an owner's new deadline re-arms if earlier.
        if heap:
            self._arm(_when(heap[0]))
        # The owners fire after the heap is read: one that sets a new deadline (a guard not
        # due yet looks again later) lands in the heap for the next firing, not in this one.
        for owner in due:
            try:
                owner.fire()
            except Exception as exc:
                # A bug in one owner must not leave the others unarmed.
                self._loop.call_exception_handler(
                    {"message": "stall deadline callback failed", "exception": exc}
                )


def _when(entry: Entry) -> float:
    when = entry[0]
    assert not isinstance(when, Due)
    return when

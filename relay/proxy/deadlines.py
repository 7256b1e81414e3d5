"""Many deadlines kept by one loop timer: the stall guards of every open stream.

A loop timer per stream (uvloop: a TimerHandle and a libuv timer each, about 530 bytes) is
most of what an idle stream's guard costs. Here every stream's next check is one heap entry
(`(when, seq)`) and one dict entry, and a single loop timer is armed at the earliest of them.
A deadline fires at its own time, not rounded to a tick: the loop timer is re-armed whenever
an earlier deadline comes in.

`cancel` is O(1): the entry leaves the dict and its heap entry is skipped when it comes up
(the heap is rebuilt when skipped entries outnumber live ones, so a churn of short streams
cannot grow it). Callbacks run in deadline order, each in its own try (one failing callback
is reported to the loop's exception handler and does not stop the others).

The loop is only asked for `time()` and `call_at()`, so tests drive it with a fake clock.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heapify, heappop, heappush
from itertools import count
from typing import Protocol

# A loop timer may fire up to a clock tick early (uvloop counts whole ms).
_SLACK = 0.001


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """What the deadlines ask of the loop (a fake one in tests)."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None], /) -> Cancellable: ...

    def call_exception_handler(self, context: dict[str, object], /) -> None: ...


class Deadlines:
    __slots__ = ("_heap", "_live", "_loop", "_seq", "_timer", "_timer_at")

    def __init__(self, loop: Clock) -> None:
        self._loop = loop
        self._heap: list[tuple[float, int]] = []
        # seq -> callback, for the deadlines not cancelled.
        self._live: dict[int, Callable[[], object]] = {}
        self._seq = count()
        self._timer: Cancellable | None = None
        self._timer_at = float("inf")

    def __len__(self) -> int:
        return len(self._live)

    def add(self, when: float, callback: Callable[[], object]) -> int:
        """Call `callback()` at loop time `when`; the id returned cancels it."""
        seq = next(self._seq)
        heappush(self._heap, (when, seq))
        self._live[seq] = callback
        if when < self._timer_at:
            self._arm(when)
        return seq

    def cancel(self, seq: int) -> None:
        if self._live.pop(seq, None) is not None and len(self._heap) > 2 * len(self._live) + 64:
            live = self._live
            self._heap = [e for e in self._heap if e[1] in live]
            heapify(self._heap)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        heap, live = self._heap, self._live
        due: list[Callable[[], object]] = []
        now = self._loop.time() + _SLACK
        while heap and heap[0][0] <= now:
            cb = live.pop(heappop(heap)[1], None)
            if cb is not None:
                due.append(cb)
        while heap and heap[0][1] not in live:
            heappop(heap)
        # Armed for what is left first: a callback's new deadline re-arms if earlier.
        if heap:
            self._arm(heap[0][0])
        # The callbacks run after the heap is read: one that adds a deadline (a guard not
        # due yet looks again later) lands in the heap for the next firing, not in this one.
        for cb in due:
            try:
                cb()
            except Exception as exc:
                # A bug in one guard must not leave the others unarmed.
                self._loop.call_exception_handler(
                    {"message": "stall deadline callback failed", "exception": exc}
                )

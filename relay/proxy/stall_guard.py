"""One exchange's stall guard: its deadline among every stream's (`deadlines`: one loop timer
for all), re-armed lazily from the last upstream read, and the rule it applies
(`stream.stall.StallPolicy`).

The exchange notes each read's time (`last_read`) and the client's pauses: a client that is
the slow side owes the upstream no read, so the idle bound waits for it (`pause`, `resume`).
When the rule says the stream is stuck, `on_stall(reason, now)` is called, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from relay.proxy.deadlines import Deadlines
from relay.stream.stall import StallPolicy, StallReason


class Clock(Protocol):
    def time(self) -> float: ...


OnStall = Callable[[StallReason, float], None]


def _ended(_reason: StallReason, _now: float) -> None:
    """What a cancelled guard calls instead of its exchange (no reference is kept to it)."""


class StallGuard:
    __slots__ = (
        "clock",
        "deadlines",
        "head_at",
        "head_seen",
        "last_read",
        "on_stall",
        "paused",
        "policy",
        "timer",
    )

    def __init__(
        self, clock: Clock, deadlines: Deadlines, policy: StallPolicy, on_stall: OnStall
    ) -> None:
        self.clock = clock
        self.deadlines = deadlines
        self.policy = policy
        self.on_stall = on_stall
        # The response head is in, and the loop times of it and of the last upstream read.
        self.head_seen = False
        self.head_at = 0.0
        self.last_read = 0.0
        self.paused = False
        self.timer: int | None = None

    def head_in(self, now: float) -> None:
        self.head_seen = True
        self.head_at = self.last_read = now

    def arm(self) -> None:
        self.timer = self.deadlines.add(
            self.policy.next_check(self.head_at, self.last_read), self._check
        )

    def _check(self) -> None:
        self.timer = None
        now = self.clock.time()
        if self.paused:
            # The client is the slow side: reads are not owed.
            self.last_read = now
        reason = self.policy.due(now, self.head_at, self.last_read)
        if reason is None:
            self.arm()
            return
        self.on_stall(reason, now)

    def elapsed(self, reason: StallReason, now: float) -> float:
        return self.policy.elapsed(reason, now, self.head_at, self.last_read)

    def pause(self) -> None:
        self.paused = True

    def resume(self, now: float) -> None:
        self.paused = False
        self.last_read = now

    def cancel(self) -> None:
        if self.timer is not None:
            self.deadlines.cancel(self.timer)
            self.timer = None
        self.on_stall = _ended

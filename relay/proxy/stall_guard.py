"""One exchange's stall guard: its deadline among every stream's (`deadlines`: one loop timer
for all), re-armed lazily from the last upstream read, and the rule it applies
(`stream.stall.StallPolicy`).

The exchange notes each read's time (`last_read`) and the client's pauses: a client that is
the slow side owes the upstream no read, so the idle bound waits for it (`pause`, `resume`).
When the rule says the stream is stuck, its owner's `trip(reason, now)` is called, once (the
owner itself is kept, not a bound method of it: a stream keeps its guard).
"""

from __future__ import annotations

from typing import Protocol

from relay.proxy.deadlines import Deadlines, Due
from relay.stream.stall import StallPolicy, StallReason


class Clock(Protocol):
    def time(self) -> float: ...


class Stalls(Protocol):
    """What a guard trips: its exchange."""

    def trip(self, reason: StallReason, now: float) -> None: ...


class StallGuard(Due):
    """One exchange's guard; its deadline among every stream's (`Due.deadline`) while armed."""

    __slots__ = (
        "clock",
        "deadlines",
        "head_at",
        "head_seen",
        "last_read",
        "owner",
        "paused",
        "policy",
    )

    def __init__(
        self, clock: Clock, deadlines: Deadlines, policy: StallPolicy, owner: Stalls
    ) -> None:
        self.clock = clock
        self.deadlines = deadlines
        self.policy = policy
        # None once cancelled: no reference is kept to the exchange.
        self.owner: Stalls | None = owner
        # The response head is in, and the loop times of it and of the last upstream read.
        self.head_seen = False
        self.head_at = 0.0
        self.last_read = 0.0
        self.paused = False
        self.deadline = None

    def head_in(self, now: float) -> None:
        self.head_seen = True
        self.head_at = self.last_read = now

    def arm(self) -> None:
        self.deadlines.add(self.policy.next_check(self.head_at, self.last_read), self)

    def fire(self) -> None:
        """The deadline is up: stalled, or armed again for the next check."""
        now = self.clock.time()
        if self.paused:
            # The client is the slow side: reads are not owed.
            self.last_read = now
        reason = self.policy.due(now, self.head_at, self.last_read)
        if reason is None:
            self.arm()
            return
        owner = self.owner
        if owner is not None:
            owner.trip(reason, now)

    def elapsed(self, reason: StallReason, now: float) -> float:
        return self.policy.elapsed(reason, now, self.head_at, self.last_read)

    def pause(self) -> None:
        self.paused = True

    def resume(self, now: float) -> None:
        self.paused = False
        self.last_read = now

    def cancel(self) -> None:
        self.deadlines.cancel(self)
        self.owner = None

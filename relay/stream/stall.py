"""Stall guard: when a relayed stream counts as stuck (the frame that ends it: `terminal`).

Pure: the caller supplies times (loop.time()) and gets back a reason or the next moment to
look again, so the rule is tested without sockets or sleeping.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec


class StallReason(StrEnum):
    """Why the guard cut a stream: its total time, a gap between reads, or one read's bound
    (when the other two are off). The row's code is `stream_stall_<reason>`."""

    TOTAL = "total"
    IDLE = "idle"
    READ = "read"


class StallPolicy(msgspec.Struct, frozen=True):
    # The longest gap between two upstream reads; 0: off.
    idle_s: float
    # The longest time since the response head; 0: off.
    total_s: float
    # The bound of each read, used only when both of the above are off.
    read_s: float

    def due(self, now: float, head_at: float, last_read: float) -> StallReason | None:
        """The reason the stream is stalled at `now`, or None."""
        if self.total_s and now - head_at >= self.total_s:
            return StallReason.TOTAL
        if self.idle_s and now - last_read >= self.idle_s:
            return StallReason.IDLE
        if not self.idle_s and not self.total_s and now - last_read >= self.read_s:
            return StallReason.READ
        return None

    def next_check(self, head_at: float, last_read: float) -> float:
        """The earliest moment at which `due` could return a reason."""
        if not self.idle_s and not self.total_s:
            return last_read + self.read_s
        at = float("inf")
        if self.total_s:
            at = head_at + self.total_s
        if self.idle_s:
            at = min(at, last_read + self.idle_s)
        return at

    def elapsed(self, reason: StallReason, now: float, head_at: float, last_read: float) -> float:
        return round(now - (head_at if reason == StallReason.TOTAL else last_read), 3)


class Stall(msgspec.Struct, frozen=True):
    """A stall guard's trip: why, and after how many seconds."""

    reason: StallReason
    elapsed_s: float

    @property
    def code(self) -> str:
        """The row's error code."""
        return f"stream_stall_{self.reason}"

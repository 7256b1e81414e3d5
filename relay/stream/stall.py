"""Stall guard: when a relayed stream counts as stuck (the frame that ends it: `terminal`).

Pure: the caller supplies times (loop.time()) and gets back a reason or the next moment to
look again, so the rule is tested without sockets or sleeping.
"""

from __future__ import annotations

import msgspec


class StallPolicy(msgspec.Struct, frozen=True):
    idle_s: float  # max gap between two upstream reads; 0 = off
    total_s: float  # max wall clock since the response head; 0 = off
    read_s: float  # per-read bound used only when both of the above are 0

    def due(self, now: float, head_at: float, last_read: float) -> str | None:
        """The reason the stream is stalled at `now`, or None."""
        if self.total_s and now - head_at >= self.total_s:
            return "total"
        if self.idle_s and now - last_read >= self.idle_s:
            return "idle"
        if not self.idle_s and not self.total_s and now - last_read >= self.read_s:
            return "read"
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

    def elapsed(self, reason: str, now: float, head_at: float, last_read: float) -> float:
        return round(now - (head_at if reason == "total" else last_read), 3)

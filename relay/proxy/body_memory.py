"""The relay-wide bound on request-body bytes held in memory, across all client connections.

Each connection takes bytes from here as its request body arrives and gives them back when
the request is over (answered, refused, or the client gone). A body that would take the total
over the bound is refused at once with 503 and Retry-After rather than paused: pausing every
reader while the bodies already held cannot complete would stall them all until their 408,
while a refusal keeps memory bounded and tells the client when to come back.
"""

from __future__ import annotations


class BodyBytes:
    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        """Account `n` more bytes if the bound allows; False (nothing taken) if not."""
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n

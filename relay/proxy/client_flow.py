"""Flow control from the client's transport to the upstream's reads, for one exchange.

As uvicorn's flow_control.py: the client transport's buffer over its high-water mark pauses
the upstream reads (so the relay holds about one buffer per stream), and its drain resumes
them. A client that cannot take a write for `write_timeout_s` is given up on (`on_stuck`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Timers(Protocol):
    """What the flow asks of the loop (a fake one in tests)."""

    def call_later(self, delay: float, callback: Callable[[], None], /) -> Cancellable: ...


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Reading(Protocol):
    """The upstream transport whose reads the client's flow pauses."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class ClientFlow:
    __slots__ = ("loop", "on_stuck", "paused", "timeout_s", "timer")

    def __init__(self, loop: Timers, timeout_s: float, on_stuck: Callable[[], None]) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.on_stuck = on_stuck
        # The client is the slow side: upstream reads are not owed.
        self.paused = False
        self.timer: Cancellable | None = None

    def pause(self, upstream: Reading | None) -> None:
        """`upstream`: the upstream transport to stop reading, or None."""
        self.paused = True
        if upstream is not None:
            upstream.pause_reading()
        if self.timer is None:
            self.timer = self.loop.call_later(self.timeout_s, self._stuck)

    def resume(self, upstream: Reading | None) -> None:
        self.paused = False
        self.cancel()
        if upstream is not None:
            upstream.resume_reading()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _stuck(self) -> None:
        self.timer = None
        self.on_stuck()

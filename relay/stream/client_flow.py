"""Flow control from the client's transport to the upstream's reads, for one exchange.

As uvicorn's flow_control.py: the client transport's buffer over its high-water mark pauses
the upstream reads (so the relay holds about one buffer per stream), and its drain resumes
them. A client that cannot take a write for `write_timeout_s` is given up on (`on_stuck`).
"""

from __future__ import annotations


class ClientFlow:
    __slots__ = ("loop", "on_stuck", "paused", "timeout_s", "timer")

    def __init__(self, loop, timeout_s: float, on_stuck) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.on_stuck = on_stuck
        self.paused = False  # the client is the slow side: upstream reads are not owed
        self.timer = None

    def pause(self, upstream) -> None:
        """`upstream`: the upstream transport to stop reading, or None."""
        self.paused = True
        if upstream is not None:
            upstream.pause_reading()
        if self.timer is None:
            self.timer = self.loop.call_later(self.timeout_s, self._stuck)

    def resume(self, upstream) -> None:
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

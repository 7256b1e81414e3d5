"""Structured log lines: one JSON object per line on stderr (or any sink, for tests)."""

from __future__ import annotations

import sys
import time
from typing import Callable

import msgspec

_encode = msgspec.json.Encoder().encode


class Log:
    def __init__(self, sink: Callable[[bytes], object] | None = None) -> None:
        self._sink = sink
        self.lines: list[dict] | None = None  # set to a list to keep records (tests)

    def event(self, event: str, **fields) -> None:
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        if self.lines is not None:
            self.lines.append(record)
        line = _encode(record) + b"\n"
        try:
            if self._sink is not None:
                self._sink(line)
            else:
                sys.stderr.buffer.write(line)
                sys.stderr.buffer.flush()
        except (OSError, ValueError):
            pass  # a closed stderr never stops the relay

    def of(self, event: str) -> list[dict]:
        return [r for r in (self.lines or []) if r["event"] == event]


def quiet() -> Log:
    """A log that keeps records in memory and writes nothing."""
    log = Log(sink=lambda _line: None)
    log.lines = []
    return log

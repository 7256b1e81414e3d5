"""Structured log lines: one JSON object per line on stderr (or any sink, for tests)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping

import msgspec

_encode = msgspec.json.Encoder().encode

# One line as a dict (what `lines` keeps): its fields are whatever JSON the event carries.
Entry = dict[str, object]

# POSIX: a write of at most this many bytes to a pipe is never interleaved with another.
PIPE_BUF = 4096


class Log:
    """Lines are buffered and written together at most `flush_s` later (one write syscall
    per batch, not per request) when an event loop runs; immediately otherwise (another
    thread, such as the store's writer, writes its line at once: a lock keeps lines whole)."""

    def __init__(
        self, sink: Callable[[bytes], object] | None = None, flush_s: float = 0.05
    ) -> None:
        self._sink = sink
        self.flush_s = flush_s
        # Set to a list to keep the lines as dicts too (tests read them with `of`).
        self.lines: list[Entry] | None = None
        self._pending: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None
        self._lock = threading.Lock()

    def shared(self) -> None:
        """Several processes write to this stderr: lines go out whole (`shared_stderr`)."""
        if self._sink is None:
            self._sink = shared_stderr

    def event(self, event: str, **fields: object) -> None:
        self.record(event, fields)

    def record(self, event: str, fields: Mapping[str, object]) -> None:
        """`event` with the fields of a dict (not copied once more as keywords)."""
        entry: Entry = {"ts": round(time.time(), 3), "event": event}
        entry.update(fields)
        line = _encode(entry) + b"\n"
        with self._lock:
            if self.lines is not None:
                self.lines.append(entry)
            self._pending.append(line)
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._write_pending()
                return
            self._timer = loop.call_later(self.flush_s, self.flush)

    def flush(self) -> None:
        """Write what is pending: the timer's call, and the relay's last step."""
        self._timer = None
        self._write_pending()

    def _write_pending(self) -> None:
        with self._lock:
            data, self._pending = b"".join(self._pending), []
            if data:
                self._write(data)

    def _write(self, data: bytes) -> None:
        # A closed stderr never stops the relay.
        try:
            if self._sink is not None:
                self._sink(data)
            else:
                sys.stderr.buffer.write(data)
                sys.stderr.buffer.flush()
        except (OSError, ValueError):
            pass

    def of(self, event: str) -> list[Entry]:
        return [r for r in (self.lines or []) if r["event"] == event]


def shared_stderr(data: bytes) -> None:
    """A sink for processes writing to one stderr (relay.workers): whole lines, written in
    groups of at most PIPE_BUF bytes, so no other process's line lands inside one."""
    start = 0
    while start < len(data):
        end = start + PIPE_BUF
        if end < len(data):
            cut = data.rfind(b"\n", start, end)
            end = cut + 1 if cut >= start else data.find(b"\n", end) + 1 or len(data)
        os.write(2, data[start:end])
        start = end


def quiet() -> Log:
    """A log that keeps records in memory and writes nothing."""
    log = Log(sink=lambda _line: None)
    log.lines = []
    return log

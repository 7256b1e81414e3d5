"""Structured log lines: one JSON object per line on stderr (or any sink, for tests), or one
human line per event for a terminal (`--log-format text`)."""

from __future__ import annotations

import asyncio
import enum
import os
import re
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


class LogFormat(enum.StrEnum):
    """How a line is written: a JSON object (the default, for collectors), or `text`."""

    JSON = "json"
    TEXT = "text"


# A value written bare in a text line; any other is quoted and escaped.
_BARE = re.compile(r"[A-Za-z0-9_.,:/@%+*-]+")
# What a quoted value never holds raw: quotes, backslashes, control characters (C0, DEL,
# C1: a terminal acts on ESC and CSI) and line or paragraph separators.
_UNSAFE = re.compile(r'["\\\x00-\x1f\x7f-\x9f\u2028\u2029]')
# What JSON leaves raw of those (it escapes the rest).
_RAW_IN_JSON = re.compile(r"[\x7f-\x9f\u2028\u2029]")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: re.Match[str]) -> str:
    c = char.group()
    return _ESCAPES.get(c) or f"\\u{ord(c):04x}"


def text_value(value: object) -> str:
    """A field's value in a text line: a plain word as it is, any other string quoted with
    every unsafe character escaped, anything else as its JSON (escaped as well), so a
    value from a client can neither end the line nor forge another."""
    if isinstance(value, str):
        return value if _BARE.fullmatch(value) else f'"{_UNSAFE.sub(_escape, value)}"'
    return _RAW_IN_JSON.sub(_escape, _encode(value).decode())


def text_line(entry: Mapping[str, object]) -> bytes:
    """One event as a text line: its UTC time, its name, then key=value in its order."""
    ts = entry.get("ts")
    seconds = ts if isinstance(ts, float | int) else time.time()
    when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    ms = int(seconds * 1000) % 1000
    fields = " ".join(
        f"{text_value(k)}={text_value(v)}" for k, v in entry.items() if k not in ("ts", "event")
    )
    head = f"{when}.{ms:03d}Z {text_value(entry.get('event'))}"
    return f"{head} {fields}\n".encode() if fields else f"{head}\n".encode()


class Log:
    """Lines are buffered and written together at most `flush_s` later (one write syscall
    per batch, not per request) when an event loop runs; immediately otherwise (another
    thread, such as the store's writer, writes its line at once: a lock keeps lines whole)."""

    def __init__(
        self,
        sink: Callable[[bytes], object] | None = None,
        flush_s: float = 0.05,
        fmt: LogFormat = LogFormat.JSON,
    ) -> None:
        self._sink = sink
        self.flush_s = flush_s
        self.format = fmt
        self._line = text_line if fmt is LogFormat.TEXT else _json_line
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
        line = self._line(entry)
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


def _json_line(entry: Mapping[str, object]) -> bytes:
    return _encode(entry) + b"\n"


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

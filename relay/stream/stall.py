"""Stall guard: when a relayed stream counts as stuck, and the terminal frame that ends it.

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


class _Delta(msgspec.Struct):
    role: str
    content: str


class _ChatChoice(msgspec.Struct):
    index: int
    delta: _Delta
    finish_reason: str


class _TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str


class _StallInfo(msgspec.Struct):
    reason: str
    elapsed_s: float
    upstream: str


class _ChatFrame(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[_ChatChoice]
    x_relay_stall: _StallInfo


class _TextFrame(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[_TextChoice]
    x_relay_stall: _StallInfo


_encode = msgspec.json.Encoder().encode
LEGACY_TEXT_PATHS = ("/v1/completions", "/completion")
DONE_EVENT = b"data: [DONE]\n\n"


def stall_notice(reason: str, elapsed_s: float) -> str:
    return f"\n\n[relay] stall guard: {reason} after {elapsed_s}s"


def stall_frame(
    path: str, model: str, reason: str, elapsed_s: float, upstream: str, created: int
) -> bytes:
    """`\\n\\n`, the synthetic event, then `data: [DONE]` - the SSE bytes a stall ends with."""
    info = _StallInfo(reason, elapsed_s, upstream)
    text = stall_notice(reason, elapsed_s)
    if path in LEGACY_TEXT_PATHS:
        doc: _TextFrame | _ChatFrame = _TextFrame(
            "relay-stall-guard",
            "text_completion",
            created,
            model,
            [_TextChoice(0, text, "length")],
            info,
        )
    else:
        doc = _ChatFrame(
            "relay-stall-guard",
            "chat.completion.chunk",
            created,
            model,
            [_ChatChoice(0, _Delta("assistant", text), "length")],
            info,
        )
    return b"\n\ndata: " + _encode(doc) + b"\n\n" + DONE_EVENT

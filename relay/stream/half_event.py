"""What ends an event the upstream stopped in the middle of, so that it still parses.

The relay cannot take back bytes the client has: when a stall cuts a stream inside an event,
the client holds a half line (`data: {"choices":[{"delta":{"content":"Hel`). A bare blank line
would dispatch it as it is, and every SDK then fails on its JSON (`JSONDecodeError`). Instead
the event is finished as the smallest valid one it can still become:

- a half JSON `data:` line is closed: the string it stops in (a half escape completed), the
  literal or number it stops in, a member without its value (`null`), then its brackets; the
  client gets the text that came, cut where it was cut;
- `data: [DO` becomes `data: [DONE]`;
- an event with no data yet, that names itself (`event: content_blo`), is renamed `ping` with
  a ping's data (every SDK skips a ping); one that does not name itself is ended by its blank
  line (an event without data is not dispatched);
- a data line that is whole but not followed by its blank line gets the blank line.

Bounded: a half event longer than `MAX_CLOSE` is ended by a blank line alone.
"""

from __future__ import annotations

import msgspec

MAX_CLOSE = 64 * 1024
PING = b'event: ping\ndata: {"type":"ping"}\n\n'
_WS = b" \t\r\n"
_HEX = b"0123456789abcdefABCDEF"
_LITERALS = (b"true", b"false", b"null")


def close_event(pending: bytes | bytearray) -> bytes:
    """The bytes that end the half event `pending` (what the client holds of it) validly:
    ending with its blank line. b"" when nothing is pending."""
    if not pending:
        return b""
    text = bytes(pending)
    if len(text) > MAX_CLOSE:
        return b"\n\n"
    nl = text.rfind(b"\n")
    line, before = text[nl + 1 :], text[: nl + 1]
    lines = before.split(b"\n")
    has_data = any(ln.startswith(b"data:") for ln in lines)
    named = any(ln.startswith(b"event:") for ln in lines) or line.startswith(b"event:")
    if line.startswith(b"data:"):
        value = line[5:]
        closer = close_json(value[1:] if value.startswith(b" ") else value)
        if closer is not None:
            return closer + b"\n\n"
        # Not JSON the relay can finish: a blank line, as before.
        return b"\n\n"
    # The half line (a name, an id, a comment) ends here.
    end = b"\n" if line else b""
    if has_data:
        return end + b"\n"
    return end + (PING if named else b"\n")


def close_json(prefix: bytes) -> bytes | None:
    """The shortest bytes that make the JSON text `prefix` was the start of whole, or None
    when `prefix` cannot start a JSON value."""
    stripped = prefix.strip(_WS)
    # `[` alone is an array.
    if len(stripped) > 1 and b"[DONE]".startswith(stripped):
        return b"[DONE]"[len(stripped) :]
    if not stripped:
        return b"{}"
    cut = _Cut()
    for c in prefix:
        if not cut.read(c):
            return None
    tail = bytes(reversed(cut.closers))
    if cut.in_str:
        return _close_string(prefix, cut, tail)
    return _close_value(prefix, cut, tail)


class _Cut:
    """Where a JSON text cut short stands, read a byte at a time: the brackets to close
    (innermost last), inside a string (a key's?) and its escape, the hex digits a `\\u`
    escape still owes, a literal or number being read, and what may come next (`expect`:
    v a value; k a key or the end; K a key; c a colon; e a comma or the end)."""

    __slots__ = ("closers", "esc", "expect", "hex_left", "in_str", "key", "token")

    def __init__(self) -> None:
        self.closers: list[int] = []
        self.in_str = self.esc = self.key = False
        self.hex_left = 0
        self.expect = b"v"
        self.token = b""

    def read(self, c: int) -> bool:
        """One more byte; False when the text can no longer be JSON."""
        if self.in_str:
            return self._in_string(c)
        if self.token and (c in _WS or c in b",]}:"):
            self.token, self.expect = b"", b"e"
        if c in _WS:
            return True
        if c == 0x22:
            if self.expect not in b"vkK":
                return False
            self.in_str, self.key = True, self.expect in b"kK"
            return True
        if c in b"{[]}:,":
            return self._structural(c)
        if self.expect == b"v" or self.token:
            self.token += bytes((c,))
            return True
        return False

    def _in_string(self, c: int) -> bool:
        if self.hex_left:
            self.hex_left = self.hex_left - 1 if c in _HEX else -1
            return self.hex_left >= 0
        if self.esc:
            self.esc = False
            # `\u` owes four hex digits.
            self.hex_left = 4 if c == 0x75 else 0
        elif c == 0x5C:
            self.esc = True
        elif c == 0x22:
            self.in_str = False
            self.expect = b"c" if self.key else b"e"
        return True

    def _structural(self, c: int) -> bool:
        closers, expect = self.closers, self.expect
        if c in b"{[":
            if expect != b"v":
                return False
            closers.append(0x7D if c == 0x7B else 0x5D)
            self.expect = b"k" if c == 0x7B else b"v"
        elif c in b"}]":
            if not closers or closers.pop() != c:
                return False
            self.expect = b"e"
        elif c == 0x3A:
            if expect != b"c":
                return False
            self.expect = b"v"
        else:
            if expect != b"e" or not closers:
                return False
            self.expect = b"K" if closers[-1] == 0x7D else b"v"
        return True


def _close_string(prefix: bytes, cut: _Cut, tail: bytes) -> bytes | None:
    """The string's end: a cut character or escape finished first; a \\u escape cut after
    (or in) a high surrogate needs its low one (a lone surrogate is not JSON)."""
    utf8 = _utf8_rest(prefix)
    # A lone `\` becomes `\\`, or the start of a low surrogate.
    escs = [b"\\", b"udc00"] if cut.esc else [b""]
    hex_left = cut.hex_left
    pads = [b"0" * hex_left, b"dc00"[4 - hex_left :]] if hex_left else [b""]
    rest = (b":null" if cut.key else b"") + tail
    for e in escs:
        for pad in pads:
            for low in (b"", b"\\udc00"):
                out = utf8 + e + pad + low + b'"' + rest
                if _is_json(prefix + out):
                    return out
    return None


def _close_value(prefix: bytes, cut: _Cut, tail: bytes) -> bytes | None:
    """What ends a text cut outside a string: a literal or number finished, a missing value
    (`null`: after a colon, after a comma in an array) or member, then the brackets."""
    out = b""
    expect, closers = cut.expect, cut.closers
    if cut.token:
        finished = _finish_scalar(cut.token)
        if finished is None:
            return None
        out = finished
    elif expect == b"c":
        out = b":null"
    elif expect == b"K":
        out = b'"":null'
    elif expect == b"v" and (
        (closers and closers[-1] == 0x7D) or prefix.rstrip(_WS).endswith(b",")
    ):
        out = b"null"
    out += tail
    return out if _is_json(prefix + out) else None


def _is_json(text: bytes) -> bool:
    try:
        msgspec.json.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


def _utf8_rest(prefix: bytes) -> bytes:
    """The continuation bytes that finish a character cut in its UTF-8 encoding (valid for
    its lead byte: after E0 comes A0.., after F0 90..), or b""."""
    for back in range(1, 4):
        if len(prefix) < back:
            break
        b = prefix[-back]
        if b & 0xC0 == 0x80:
            # A continuation byte: the lead is further back.
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        missing = need - back
        if missing <= 0:
            return b""
        first = 0xA0 if b == 0xE0 and back == 1 else 0x90 if b == 0xF0 and back == 1 else 0x80
        return bytes([first] + [0x80] * (missing - 1))
    return b""


def _finish_scalar(token: bytes) -> bytes | None:
    for literal in _LITERALS:
        if literal.startswith(token):
            return literal[len(token) :]
    if token[-1:] in (b"-", b"+", b".", b"e", b"E"):
        return b"0"
    return b""

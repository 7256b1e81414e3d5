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
        return b"\n\n"  # (not JSON the relay can finish: as before)
    end = b"\n" if line else b""  # the half line (a name, an id, a comment) ends here
    if has_data:
        return end + b"\n"
    return end + (PING if named else b"\n")


def close_json(prefix: bytes) -> bytes | None:
    """The shortest bytes that make the JSON text `prefix` was the start of whole, or None
    when `prefix` cannot start a JSON value."""
    stripped = prefix.strip(_WS)
    if len(stripped) > 1 and b"[DONE]".startswith(stripped):  # (`[` alone: an array)
        return b"[DONE]"[len(stripped) :]
    if not stripped:
        return b"{}"
    closers: list[int] = []  # the brackets to close, innermost last
    in_str = esc = key = False
    hex_left = 0
    expect = b"v"  # v: a value; k: a key or the end; K: a key; c: a colon; e: a comma or end
    token = b""  # a literal or number being read
    for c in prefix:
        if in_str:
            if hex_left:
                hex_left = hex_left - 1 if c in _HEX else -1
                if hex_left < 0:
                    return None
            elif esc:
                esc = False
                hex_left = 4 if c == 0x75 else 0  # \u
            elif c == 0x5C:
                esc = True
            elif c == 0x22:
                in_str = False
                expect = b"c" if key else b"e"
            continue
        if token and (c in _WS or c in b",]}:"):
            token, expect = b"", b"e"
        if c in _WS:
            continue
        if c == 0x22:
            if expect not in b"vkK":
                return None
            in_str, key = True, expect in b"kK"
        elif c in b"{[":
            if expect != b"v":
                return None
            closers.append(0x7D if c == 0x7B else 0x5D)
            expect = b"k" if c == 0x7B else b"v"
        elif c in b"}]":
            if not closers or closers.pop() != c:
                return None
            expect = b"e"
        elif c == 0x3A:
            if expect != b"c":
                return None
            expect = b"v"
        elif c == 0x2C:
            if expect != b"e" or not closers:
                return None
            expect = b"K" if closers[-1] == 0x7D else b"v"
        elif expect == b"v" or token:
            token += bytes((c,))
        else:
            return None
    tail = bytes(reversed(closers))
    if in_str:
        # the string's end: a cut character or escape finished first; a \u escape cut after
        # (or in) a high surrogate needs its low one (a lone surrogate is not JSON)
        utf8 = _utf8_rest(prefix)
        escs = [b"\\", b"udc00"] if esc else [b""]  # a lone `\`: `\\`, or a low surrogate
        pads = [b"0" * hex_left, b"dc00"[4 - hex_left :]] if hex_left else [b""]
        rest = (b":null" if key else b"") + tail
        for e in escs:
            for pad in pads:
                for low in (b"", b"\\udc00"):
                    out = utf8 + e + pad + low + b'"' + rest
                    if _is_json(prefix + out):
                        return out
        return None
    out = b""
    if token:
        finished = _finish_scalar(token)
        if finished is None:
            return None
        out = finished
    elif expect == b"c":
        out = b":null"
    elif expect == b"K":
        out = b'"":null'
    elif expect == b"v" and closers and closers[-1] == 0x7D:
        out = b"null"  # after a colon
    elif expect == b"v" and prefix.rstrip(_WS).endswith(b","):
        out = b"null"  # after a comma in an array
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
            continue  # a continuation byte: the lead is further back
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

"""What ends an event the upstream stopped in the middle of, so that it still parses and
makes up no end and no figure.

The relay cannot take back bytes the client has: when a stall cuts a stream inside an event,
the client holds a half line (`data: {"choices":[{"delta":{"content":"Hel`). A bare blank line
would dispatch it as it is, and every SDK then fails on its JSON (`JSONDecodeError`). So the
event is ended as one of (`Fate`):

- FINISHED, the smallest valid event it can still become, when it is a content delta whose
  text has begun (or whole already, its blank line missing): a half JSON `data:` line is
  closed: the string it stops in (a half escape completed), the literal or number it stops
  in, a member without its value (`null`), then its brackets; the client gets the text that
  came, cut where it was cut;
- DROPPED, made inert, when what is visible of it could end the stream or carry figures
  (`[DONE]`, Anthropic's `message_stop` / `message_delta`, a Responses end, a chunk with
  `usage` or `timings`, a choice's `finish_reason`, llama's `"stop":true`): finishing it
  would make up an end or a count (`"status":"comp"`, `"output_tokens":1` of 10). It is
  read conservatively, as it is cut: on Anthropic and Responses streams anything but a
  content delta is dropped; elsewhere a member whose name is cut short is taken for any name
  it may become. Its JSON is closed, then its top-level members that an SDK reads are
  overridden (a later duplicate wins in every JSON parser): on Anthropic and Responses it
  becomes a `ping` (an `event: ping` line after its data, `"type":"ping"`, and the
  `sequence_number` it took); a chat or completions chunk gets `"choices":[]` and
  `"usage":null`; a llama native event `"content":""` and `"stop":false`. An event with no
  data yet, that names itself (`event: content_blo`), is renamed `ping` with a ping's data
  (every SDK skips a ping); one that does not name itself is ended by its blank line (an
  event without data is not dispatched);
- BROKEN, ended by its blank line as it is, when nothing valid can be made of it: `data: [DO`
  (no JSON starts `[D`: it can only become `[DONE]`, an end), data that is not JSON, an event
  longer than `MAX_CLOSE`.

Lines may end in LF, CRLF or CR (a trailing CR may be the first half of a CRLF: the next line
end is written so that it is not taken for that LF). The relay's stall frame follows
(`terminal`): it is the stream's end.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from relay.stream import dialect as D
from relay.stream.dialect import Api

MAX_CLOSE = 64 * 1024
PING = b'event: ping\ndata: {"type":"ping"}\n\n'
_WS = b" \t\r\n"
_HEX = b"0123456789abcdefABCDEF"
_LITERALS = (b"true", b"false", b"null")
# The text field of each Anthropic content delta.
_DELTA_TEXT = {
    "text_delta": "text",
    "thinking_delta": "thinking",
    "input_json_delta": "partial_json",
}
# Top-level members of a chunk (chat, completions) or a llama native event that end a stream
# or carry figures, each with the one value that does neither.
_CHUNK_KEYS: tuple[tuple[str, object], ...] = (("usage", None), ("timings", None), ("error", None))
_NATIVE_KEYS: tuple[tuple[str, object], ...] = (("stop", False), *_CHUNK_KEYS)


class Fate(StrEnum):
    """What became of a half event (see the module's docstring)."""

    FINISHED = "finished"
    DROPPED = "dropped"
    BROKEN = "broken"


class Closing(msgspec.Struct, frozen=True):
    """The bytes that end a half event, ending with its blank line, and what it became."""

    tail: bytes
    fate: Fate


def close_event(pending: bytes | bytearray, api: Api = D.CHAT, seq: int | None = None) -> Closing:
    """The end of the half event `pending` (what the client holds of it) on an `api` stream;
    `seq`: the `sequence_number` the event would take (a Responses stream that numbers its
    events), given to it when it is dropped. b"" when nothing is pending."""
    if not pending:
        return Closing(b"", Fate.FINISHED)
    raw = bytes(pending)
    if len(raw) > MAX_CLOSE:
        return Closing(b"\n\n", Fate.BROKEN)
    # A lone CR ended the last line: an LF now would make it a CRLF, not a second line end.
    lead = b"\n" if raw.endswith(b"\r") else b""
    text = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n") if lead or 13 in raw else raw
    half = _Fields.read(text)
    if half.data is None:
        if half.named:
            return Closing(lead + half.end + _ping(api, seq), Fate.DROPPED)
        return Closing(lead + half.end + b"\n", Fate.DROPPED)
    closing = _close_data(half, api, seq)
    return Closing(lead + closing.tail, closing.fate)


class _Fields(msgspec.Struct, frozen=True):
    """A half event's fields as a client reads them: its name (the last `event` field), its
    data (its `data` lines joined with LF; None without one), whether its last line is a data
    line still being written (`mid_data`), whether it names itself, and what ends its last
    line when that is not a data line (`end`)."""

    name: bytes | None
    data: bytes | None
    mid_data: bool
    named: bool
    end: bytes

    @classmethod
    def read(cls, text: bytes) -> _Fields:
        lines = text.split(b"\n")
        last = lines.pop()
        name: bytes | None = None
        data: list[bytes] = []
        for line in lines:
            field, value = D.field_of(line)
            if field == b"event":
                name = value
            elif field == b"data":
                data.append(value)
        named = name is not None
        field, value = D.field_of(last)
        colon = 58 in last
        mid_data = colon and field == b"data"
        if mid_data:
            data.append(value)
        elif colon and field == b"event":
            # A name cut short: the client reads it so once its line ends.
            name, named = value, True
        # A line `data` alone would be a data line with no value (the openai SDK would parse
        # ""): another letter makes it a field every client ignores.
        end = b"" if not last else b"_\n" if last == b"data" else b"\n"
        return cls(name, b"\n".join(data) if data else None, mid_data, named, end)


def _ping(api: Api, seq: int | None) -> bytes:
    if api == D.RESPONSES and seq is not None:
        return b'event: ping\ndata: {"type":"ping","sequence_number":%d}\n\n' % seq
    return PING


def _close_data(half: _Fields, api: Api, seq: int | None) -> Closing:
    """The end of an event that has data: its data line finished, dropped or left broken."""
    data = half.data
    assert data is not None
    # What comes after the data: on its line, or a new `data:` line (joined with LF).
    lead = b"" if half.mid_data else half.end + b"data: "
    text = data if half.mid_data else data + b"\n"
    blank = (b"\n" if half.mid_data else half.end) + b"\n"
    stripped = data.strip(_WS)
    if stripped == b"[DONE]":
        return Closing(blank, Fate.FINISHED)
    if stripped[:1] == b"[" and b"[DONE]".startswith(stripped):
        return Closing(blank, Fate.BROKEN)
    closer = close_json(text)
    if closer is None:
        return Closing(blank, Fate.BROKEN)
    if not closer:
        return Closing(blank, Fate.FINISHED)
    doc = msgspec.json.decode(text + closer)
    if _is_content(api, half.name, doc):
        return Closing(lead + closer + b"\n\n", Fate.FINISHED)
    inert = _inert(text, closer, doc, api, seq)
    if inert is None:
        return Closing(blank, Fate.BROKEN)
    renamed = b"event: ping\n" if api in (D.MESSAGES, D.RESPONSES) else b""
    return Closing(lead + inert + b"\n" + renamed + b"\n", Fate.DROPPED)


def _is_content(api: Api, name: bytes | None, doc: object) -> bool:
    """The half event, finished as `doc`, is a content delta whose text has begun (on
    Anthropic and Responses streams), and nothing visible of it could end the stream or carry
    figures. A value that is not an object is neither (no API sends one)."""
    members = _members(doc)
    if members is None:
        return True
    if api == D.MESSAGES:
        return _anthropic_delta(name, members)
    if api == D.RESPONSES:
        kind = members.get("type")
        return (
            (name is None or name.endswith(b".delta"))
            and isinstance(kind, str)
            and kind.endswith(".delta")
            and isinstance(members.get("delta"), str)
        )
    if _may_carry(members, _NATIVE_KEYS if api == D.NATIVE else _CHUNK_KEYS):
        return False
    return api == D.NATIVE or not _finishes(members)


def _members(doc: object) -> dict[str, object] | None:
    return doc if isinstance(doc, dict) else None


def _anthropic_delta(name: bytes | None, doc: dict[str, object]) -> bool:
    if name not in (None, b"content_block_delta") or doc.get("type") != "content_block_delta":
        return False
    delta = _members(doc.get("delta"))
    field = _DELTA_TEXT.get(str(delta.get("type"))) if delta is not None else None
    return delta is not None and field is not None and isinstance(delta.get(field), str)


def _finishes(chunk: dict[str, object]) -> bool:
    """A chunk's choice has a `finish_reason`, or may have one: the cut is in its last
    member, whose name begins that one."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    cut_in = choices[-1] if choices and _last_key(chunk) == "choices" else None
    for choice in choices:
        members = _members(choice)
        if members is not None and _may_carry(
            members, (("finish_reason", None),), cut=choice is cut_in
        ):
            return True
    return False


def _may_carry(
    doc: dict[str, object], keys: tuple[tuple[str, object], ...], cut: bool = True
) -> bool:
    """A member of `doc` among `keys` holds a value other than its harmless one, or (`cut`:
    the cut is inside `doc`) its last member's name begins one of them: a name cut short, or
    a value cut (`"usage":` closed as `null`)."""
    for key, harmless in keys:
        if key in doc and doc[key] != harmless:
            return True
    last = _last_key(doc) if cut else None
    return last is not None and any(key.startswith(last) for key, _ in keys)


def _last_key(doc: dict[str, object]) -> str | None:
    return next(reversed(doc), None)


def _inert(text: bytes, closer: bytes, doc: object, api: Api, seq: int | None) -> bytes | None:
    """`closer` with the top-level members that make the event inert written before its last
    `}` (after every member the event has: the later one wins), or None."""
    if not isinstance(doc, dict) or not closer.endswith(b"}"):
        return None
    if api in (D.MESSAGES, D.RESPONSES):
        members = b'"type":"ping"'
        if api == D.RESPONSES and seq is not None:
            members += b',"sequence_number":%d' % seq
    elif api == D.NATIVE:
        members = b'"content":"","stop":false'
    else:
        members = b'"choices":[],"usage":null'
    if api != D.MESSAGES and api != D.RESPONSES and _may_carry(doc, (("timings", None),)):
        members += b',"timings":null'
    out = closer[:-1] + (b"," if doc else b"") + members + b"}"
    return out if _is_json(text + out) else None


def close_json(prefix: bytes) -> bytes | None:
    """The shortest bytes that make the JSON text `prefix` was the start of whole, or None
    when `prefix` cannot start a JSON value."""
    stripped = prefix.strip(_WS)
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

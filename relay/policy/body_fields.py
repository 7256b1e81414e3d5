"""The top-level members of a JSON request body the relay decides on, read once, never ambiguous.

The relay routes, maps, reserves and records on a few top-level members (`DECIDING`). Which
of two members of one name an upstream reads is its parser's choice (most keep the last, some
the first), and every parser unescapes names (`"mo\\u0064el"` is `model`). So a body naming
one of them more than once is refused (`Ambiguous`, answered 400 `invalid_json`): what the
relay routed and charged and what the upstream runs could differ.

Bounded work for any body the relay accepts (`max_body_bytes`), each step one C-speed pass:

- `read`: msgspec picks the deciding members out as the bytes they were sent as, skipping the
  rest without building it;
- `locate`: where each value lies, and that its name occurs once. Asked first of the bytes: a
  name whose quoted spelling occurs once in the whole body, in a body with no escaped letter
  anywhere, is named once (its one occurrence is the member). Only a body where a name may
  repeat (a nested member or a value of that spelling, an escape) is walked member by member
  at the top level, each name and value skipped by msgspec in C (what follows a value is
  "trailing" to it: the offset msgspec names is where it ends); the walk stops at
  `MAX_MEMBERS` members (`TooManyMembers`: no API request has a thousand parameters).

`splice` rewrites (the name an upstream knows a model by, a token cap) in place: a member's
value where it was sent, a new member before the closing brace; every other byte stays as the
client sent it.
"""

from __future__ import annotations

import re

import msgspec
from msgspec import Raw
from msgspec.structs import astuple

DECIDING = (
    "model",
    "stream",
    "n_predict",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
    "best_of",
    "n_cmpl",
    "prompt",
)
# The top-level members walked when a deciding name may occur twice.
MAX_MEMBERS = 1024

# Where a value lies in the body: (start, end).
Span = tuple[int, int]


class Members(msgspec.Struct):
    """The deciding members as sent (an empty Raw: absent; `null` is present). `n_cmpl` is
    llama-server's own count of choices."""

    model: Raw = Raw()
    stream: Raw = Raw()
    n_predict: Raw = Raw()
    max_tokens: Raw = Raw()
    max_completion_tokens: Raw = Raw()
    max_output_tokens: Raw = Raw()
    n: Raw = Raw()
    best_of: Raw = Raw()
    n_cmpl: Raw = Raw()
    prompt: Raw = Raw()


class Ambiguous(ValueError):
    """A deciding member named more than once."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the member {name!r} is named more than once")
        self.name = name


class TooManyMembers(ValueError):
    """More than MAX_MEMBERS top-level members walked, and a deciding name may repeat."""


_members = msgspec.json.Decoder(Members)
_raw = msgspec.json.Decoder(Raw)
_TOKENS = {name: b'"%s"' % name.encode() for name in DECIDING}
_NAMES = frozenset(name.encode() for name in DECIDING)
# `\u0041`-`\u007f`: the only escapes that unescape to a letter, digit or `_` of a name
_ESCAPED_LETTER = re.compile(rb"\\u00[4-7][0-9a-fA-F]")
_WS = re.compile(rb"[ \t\r\n]*")
# JSON's whitespace.
_BLANK = b" \t\r\n"
_SCALAR = re.compile(rb"[-+0-9.eE]+|true|false|null")
_TRAILING = re.compile(r"trailing characters \(byte (\d+)\)")


def read(body: bytes) -> Members:
    """The deciding members; raises msgspec's DecodeError/ValidationError (not one JSON
    object) or RecursionError (nested too deeply)."""
    return _members.decode(body)


def present(members: Members) -> list[str]:
    """The names of the deciding members `members` holds, in DECIDING's order."""
    return [name for name, raw in zip(DECIDING, astuple(members), strict=True) if raw]


def model_span(body: bytes) -> Span | None:
    """Where the top-level `model` string's value lies in `body` (a JSON object the relay
    accepted: its members named once), None when it names no model string."""
    members = read(body)
    if not members.model or memoryview(members.model)[0] != 0x22:
        return None
    return locate(body, members).get("model")


def _named_once(body: bytes, names: list[str]) -> bool:
    """Whether the bytes alone tell that each of `names` is named once: its quoted spelling
    occurs once, and no escaped letter could spell it otherwise."""
    return (body.find(b"\\u00") < 0 or _ESCAPED_LETTER.search(body) is None) and all(
        body.count(_TOKENS[name]) == 1 for name in names
    )


def check(body: bytes, members: Members) -> None:
    """Raises Ambiguous naming a deciding member `body` sends more than once (the members
    `read` found in it), TooManyMembers when that cannot be told within MAX_MEMBERS."""
    names = present(members)
    if names and not _named_once(body, names):
        walk(body)


def locate(body: bytes, members: Members) -> dict[str, Span]:
    """The span of each deciding member `members` has, in `body` (the bytes it was read
    from). Raises Ambiguous naming a member sent more than once, TooManyMembers."""
    names = present(members)
    if not names:
        return {}
    if _named_once(body, names):
        spans: dict[str, Span] = {}
        for name in names:
            i = body.find(_TOKENS[name]) + len(_TOKENS[name])
            # Compact JSON, as clients send it, has the value right after the colon.
            if body[i : i + 1] == b":" and body[i + 1 : i + 2] not in _BLANK:
                i += 1
            else:
                i = _colon(body, i)
            spans[name] = (i, i + len(getattr(members, name)))
        return spans
    return walk(body)


def _ws(body: bytes, i: int) -> int:
    """Where the JSON whitespace from `i` on ends."""
    m = _WS.match(body, i)
    return m.end() if m is not None else i


def _colon(body: bytes, i: int) -> int:
    """Where the value after the name ending at `i` starts."""
    i = _ws(body, i)
    if body[i : i + 1] != b":":
        raise msgspec.DecodeError(f"':' expected at byte {i}")
    return _ws(body, i + 1)


def walk(body: bytes) -> dict[str, Span]:
    """The spans of the deciding members, walking the top-level members one by one (the
    body is one JSON object `read` accepted)."""
    spans: dict[str, Span] = {}
    # The first member's name starts after the opening brace.
    i = _ws(body, _ws(body, 0) + 1)
    if body[i : i + 1] == b"}":
        return spans
    for _ in range(MAX_MEMBERS):
        if body[i : i + 1] != b'"':
            raise msgspec.DecodeError(f"a member name expected at byte {i}")
        end = value_end(body, i)
        token = body[i:end]
        name = msgspec.json.decode(token).encode() if 92 in token else token[1:-1]
        i = _colon(body, end)
        end = value_end(body, i)
        if name in _NAMES:
            key = name.decode()
            if key in spans:
                raise Ambiguous(key)
            spans[key] = (i, end)
        i = _ws(body, end)
        if body[i : i + 1] == b"}":
            return spans
        # The body is one valid object: a byte after a member that is not its closing brace
        # is the comma before the next member.
        i = _ws(body, i + 1)
    raise TooManyMembers(f"more than {MAX_MEMBERS} top-level members")


def value_end(body: bytes, i: int) -> int:
    """Where the JSON value starting at `i` ends (the body goes on after it).

    msgspec skips a string, object or array in C, and what follows it is "trailing": the
    byte offset msgspec names counts past that byte. The blanks before it are stepped back
    over in place, with no copy of the body."""
    first = body[i : i + 1]
    if first in (b'"', b"{", b"["):
        try:
            _raw.decode(memoryview(body)[i:])
        except msgspec.DecodeError as exc:
            t = _TRAILING.search(str(exc))
            if t is not None:
                at = i + int(t.group(1)) - 1
                if body[at : at + 1] in (b",", b"}", b":"):
                    while at > i and body[at - 1] in _BLANK:
                        at -= 1
                    return at
        raise msgspec.DecodeError(f"a value expected at byte {i}")
    else:
        m = _SCALAR.match(body, i)
    if m is None:
        raise msgspec.DecodeError(f"a value expected at byte {i}")
    return m.end()


def splice(
    body: bytes, spans: dict[str, Span], values: dict[str, bytes]
) -> tuple[bytes, dict[str, Span]]:
    """`body` with each member in `values` set to its (JSON-encoded) value: replaced where
    `spans` locates it, else appended before the closing brace; and the spans in the
    result of every member `spans` and `values` name."""
    edits = sorted((spans[name][0], spans[name][1], name) for name in values if name in spans)
    added = [name for name in values if name not in spans]

    def moved(i: int) -> int:
        """Where byte `i` of `body` lands in the result."""
        return i + sum(len(values[n]) - (e - s) for s, e, n in edits if s < i)

    out: dict[str, Span] = {}
    for name, (s, e) in spans.items():
        at = moved(s)
        out[name] = (at, at + (len(values[name]) if name in values else e - s))
    view = memoryview(body)
    parts: list[bytes | memoryview] = []
    pos = 0
    for start, end, name in edits:
        parts += (view[pos:start], values[name])
        pos = end
    if added:
        # The closing brace, and where the last member before it ends.
        close = len(body.rstrip(_BLANK)) - 1
        last = len(body[:close].rstrip(_BLANK))
        if close < 1 or body[close] != 0x7D or last < 1:
            raise msgspec.DecodeError("not a JSON object")
        parts.append(view[pos:last])
        pos, at = last, moved(last)
        for k, name in enumerate(added):
            member = (b"" if k == 0 and body[last - 1] == 0x7B else b",") + _TOKENS[name] + b":"
            at += len(member)
            out[name] = (at, at + len(values[name]))
            at += len(values[name])
            parts += (member, values[name])
    parts.append(view[pos:])
    return b"".join(parts), out

"""The model name an upstream expects, spliced into the request body.

A public name (a model or alias clients ask for) may be served under another name upstream
(`[[upstream]].model_map`). Only the value of the top-level `"model"` member changes: every
other byte of the body stays as the client sent it (key order, whitespace, escapes,
numbers), so what the upstream parses is the client's request with one name replaced.
"""

from __future__ import annotations

import re

import msgspec

_WS = re.compile(rb"[ \t\r\n]*")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
# The top-level members, each value as the exact bytes it was sent as (msgspec, in C): the
# walk below then only jumps from member to member, whatever is nested inside them.
_members = msgspec.json.Decoder(dict[str, msgspec.Raw])


class NotJson(ValueError):
    pass


def _ws(body: bytes, i: int) -> int:
    """Where the JSON whitespace at `i` ends (`_WS` matches the empty run too)."""
    m = _WS.match(body, i)
    return m.end() if m is not None else i


def model_spans(body: bytes) -> list[tuple[int, int]]:
    """(start, end) of the top-level `"model"` member's string value, quotes included.

    Raises NotJson when the body is not one JSON object, or names a member twice (which one
    an upstream reads is its parser's choice: no rewrite is safe then).
    """
    try:
        members = _members.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise NotJson("not a JSON object") from None
    spans = []
    i = _ws(body, 0) + 1  # after the opening brace
    for key, raw in members.items():  # in the order they were sent (first time each)
        i = _ws(body, i)
        m = _STRING.match(body, i)
        if m is None:
            raise NotJson(f"member name expected at {i}")
        name = m.group()
        if (msgspec.json.decode(name) if b"\\" in name else name[1:-1].decode()) != key:
            raise NotJson("a member named twice")  # the dict kept its first place only
        i = _ws(body, _ws(body, m.end()) + 1)  # past the colon (the decoder saw it)
        end = i + len(raw)
        if body[i:end] != bytes(raw):
            raise NotJson("a member named twice")  # (the value is a later one's)
        if key == "model" and body[i] == 0x22:
            spans.append((i, end))
        i = _ws(body, end)
        last = body[i]  # the comma or the closing brace
        i += 1
    if members and last != 0x7D:
        raise NotJson("a member named twice")  # members left over: names repeated
    return spans


def with_model(body: bytes, name: str) -> bytes:
    """`body` with the top-level `model` string set to `name` (JSON-escaped); the body as is
    when it names no model, is not a JSON object or names a member twice."""
    try:
        spans = model_spans(body)
    except NotJson:
        return body
    if not spans:
        return body
    value = msgspec.json.encode(name)
    parts, pos = [], 0
    for start, end in spans:
        parts.append(body[pos:start])
        parts.append(value)
        pos = end
    parts.append(body[pos:])
    return b"".join(parts)


def served_name(model_map: dict[str, str], public: str | None) -> str | None:
    """The name an upstream expects for `public`, when it differs (else None: no rewrite).
    `"*"` maps every name the upstream gets that is not listed itself."""
    if not public or not model_map:
        return None
    name = model_map.get(public) or model_map.get("*")
    return name if name and name != public else None

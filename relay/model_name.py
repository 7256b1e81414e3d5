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
_STRUCT = re.compile(rb'["{}\[\]]')
_SCALAR = re.compile(rb"[^,}\]\s]*")


class NotJson(ValueError):
    pass


def _ws(body: bytes, i: int) -> int:
    return _WS.match(body, i).end()


def _string_end(body: bytes, i: int) -> int:
    m = _STRING.match(body, i)
    if m is None:
        raise NotJson(f"unterminated string at {i}")
    return m.end()


def _value_end(body: bytes, i: int) -> int:
    """Where the JSON value starting at `i` ends."""
    if i >= len(body):
        raise NotJson("value expected")
    c = body[i]
    if c == 0x22:  # "
        return _string_end(body, i)
    if c not in (0x7B, 0x5B):  # a number or a literal
        return _SCALAR.match(body, i).end()
    depth = 0
    while True:
        m = _STRUCT.search(body, i)
        if m is None:
            raise NotJson("unterminated object or array")
        c = body[m.start()]
        if c == 0x22:
            i = _string_end(body, m.start())
            continue
        i = m.end()
        depth += 1 if c in (0x7B, 0x5B) else -1
        if depth == 0:
            return i


def _is_model(key: bytes) -> bool:
    if key == b'"model"':
        return True
    return b"\\" in key and msgspec.json.decode(key) == "model"  # e.g. "mod\u0065l"


def model_spans(body: bytes) -> list[tuple[int, int]]:
    """(start, end) of every top-level `"model"` member's string value, quotes included.
    Raises NotJson when the body is not one JSON object."""
    i = _ws(body, 0)
    if body[i:i + 1] != b"{":
        raise NotJson("not a JSON object")
    spans = []
    i = _ws(body, i + 1)
    if body[i:i + 1] == b"}":
        return spans
    while True:
        key_end = _string_end(body, i)
        key = body[i:key_end]
        i = _ws(body, key_end)
        if body[i:i + 1] != b":":
            raise NotJson(f"':' expected at {i}")
        start = _ws(body, i + 1)
        end = _value_end(body, start)
        if body[start:start + 1] == b'"' and _is_model(key):
            spans.append((start, end))
        i = _ws(body, end)
        sep = body[i:i + 1]
        if sep == b"}":
            return spans
        if sep != b",":
            raise NotJson(f"',' or '}}' expected at {i}")
        i = _ws(body, i + 1)


def with_model(body: bytes, name: str) -> bytes:
    """`body` with the top-level `model` string set to `name` (JSON-escaped); the body as is
    when it names no model or is not a JSON object."""
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

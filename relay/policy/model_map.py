"""The model name an upstream expects, spliced into the request body.

A public name (a model or alias clients ask for) may be served under another name upstream
(`[[upstream]].model_map`). Only the value of the top-level `"model"` member changes, where
it was sent (`body_fields.splice`, at the span `body_fields.locate` found for the one member
of that name): every other byte of the body stays as the client sent it (key order,
whitespace, escapes, numbers), so what the upstream parses is the client's request with one
name replaced.
"""

from __future__ import annotations

import msgspec

from relay.policy import body_fields


def with_model(body: bytes, name: str) -> bytes:
    """`body` (a JSON object the relay accepted) with its top-level `model` string set to
    `name` (JSON-escaped); the body as is when it names no model string."""
    span = body_fields.model_span(body)
    if span is None:
        return body
    return body_fields.splice(body, {"model": span}, {"model": msgspec.json.encode(name)})[0]


def served_name(model_map: dict[str, str], public: str | None) -> str | None:
    """The name an upstream expects for `public`, when it differs (else None: no rewrite).
    `"*"` maps every name the upstream gets that is not listed itself."""
    if not public or not model_map:
        return None
    name = model_map.get(public) or model_map.get("*")
    return name if name and name != public else None

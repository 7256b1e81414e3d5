"""What the e2e tests share: the chat path and body, the tiny model's first chat tokens, and the
masks of the values that change from run to run (ids, times, the slot that served)."""

from __future__ import annotations

import re

CHAT = "/v1/chat/completions"
CHAT8 = "Hello from a tiny llama. Hello from"  # the first 8 chat tokens


def chat_body(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "Hi there"}], "cache_prompt": False, **kw}


_MASKS = [
    (re.compile(rb'"id":"[^"]*"'), b'"id":"<id>"'),
    (re.compile(rb'"created":[0-9]+'), b'"created":0'),
    (re.compile(rb'"id_slot":[0-9]+'), b'"id_slot":0'),  # which of the 2 slots served it
    (
        re.compile(rb'"((?:prompt|predicted)_(?:ms|per_token_ms|per_second))":[-0-9.eE+]+'),
        rb'"\1":0',
    ),
]


def mask(data: bytes) -> bytes:
    for pattern, repl in _MASKS:
        data = pattern.sub(repl, data)
    return data

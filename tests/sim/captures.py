"""The pinned llama-server's Messages / Responses captures (tests/support/captures/), read.

`capture(name)` splits one ``.http`` file into its request (path, body) and its response
(status, headers, chunk payloads or body, raw bytes); `named_events` splits an SSE payload
into (event name, JSON) pairs; `canon` reduces a JSON value to what the simulator must
reproduce: key order everywhere, values except the ones that vary from run to run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tests.support.api_captures import CAPTURES
from tests.support.sim_client import events, hval, parse_chunks, parse_head

SEP = b"======== RESPONSE (raw bytes) ========\n"
# values that differ from run to run, or between the tiny model and the simulator's token
# count (a token per 4 prompt characters, no BOS; its prompt cache does not hold the requests
# the captures' server saw before): only their type must match
VARIABLE = {
    "id",
    "item_id",
    "call_id",
    "created_at",
    "completed_at",
    "input_tokens",
    "cache_read_input_tokens",
    "total_tokens",
    "cached_tokens",
}
# the tool captures' trick (a prefilled call, a stop word the model's first token holds):
# their text, stop word and token counts are not the simulator's; these values may differ
TOOL_TRICK = {"text", "delta", "stop_sequence", "output_tokens"}


@dataclass
class Capture:
    path: str
    body: dict | bytes
    status: int
    headers: list[tuple[bytes, bytes]]
    chunks: list[bytes] | None  # chunk payloads of a chunked body
    body_bytes: bytes  # a Content-Length body
    raw: bytes  # the whole response as read


def capture(name: str) -> Capture:
    raw = (CAPTURES / f"{name}.http").read_bytes()
    reqpart, resp = raw.split(b"\n" + SEP, 1)
    reqhead, rb = reqpart.split(b"\r\n\r\n", 1)
    path = reqhead.split(b" ", 2)[1].decode()
    try:
        body: dict | bytes = json.loads(rb)
    except ValueError:
        body = rb
    head, rest = resp.split(b"\r\n\r\n", 1)
    status, headers = parse_head(head)
    if hval(headers, b"transfer-encoding") == b"chunked":
        return Capture(path, body, status, headers, parse_chunks(rest, whole=True), b"", resp)
    assert len(rest) == int(hval(headers, b"content-length"))
    return Capture(path, body, status, headers, None, rest, resp)


def named_events(payload: bytes) -> list[tuple[str, dict]]:
    """(name, data) of each ``event: NAME\\ndata: JSON`` event of an SSE payload."""
    out = []
    for ev in events(payload):
        name, data = ev[:-2].split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: "), ev
        out.append((name[7:].decode(), json.loads(data[6:])))
    return out


def canon(o, loose: frozenset[str] = frozenset(), key: str = ""):
    """Key order and values, with VARIABLE values as their type, `loose` ones as "*",
    ``timings`` as its keys in order with their value types."""
    if key == "timings":
        return [(k, type(v).__name__) for k, v in o.items()]
    if isinstance(o, dict):
        return [(k, canon(v, loose, k)) for k, v in o.items()]
    if isinstance(o, list):
        return [canon(x, loose, key) for x in o]
    if key in loose:
        return "*"
    if key in VARIABLE:
        return type(o).__name__
    return o

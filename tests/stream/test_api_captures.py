"""The scanner on the pinned llama-server's own /v1/messages and /v1/responses streams
(tests/support/captures/): the API recognised, every non-empty delta one content event and
nothing else, the exact usage as the server counted it, no `[DONE]`; checked against a
reading of the same bytes made here, event by event with a JSON parser."""

from __future__ import annotations

import json

import pytest

from relay.stream import dialect as D
from relay.stream.sse import SseScanner
from relay.stream.terminal import stall_frame
from relay.stream.usage import exact_usage, stream_usage
from tests.support.api_captures import CAPTURES, body_of

STREAMS = sorted(p.name for p in CAPTURES.glob("*_stream*.http"))
BODIES = sorted(p.name for p in CAPTURES.glob("*_nonstream*.http"))


def parsed(body: bytes) -> list[tuple[str, dict]]:
    out = []
    for ev in body.split(b"\n\n"):
        lines = dict(ln.split(b": ", 1) for ln in ev.split(b"\n") if b": " in ln)
        if b"data" in lines:
            doc = json.loads(lines[b"data"])
            out.append((lines.get(b"event", b"").decode(), doc))
    return out


def test_the_captures_are_there():
    assert any(n.startswith("messages_") for n in STREAMS)
    assert any(n.startswith("responses_") for n in STREAMS)


def expected(name: str, events: list[tuple[str, dict]]) -> tuple[str, int, int, int]:
    """(api, content events, prompt tokens, completion tokens), read here."""
    if name.startswith("messages_"):
        deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
        content = sum(
            1 for d in deltas if d.get("text") or d.get("thinking") or d.get("partial_json")
        )
        start = next(d for n, d in events if n == "message_start")["message"]["usage"]
        prompt = (
            start["input_tokens"]
            + start.get("cache_read_input_tokens", 0)
            + start.get("cache_creation_input_tokens", 0)
        )
        out = [d["usage"]["output_tokens"] for n, d in events if n == "message_delta"][-1]
        return D.MESSAGES, content, prompt, out
    content = sum(1 for n, d in events if n.endswith(".delta") and d.get("delta"))
    usage = next(d for n, d in events if n == "response.completed")["response"]["usage"]
    return D.RESPONSES, content, usage["input_tokens"], usage["output_tokens"]


@pytest.mark.parametrize("name", STREAMS)
@pytest.mark.parametrize("path", ["from the capture", "/v1/chat/completions"])
@pytest.mark.parametrize("step", [1, 7, 1 << 20])
def test_streams_read_as_the_server_sent_them(name, path, step):
    body = body_of(name)
    assert b"[DONE]" not in body
    events = parsed(body)
    api, content, prompt, completion = expected(name, events)
    request_path = "/v1/messages" if api == D.MESSAGES else "/v1/responses"
    s = SseScanner(dialect=D.from_path(request_path if path == "from the capture" else path))
    for i in range(0, len(body), step):
        s.feed(body[i : i + step])
    assert (s.dialect, s.content_events, s.done_seen, s.error_first) == (api, content, True, False)
    usage = stream_usage(s.meta, s.meta_first)
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, completion)
    assert stall_frame(s, D.CHAT, "m", "idle", 1.0, "u", 1) == b""  # it ended on its own


@pytest.mark.parametrize("name", BODIES)
def test_bodies_usage(name):
    doc = json.loads(body_of(name))
    u = doc["usage"]
    prompt = (
        u["input_tokens"]
        + u.get("cache_read_input_tokens", 0)
        + u.get("cache_creation_input_tokens", 0)
    )
    usage = exact_usage(body_of(name))
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, u["output_tokens"])

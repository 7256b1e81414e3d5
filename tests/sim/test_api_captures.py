"""The simulator's /v1/messages and /v1/responses answers against the pinned llama-server's
captures (tests/support/captures/, `python -m tests.e2e.capture_apis`): the same status and
headers, the same HTTP chunks holding the same named events, each event's JSON with the same
keys in the same order and the same values but ids, timestamps and prompt-token counts
(captures.VARIABLE), and the connection closed after a stream, kept after a body."""

from __future__ import annotations

import json

import pytest

from tests.sim.captures import TOOL_TRICK, canon, capture, named_events
from tests.support.sim_client import Client, hval, stream

# capture -> the "sim" knobs that make the simulator answer its request the same way
STREAMS = {
    "messages_stream": {},
    "messages_stream_stop_sequence": {},
    "messages_stream_tools_text": {},
    "messages_stream_empty": {},
    "responses_stream": {},
    "responses_stream_stop": {},
    "responses_stream_tools_text": {},
    "responses_stream_empty": {},
    # a tool call whose arguments come in one delta, with the first event (role + call) or
    # with one text token before it in one chunk, as the prefilled call came
    "messages_stream_tool_use": {"tool_call": {"pieces": 1}},
    "messages_stream_text_then_tool_use": {
        "tool_call": {"pieces": 1},
        "tokens": 1,
        "events_per_chunk": 2,
    },
    "responses_stream_function_call": {"tool_call": {"pieces": 1}},
    "responses_stream_text_then_function_call": {
        "tool_call": {"pieces": 1},
        "tokens": 1,
        "events_per_chunk": 2,
    },
}
BODIES = {
    "messages_nonstream": {},
    "messages_count_tokens": {},
    "messages_nonstream_tool_use": {"tool_call": True},
    "messages_nonstream_text_then_tool_use": {"tool_call": True, "tokens": 1},
    "responses_nonstream": {},
    "responses_input_tokens": {},
    "responses_nonstream_function_call": {"tool_call": True},
    "responses_nonstream_text_then_function_call": {"tool_call": True, "tokens": 1},
}
# the simulator answers these byte for byte as the server did
EXACT_ERRORS = [
    "err_messages_bad_field",
    "err_messages_no_messages",
    "err_responses_bad_field",
    "err_responses_no_input",
    "err_responses_previous_response_id",
]


def _loose(name: str) -> frozenset[str]:
    return frozenset(TOOL_TRICK) if "tool_use" in name or "function_call" in name else frozenset()


def _trickless(name: str, ev: str, data: dict) -> dict:
    """A captured event without what the tool trick adds: the call arrived with the final
    result, so its arguments delta carries that result's ``timings``."""
    if ev == "response.function_call_arguments.delta":
        return {k: v for k, v in data.items() if k != "timings"}
    return data


@pytest.mark.parametrize("name", sorted(STREAMS))
async def test_stream_matches_capture(sim, name):
    cap = capture(name)
    assert isinstance(cap.body, dict)
    c, status, headers = await stream(sim, cap.path, {**cap.body, "sim": STREAMS[name]})
    assert status == cap.status == 200
    assert headers == cap.headers  # names, order and values
    chunks = await c.chunks()
    assert await c.eof() == b""  # closed after the stream, as llama-server does
    assert cap.chunks is not None
    mine = [named_events(x) for x in chunks]
    theirs = [named_events(x) for x in cap.chunks]
    assert [[e for e, _ in x] for x in mine] == [[e for e, _ in x] for x in theirs]
    loose = _loose(name)
    for m, t in zip(mine, theirs):
        for (ev, md), (_, td) in zip(m, t):
            assert md["type"] == ev  # the data names its event
            assert canon(md, loose) == canon(_trickless(name, ev, td), loose), ev
    req = sim.requests[-1]
    assert req.finished and req.closed.is_set() and req.peer_closed_at is None


@pytest.mark.parametrize("name", sorted(BODIES))
async def test_body_matches_capture_and_keeps_alive(sim, name):
    cap = capture(name)
    assert isinstance(cap.body, dict)
    c = await Client.connect(sim)
    await c.send("POST", cap.path, {**cap.body, "sim": BODIES[name]})
    status, headers = await c.head()
    assert status == cap.status == 200
    assert [h if h[0] != b"Content-Length" else h[0] for h in headers] == [
        h if h[0] != b"Content-Length" else h[0] for h in cap.headers
    ]
    body = await c.body(headers)
    loose = _loose(name)
    assert canon(json.loads(body), loose) == canon(json.loads(cap.body_bytes), loose)
    await c.send("GET", "/health")  # the same connection: kept alive
    status, headers = await c.head()
    assert status == 200 and await c.body(headers) == b'{"status":"ok"}'
    c.close()


@pytest.mark.parametrize("name", EXACT_ERRORS)
async def test_error_matches_capture_bytes(sim, name):
    cap = capture(name)
    c = await Client.connect(sim)
    await c.send("POST", cap.path, cap.body)
    assert await c.eof() == cap.raw  # head and body, then the close (Connection: close)


@pytest.mark.parametrize("name", ["err_messages_invalid_json", "err_responses_invalid_json"])
async def test_invalid_json_matches_capture(sim, name):
    cap = capture(name)
    c = await Client.connect(sim)
    await c.send("POST", cap.path, cap.body)
    status, headers = await c.head()
    assert status == cap.status == 400
    assert [h for h in headers if h[0] != b"Content-Length"] == [
        h for h in cap.headers if h[0] != b"Content-Length"
    ]
    mine, theirs = json.loads(await c.body(headers)), json.loads(cap.body_bytes)
    assert canon(mine, frozenset({"message"})) == canon(theirs, frozenset({"message"}))
    assert mine["error"]["message"].startswith("[json.exception.parse_error.101] parse error")
    assert hval(headers, b"connection") == b"close" and await c.eof() == b""

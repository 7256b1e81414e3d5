"""The simulator's knobs on /v1/messages and /v1/responses, over real sockets: the tool call,
limits and stop words, usage, pacing, stalls, drops, delays, content-length streams, chunk
grouping, error knobs, and the token-count routes."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from relay.sim import frames as F
from relay.sim import messages as M
from relay.sim import responses as R
from relay.sim.wire import ToolCall
from tests.sim.captures import named_events
from tests.support.sim_client import Client, T, events, hval, stream

HI = [{"role": "user", "content": "Hi there"}]
MSG = {"model": "tiny", "max_tokens": 8, "stream": True, "messages": HI}
RESP = {"model": "tiny", "max_output_tokens": 8, "stream": True, "input": "Hi there"}
APIS = [("/v1/messages", MSG), ("/v1/responses", RESP)]
TOOLS_A = [{"name": "lookup", "input_schema": {"type": "object"}}]
TOOLS_R = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
FIRST = {"/v1/messages": b"event: message_start\n", "/v1/responses": b"event: response.created\n"}


def names(chunks: list[bytes]) -> list[list[str]]:
    return [[e for e, _ in named_events(c)] for c in chunks]


def datas(chunks: list[bytes]) -> list[dict]:
    return [d for c in chunks for _, d in named_events(c)]


async def test_messages_tool_call_streams_input_json_pieces(sim):
    body = {**MSG, "tools": TOOLS_A, "sim": {"tool_call": True}}
    c, _, _ = await stream(sim, "/v1/messages", body)
    chunks = await c.chunks()
    assert names(chunks) == [
        ["message_start", "content_block_start", "content_block_delta"],
        *[["content_block_delta"]] * 4,
        ["content_block_stop", "message_delta", "message_stop"],
    ]
    evs = datas(chunks)
    assert evs[1]["content_block"] == {"type": "tool_use", "id": evs[1]["content_block"]["id"],
                                       "name": "lookup"}  # fmt: skip
    deltas = [e["delta"] for e in evs if e["type"] == "content_block_delta"]
    assert [d["partial_json"] for d in deltas] == ['{"', "city", '": "', "Paris", '"}']
    assert {d["type"] for d in deltas} == {"input_json_delta"} and evs[-3]["index"] == 0
    assert evs[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert evs[-2]["usage"] == {"output_tokens": 5}
    assert sim.requests[-1].tokens_sent == 5 and sim.requests[-1].completion_tokens == 5


async def test_responses_tool_call_after_text(sim):
    knobs = {"tool_call": {"name": "f", "arguments": {"q": [1, 2]}}, "tokens": 2}
    body = {**RESP, "max_output_tokens": 20, "tools": TOOLS_R, "sim": knobs}
    c, _, _ = await stream(sim, "/v1/responses", body)
    chunks = await c.chunks()
    assert names(chunks)[2] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
    ]
    evs = datas(chunks)
    item = evs[6]["item"]
    assert item["type"] == "function_call" and item["name"] == "f" and item["arguments"] == ""
    assert item["id"] == "fc_" + item["call_id"][5:]
    pieces = [e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta"]
    assert pieces == ['{"', "q", '":[', "1", ",", "2", "]}"]
    done = json.loads(json.dumps(evs[-1]["response"]["output"]))
    assert [o["type"] for o in done] == ["message", "function_call"]
    assert done[0]["content"][0]["text"] == "Hello from" and done[1]["arguments"] == '{"q":[1,2]}'
    assert evs[-1]["response"]["usage"]["output_tokens"] == 2 + 7


@pytest.mark.parametrize("path,body", APIS)
async def test_tool_call_cut_by_the_token_limit(sim, path, body):
    limit = {"max_tokens": 3} if path == "/v1/messages" else {"max_output_tokens": 3}
    c, _, _ = await stream(sim, path, {**body, **limit, "sim": {"tool_call": True, "tokens": 1}})
    evs = datas(await c.chunks())
    if path == "/v1/messages":
        assert evs[-2]["delta"]["stop_reason"] == "max_tokens"
        pieces = [e["delta"].get("partial_json") for e in evs if "delta" in e]
        assert pieces == [None, '{"', "city", None]  # the text token, two pieces, the delta
    else:
        assert evs[-1]["response"]["output"][1]["arguments"] == '{"city'
    assert sim.requests[-1].tokens_sent == 3


async def test_messages_stop_sequence_and_usage(sim):
    body = {**MSG, "system": "Be brief, please.", "stop_sequences": ["llama"]}
    c, _, _ = await stream(sim, "/v1/messages", body)
    evs = datas(await c.chunks())
    # "Hi there" + "Be brief, please.": 25 characters, a token per 4
    assert evs[0]["message"]["usage"] == {
        "cache_read_input_tokens": 0,
        "input_tokens": 6,
        "output_tokens": 0,
    }
    text = "".join(e["delta"]["text"] for e in evs if e["type"] == "content_block_delta")
    assert text == "Hello from a tiny"  # the stop word's token is not sent
    assert evs[-2] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": "llama"},
        "usage": {"output_tokens": 5},
    }
    c = await Client.connect(sim)
    await c.send(
        "POST", "/v1/messages/count_tokens", {"messages": HI, "system": "Be brief, please."}
    )
    _, h = await c.head()
    assert await c.body(h) == b'{"input_tokens":6}'


async def test_responses_limits_and_usage(sim):
    # n_predict, then max_output_tokens, then max_tokens (llama-server's order)
    c, _, _ = await stream(
        sim, "/v1/responses", {**RESP, "max_tokens": 2, "instructions": "Be brief"}
    )
    done = datas(await c.chunks())[-1]
    assert done["response"]["usage"] == {
        "input_tokens": 4,
        "output_tokens": 8,
        "total_tokens": 12,
        "input_tokens_details": {"cached_tokens": 0},
    }
    assert done["timings"]["predicted_n"] == 8 and done["response"]["status"] == "completed"
    c, _, _ = await stream(sim, "/v1/responses", {**RESP, "n_predict": 3})
    assert len(await c.chunks()) == 3 + 1
    c = await Client.connect(sim)
    await c.send(
        "POST", "/responses/input_tokens", {"input": [{"role": "user", "content": "abcdefgh"}]}
    )
    _, h = await c.head()
    assert await c.body(h) == b'{"input_tokens":2,"object":"response.input_tokens"}'


async def test_messages_ignore_n_predict(sim):
    # llama-server's /v1/messages reads max_tokens only
    c, _, _ = await stream(sim, "/v1/messages", {**MSG, "n_predict": 2, "sim": {"tokens": 5}})
    evs = datas(await c.chunks())
    assert evs[-2]["usage"] == {"output_tokens": 5}


@pytest.mark.parametrize("path,body", APIS)
async def test_stall_after(sim, path, body):
    c, status, _ = await stream(sim, path, {**body, "sim": {"stall_after": 3}})
    assert status == 200
    first = await c.chunk()
    assert first.startswith(FIRST[path])
    assert b'"Hello"' in first and b'" from"' in await c.chunk() and b'" a"' in await c.chunk()
    assert await c.silent()  # no more events, no final ones: a stalled stream
    req = sim.requests[-1]
    assert req.tokens_sent == 3 and not req.closed.is_set()
    c.close()
    await asyncio.wait_for(req.closed.wait(), T)
    assert req.peer_closed_at is not None and not req.finished


@pytest.mark.parametrize("path,body", APIS)
async def test_stall_mid_line(sim, path, body):
    c, _, _ = await stream(sim, path, {**body, "sim": {"stall_after": 2, "stall_mid_line": True}})
    await c.chunk(), await c.chunk()
    half = await c.chunk()  # a complete chunk holding half an event
    kind = path.rsplit("/", 1)[1]
    full = F.StreamFrames(kind, "models/tiny.gguf", 2).event(2)
    assert len(half) == len(full) // 2 and full.startswith(half[:20]) and b"\n\n" not in half
    assert await c.silent()
    c.close()


@pytest.mark.parametrize("path,body", APIS)
async def test_drop_after(sim, path, body):
    c, _, _ = await stream(sim, path, {**body, "sim": {"drop_after": 2, "tool_call": True}})
    assert b'"Hello"' not in await c.chunk()  # the call begins at once
    assert b"Paris" not in await c.chunk()
    assert await c.eof() == b""  # closed, no terminating chunk
    req = sim.requests[-1]
    await asyncio.wait_for(req.closed.wait(), T)
    assert req.tokens_sent == 2 and not req.finished


@pytest.mark.parametrize("path,body", APIS)
async def test_pacing_and_first_token_delay(sim, path, body):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    knobs = {"tokens": 6, "interval_ms": 20, "first_token_delay_ms": 60}
    c, _, _ = await stream(sim, path, {**body, "sim": knobs})
    opening = await c.chunk()  # the opening events go out with the head, alone
    assert opening.startswith(FIRST[path]) and b'"Hello"' not in opening
    stamps = []
    while await c.chunk() is not None:
        stamps.append(loop.time())
    # token i is due at 60 + 20 i ms (uvloop's timers may fire up to 1 ms early)
    assert len(stamps) == 6 + 1 and stamps[0] - t0 >= 0.058 and stamps[5] - t0 >= 0.158


@pytest.mark.parametrize("path,body", APIS)
async def test_head_delay_and_status_knob(sim, path, body):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    c, status, headers = await stream(
        sim, path, {**body, "sim": {"status": 429, "head_delay_ms": 50}}
    )
    assert status == 429 and loop.time() - t0 >= 0.045
    err = json.loads(await c.body(headers))
    assert err == {"error": {"code": 429, "message": "Too many requests, try again later",
                             "type": "unavailable_error"}}  # fmt: skip
    assert hval(headers, b"connection") == b"close" and await c.eof() == b""


@pytest.mark.parametrize("path,body", APIS)
async def test_content_length_stream(sim, path, body):
    knobs = {"content_length_stream": True, "tokens": 2, "tool_call": True}
    c, status, headers = await stream(sim, path, {**body, "sim": knobs})
    assert status == 200 and hval(headers, b"transfer-encoding") is None
    data = await c.body(headers)
    assert await c.eof() == b""
    evs = named_events(data)
    last = "message_stop" if path == "/v1/messages" else "response.completed"
    assert evs[0][0] in ("message_start", "response.created") and evs[-1][0] == last
    assert sim.requests[-1].tokens_sent == 2 + 5 and sim.requests[-1].finished


@pytest.mark.parametrize("path,body", APIS)
async def test_events_per_chunk(sim, path, body):
    c, _, _ = await stream(sim, path, {**body, "sim": {"tokens": 7, "events_per_chunk": 3}})
    chunks = await c.chunks()
    kinds = ("content_block_delta", "response.output_text.delta")
    deltas = [sum(e in kinds for e in x) for x in names(chunks)]
    assert deltas == [3, 3, 1, 0]


@pytest.mark.parametrize("path,body", APIS)
async def test_error_event_and_loading(sim, path, body):
    c, status, _ = await stream(sim, path, {**body, "sim": {"error_event": True}})
    assert status == 200 and await c.chunks() == [
        b'data: {"error":{"code":500,"message":"simulated","type":"server_error"}}\n\n'
    ]
    sim.loading = True
    c, status, headers = await stream(sim, path, body)
    assert status == 503 and b"Loading model" in await c.body(headers)


@pytest.mark.parametrize("path,body", APIS)
async def test_nonstream_tool_call_and_delay(sim, path, body):
    t0 = time.perf_counter()
    c = await Client.connect(sim)
    knobs = {"tool_call": True, "tokens": 2, "interval_ms": 10, "head_delay_ms": 30}
    await c.send("POST", path, {**body, "stream": False, "sim": knobs})
    status, h = await c.head()
    # The head delay and 6 gaps of 10 ms: 90 ms on the loop's clock, which the simulator
    # times them by and which counts whole milliseconds (uvloop's): up to 1 ms fewer of
    # perf_counter's. (The loop's own figures, subtracted, can read 0.0899999.)
    assert status == 200 and time.perf_counter() - t0 >= 0.09 - 0.001
    out = json.loads(await c.body(h))
    if path == "/v1/messages":
        assert [b["type"] for b in out["content"]] == ["text", "tool_use"]
        assert out["content"][1]["input"] == {"city": "Paris"} and out["stop_reason"] == "tool_use"
        assert out["usage"]["output_tokens"] == 7
    else:
        assert [o["type"] for o in out["output"]] == ["message", "function_call"]
        assert out["output"][1]["arguments"] == '{"city": "Paris"}'
        assert out["usage"]["output_tokens"] == 7
    assert sim.requests[-1].completion_tokens == 7


def test_frames_are_the_api_modules():
    f = F.StreamFrames("messages", "m", 3, text_n=0, tool=ToolCall("t", ["{}"]))
    assert isinstance(f.api, M.MessagesFrames)
    # No text: chunk 0 is the tool_use block's start and its one argument piece, framed as
    # messages_stream_tool_use.http has them (the id: 32 letters and digits, this call's own).
    tool_id = f.api.tool_id
    assert len(tool_id) == 32 and tool_id.isalnum()
    event = (
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"tool_use","id":"%s","name":"t"}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"input_json_delta","partial_json":"{}"}}\n\n' % tool_id.encode()
    )
    assert f.chunk(0) == b"%x\r\n%s\r\n" % (len(event), event)
    assert events(f.event(0))[0].startswith(b"event: content_block_start\n")
    g = F.StreamFrames("responses", "m", 3)
    assert isinstance(g.api, R.ResponsesFrames) and g.done_event == b""
    assert g.chunk(7) == g.chunk(13)  # the token cycle's chunks are cached

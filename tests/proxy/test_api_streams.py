"""Anthropic Messages and OpenAI Responses through the relay with their own SDKs (issue 22),
the upstream replaying the pinned llama-server's captured bytes (tests/support/captures/):
streamed as they come, usage exact in the row and the budget, a stall ended in each API's own
shape, in-band errors the SDKs raise, fallback on the APIs' own failure events."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from relay.config import UpstreamConfig
from tests.support import httpc
from tests.support.api_captures import body_of, replay_parts
from tests.support.fakeup import Scripted
from tests.support.helpers import rows_of, wait_for
from tests.support.keys import bearer, key
from tests.support.need import need_extra

anthropic = need_extra("test", "anthropic")
openai = need_extra("test", "openai")

MESSAGES_REQ = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
RESPONSES_REQ = {"model": "tiny", "input": "Hi there", "max_output_tokens": 4}


def replayer(name: str, pause: float = 0.0, stop_after: int | None = None, sent=None):
    """A script answering every request with the capture: `pause` s between chunks; after
    `stop_after` chunks it stalls (keeps the connection open, sends nothing)."""
    head, chunks = replay_parts(name)

    async def script(up, index, reader, writer):
        if await up.read_request(reader) is None:
            return
        writer.write(head)
        for n, c in enumerate(chunks):
            if stop_after is not None and n == stop_after:
                await reader.read()  # until the relay gives up on it
                return
            if n and pause:
                await asyncio.sleep(pause)
            writer.write(c)
            await writer.drain()
            if sent is not None:
                sent.append((time.perf_counter(), c))

    return script


async def upstream(script) -> Scripted:
    return await Scripted(script).start()


def text_of(name: str) -> str:
    out = []
    for ev in body_of(name).split(b"\n\n"):
        for line in ev.split(b"\n"):
            if line.startswith(b"data: "):
                doc = json.loads(line[6:])
                delta = doc.get("delta")
                if doc.get("type") == "content_block_delta" and delta.get("type") == "text_delta":
                    out.append(delta["text"])
                elif doc.get("type") == "response.output_text.delta":
                    out.append(delta)
    return "".join(out)


def aclient(port: int):
    return anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key="k", max_retries=0)


def oclient(port: int):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)


async def test_anthropic_stream_as_direct_and_the_row_exact(make_relay):
    up = await upstream(replayer("messages_stream.http"))
    app = await make_relay(up.url)
    async with aclient(app.port).messages.stream(**MESSAGES_REQ) as stream:
        final = await stream.get_final_message()
    assert final.content[0].text == text_of("messages_stream.http")
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    [row] = await rows_of(app, 1)
    assert (row["tokens_source"], row["prompt_tokens"], row["completion_tokens"]) == (
        "exact",
        15,
        8,
    )
    assert row["ok"] == 1 and row["ttft_ms"] is not None


async def test_responses_stream_as_direct_and_the_row_exact(make_relay):
    up = await upstream(replayer("responses_stream.http"))
    app = await make_relay(up.url)
    seen = []
    stream = await oclient(app.port).responses.create(stream=True, **RESPONSES_REQ)
    async for event in stream:
        seen.append(event.type)
    assert seen[0] == "response.created" and seen[-1] == "response.completed"
    assert seen.count("response.output_text.delta") == 4
    [row] = await rows_of(app, 1)
    assert (row["tokens_source"], row["prompt_tokens"], row["completion_tokens"]) == (
        "exact",
        15,
        4,
    )


@pytest.mark.parametrize("name", ["messages_stream.http", "responses_stream.http"])
async def test_the_first_delta_is_relayed_as_it_comes(make_relay, name):
    # each chunk leaves the upstream 0.3 s after the last: the first delta must not wait
    sent: list = []
    up = await upstream(replayer(name, pause=0.3, sent=sent))
    app = await make_relay(up.url)
    body = MESSAGES_REQ if name.startswith("messages") else RESPONSES_REQ
    path = "/v1/messages" if name.startswith("messages") else "/v1/responses"
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("POST", path, {**body, "stream": True}))
    await httpc.read_head(reader)
    marker = b'"text_delta"' if name.startswith("messages") else b"output_text.delta"
    got = b""
    while marker not in got:
        got += await asyncio.wait_for(reader.read(65536), 5)
    arrived = time.perf_counter()
    writer.close()
    first = next(t for t, c in sent if marker in c)
    assert arrived - first < 0.1  # (the rest of the stream is 2+ s away)
    await wait_for(lambda: len(sent) >= 2)
    [row] = await rows_of(app, 1)
    assert row["ttft_ms"] is not None and row["ttft_ms"] < 250


async def test_anthropic_stall_ends_the_message_with_the_notice(make_relay):
    up = await upstream(replayer("messages_stream.http", stop_after=3))
    app = await make_relay(up.url, stream_idle_timeout_s=0.3, stream_total_timeout_s=0)
    async with aclient(app.port).messages.stream(**MESSAGES_REQ) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    text = final.content[0].text
    assert text.startswith("Hello from") and "[relay] stall guard: idle after" in text
    [row] = await rows_of(app, 1)
    assert (row["ok"], row["error_code"]) == (0, "stream_stall_idle")


async def test_anthropic_stall_in_a_tool_block_leaves_its_input_alone(make_relay):
    name = "messages_stream_tool_use.http"
    _, chunks = replay_parts(name)
    stop = next(i for i, c in enumerate(chunks) if b"input_json_delta" in c) + 1
    up = await upstream(replayer(name, stop_after=stop))
    app = await make_relay(up.url, stream_idle_timeout_s=0.3, stream_total_timeout_s=0)
    raw = await httpc.fetch(app.port, "POST", "/v1/messages", {**MESSAGES_REQ, "stream": True})
    assert raw.status == 200 and b"[DONE]" not in raw.body
    tail = raw.body[raw.body.rindex(b"event: content_block_stop") :]
    assert b"stall guard" not in tail.split(b"event: message_delta")[0]  # none in the tool
    assert b'"stop_reason":"max_tokens"' in tail and tail.endswith(
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )


async def test_responses_stall_ends_on_response_incomplete(make_relay):
    up = await upstream(replayer("responses_stream.http", stop_after=2))
    app = await make_relay(up.url, stream_idle_timeout_s=0.3, stream_total_timeout_s=0)
    events = []
    stream = await oclient(app.port).responses.create(stream=True, **RESPONSES_REQ)
    async for event in stream:  # ends without an exception
        events.append(event)
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.id == events[0].response.id
    assert last.response.incomplete_details.reason == "max_output_tokens"
    [row] = await rows_of(app, 1)
    assert (row["ok"], row["error_code"]) == (0, "stream_stall_idle")


ANTHROPIC_529 = (
    b"HTTP/1.1 529 Overloaded\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
)


async def test_an_upstream_failure_after_a_heartbeat_is_the_sdks_own_error(make_relay):
    err = b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}'

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        await asyncio.sleep(0.4)  # long prompt processing: the relay beats meanwhile
        writer.write(ANTHROPIC_529 % len(err) + err)
        await writer.drain()

    up = await upstream(script)
    app = await make_relay(up.url, heartbeat_s=0.1)
    with pytest.raises(anthropic.APIStatusError) as exc:
        async with aclient(app.port).messages.stream(**MESSAGES_REQ) as stream:
            await stream.get_final_message()
    assert "Overloaded" in str(exc.value)
    stream = await oclient(app.port).responses.create(stream=True, **RESPONSES_REQ)
    kinds = []
    try:
        async for event in stream:
            kinds.append((event.type, getattr(event, "message", None)))
    except openai.APIError as e:  # (raising is as good as a typed error event)
        kinds.append(("raised", str(e)))
    assert len(kinds) == 1 and "Overloaded" in str(kinds[0][1])


@pytest.mark.parametrize(
    "failure,served",
    [
        (
            b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n',
            "messages_stream.http",
        ),
        (
            b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_x","object":"response","status":"in_progress"}}\n\n'
            b'event: response.failed\ndata: {"type":"response.failed","response":{"id":"resp_x","object":"response","status":"failed","error":{"code":"server_error","message":"Overloaded"}}}\n\n',
            "responses_stream.http",
        ),
    ],
)
async def test_a_failure_event_before_content_falls_back(make_relay, failure, served):
    async def failing(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(failure), failure)
        )
        await writer.drain()

    bad = await upstream(failing)
    good = await upstream(replayer(served))
    ups = [
        UpstreamConfig(name="a", url=bad.url, models=["tiny"], fallback=["b"]),
        UpstreamConfig(name="b", url=good.url, models=["tiny-b"]),
    ]
    app = await make_relay(upstreams=ups)
    path = "/v1/messages" if served.startswith("messages") else "/v1/responses"
    body = MESSAGES_REQ if served.startswith("messages") else RESPONSES_REQ
    resp = await httpc.fetch(app.port, "POST", path, {**body, "stream": True})
    assert resp.status == 200 and b"Overloaded" not in resp.body
    assert resp.body == body_of(served)  # the next candidate's stream, byte for byte
    [row] = await rows_of(app, 1)
    assert (row["upstream_served"], row["fallback_attempts"], row["ok"]) == ("b", 1, 1)


async def test_a_token_budget_is_charged_the_servers_figures(make_relay):
    # a request reserves ~34 tokens and uses 15 + 8 = 23 (the server's count): with 60 a
    # day, two are admitted (23 + 34 <= 60) and the third refused (46 + 34 > 60); charged
    # as counted (34 each) the second would have been refused
    up = await upstream(replayer("messages_stream.http"))
    app = await make_relay(up.url, keys=[key(tokens_per_day=60)])
    statuses = []
    for _ in range(3):
        resp = await httpc.fetch(
            app.port, "POST", "/v1/messages", {**MESSAGES_REQ, "stream": True}, bearer()
        )
        statuses.append(resp.status)
    assert statuses == [200, 200, 429]
    rows = await rows_of(app, 3)
    assert [(r["prompt_tokens"], r["completion_tokens"], r["tokens_source"]) for r in rows[:2]] == [
        (15, 8, "exact")
    ] * 2


# ---- the simulator's own streams (relay/sim: the pinned llama-server's shapes) -------------
SIM_TOOLS = [
    {
        "name": "get_weather",
        "description": "weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


async def test_anthropic_sdk_on_a_stalling_simulator(make_relay):
    app = await make_relay(stream_idle_timeout_s=0.3, stream_total_timeout_s=0)
    client = aclient(app.port)
    sim = {"sim": {"tokens": 20, "interval_ms": 5, "stall_after": 4}}
    async with client.messages.stream(**MESSAGES_REQ, extra_body=sim) as stream:
        final = await stream.get_final_message()
    assert (
        final.stop_reason == "max_tokens" and "[relay] stall guard: idle" in final.content[0].text
    )
    # a tool call cut in its input: the input is left as far as it came, no text in it
    tool = {"sim": {"tool_call": {"pieces": 6}, "interval_ms": 5, "stall_after": 4}}
    req = {**MESSAGES_REQ, "max_tokens": 64, "tools": SIM_TOOLS}
    async with client.messages.stream(**req, extra_body=tool) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [b.type for b in final.content] == ["tool_use"]
    rows = await rows_of(app, 2)
    assert [(r["ok"], r["error_code"]) for r in rows] == [(0, "stream_stall_idle")] * 2


async def test_openai_responses_on_a_stalling_simulator(make_relay):
    app = await make_relay(stream_idle_timeout_s=0.3, stream_total_timeout_s=0)
    sim = {"sim": {"tokens": 20, "interval_ms": 5, "stall_after": 4}}
    stream = await oclient(app.port).responses.create(stream=True, **RESPONSES_REQ, extra_body=sim)
    kinds = [event.type async for event in stream]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "response.completed" not in kinds
    raw = await httpc.fetch(
        app.port, "POST", "/v1/responses", {**RESPONSES_REQ, "stream": True, **sim}
    )
    assert b"[DONE]" not in raw.body and raw.body.endswith(b"\n\n") and raw.complete


@pytest.mark.parametrize("knob", ["stall_mid_line", "stall_mid_chunk"])
async def test_a_stall_in_the_middle_of_an_event_still_ends_cleanly(make_relay, knob):
    # the half event is finished so that it parses: no SDK fails on half a JSON line
    app = await make_relay(stream_idle_timeout_s=0.3, stream_total_timeout_s=0)
    sim = {"sim": {"tokens": 20, "interval_ms": 5, "stall_after": 3, knob: True}}
    async with aclient(app.port).messages.stream(**MESSAGES_REQ, extra_body=sim) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "max_tokens" and "[relay] stall guard" in final.content[0].text
    chat = await oclient(app.port).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True, extra_body=sim
    )
    pieces = [c.choices[0].delta.content async for c in chat if c.choices]
    assert "[relay] stall guard" in pieces[-1]
    stream = await oclient(app.port).responses.create(stream=True, **RESPONSES_REQ, extra_body=sim)
    kinds = [event.type async for event in stream]
    assert kinds[-1] == "response.incomplete"


@pytest.mark.parametrize(
    "name,end",
    [
        ("responses_stream.http", b"event: response.completed"),
        ("messages_stream.http", b"event: message_stop"),
    ],
)
async def test_a_client_that_leaves_after_the_streams_own_end_had_it_whole(make_relay, name, end):
    # Codex stops reading at response.completed; the upstream's last chunk comes later
    head, chunks = replay_parts(name)
    gate = asyncio.Event()

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(head + b"".join(chunks[:-1]))  # all but the terminating chunk
        await writer.drain()
        await gate.wait()

    up = await upstream(script)
    app = await make_relay(up.url)
    path = "/v1/messages" if name.startswith("messages") else "/v1/responses"
    body = MESSAGES_REQ if name.startswith("messages") else RESPONSES_REQ
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("POST", path, {**body, "stream": True}))
    got = b""
    while end not in got or not got.endswith(b"\n\n\r\n"):
        got += await asyncio.wait_for(reader.read(65536), 5)
    writer.close()  # as the SDK does, before the upstream's own last chunk
    [row] = await rows_of(app, 1)
    gate.set()
    assert (row["ok"], row["error_code"], row["client_closed"]) == (1, None, 0)
    assert row["tokens_source"] == "exact"
    # leaving before the end is still a client that left
    up2 = await upstream(replayer(name, stop_after=3))
    app2 = await make_relay(up2.url)
    reader, writer = await asyncio.open_connection("127.0.0.1", app2.port)
    writer.write(httpc.build_request("POST", path, {**body, "stream": True}))
    await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    [row] = await rows_of(app2, 1)
    assert (row["ok"], row["error_code"], row["client_closed"]) == (0, "client_closed", 1)

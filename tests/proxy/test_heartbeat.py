"""Heartbeats before the first content event (issue 11), over real sockets, exact bytes.

A streamed request whose upstream is slow to answer (a long prompt, a model loading) gets a
`200 text/event-stream` head and `: relay heartbeat` comments every `heartbeat_s`; the
upstream's own comment lines (llama-server's pings) pass as soon as the head is out; a
fallback may still serve while only comments reached the client, and a failure is told
in-band. The scripted upstreams wait for the client to have seen what the test wants
before they go on: no sleeping and hoping.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from relay.config import UpstreamConfig
from relay.sim import frames as F
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import closed_port, rows_of, wait_for
from tests.support.need import need_extra

CHAT = "/v1/chat/completions"
HB = b": relay heartbeat\n\n"
HB_CHUNK = F.chunk(HB)
RID = "hb-1"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
)
# What the client gets as head, from the relay (before the upstream's) or from this upstream.
CLIENT_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n"
    b"X-Request-Id: " + RID.encode() + b"\r\n\r\n"
)
ROLE = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}],"model":"m"}\n\n'
)
TOKENS = [
    b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}],"model":"m"}\n\n' % t
    for t in (b"Hello", b" there", b" friend")
]
FINISH = (
    b'data: {"choices":[{"index":0,"finish_reason":"stop","delta":{}}],"model":"m",'
    b'"usage":{"completion_tokens":3,"prompt_tokens":7,"total_tokens":10}}\n\n'
)
DONE = b"data: [DONE]\n\n"
REST = b"".join(F.chunk(e) for e in TOKENS[1:] + [FINISH, DONE]) + b"0\r\n\r\n"
PING = b": ping\n\n"
TIMING = b"Server-Timing: relay;"


def body(**kw) -> dict:
    return {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}], **kw}


class Client:
    """A raw client connection reading exactly the bytes it is told to expect."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer
        self.got = b""

    @classmethod
    async def post(cls, port: int, payload: dict, http: str = "1.1") -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(httpc.build_request("POST", CHAT, payload, {"X-Request-Id": RID}, http))
        return cls(reader, writer)

    async def expect(self, data: bytes, timeout: float = 5.0) -> None:
        if data.startswith(b"HTTP/") and b"\r\n\r\n" in data:
            # A head relayed from the upstream's carries the relay's Server-Timing line, its
            # durations this run's (tests/proxy/test_server_timing.py): left out here.
            want, _, data = data.partition(b"\r\n\r\n")
            head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
            self.got += head
            lines = head[:-4].split(b"\r\n")
            assert b"\r\n".join(x for x in lines if not x.startswith(TIMING)) == want
        got = await asyncio.wait_for(self.reader.readexactly(len(data)), timeout)
        self.got += got
        assert got == data

    async def until(self, end: bytes, timeout: float = 5.0) -> bytes:
        data = await asyncio.wait_for(self.reader.readuntil(end), timeout)
        self.got += data
        return data

    async def rest(self, timeout: float = 5.0) -> bytes:
        data = await asyncio.wait_for(self.reader.read(), timeout)
        self.got += data
        return data

    def close(self) -> None:
        self.writer.close()


class Gate:
    """An upstream script's steps, each released by the test."""

    def __init__(self) -> None:
        self.steps: list[asyncio.Event] = [asyncio.Event() for _ in range(8)]

    async def at(self, i: int) -> None:
        await asyncio.wait_for(self.steps[i].wait(), 10)

    def open(self, i: int) -> None:
        self.steps[i].set()


def json_after_gate(gate: Gate, status: bytes, doc: bytes):
    """An upstream script: read the request, wait for step 0, answer `status` with JSON `doc`."""

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        await gate.at(0)
        writer.write(
            b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (status, len(doc), doc)
        )
        await writer.drain()

    return script


@pytest.fixture
async def upstreams():
    made = []

    async def make(script) -> Scripted:
        up = await Scripted(script).start()
        made.append(up)
        return up

    yield make
    for up in made:
        await up.stop()


# ---- the head is held upstream -----------------------------------------------------------------
async def test_heartbeats_while_the_upstream_holds_its_head(make_relay, upstreams):
    gate = Gate()

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        await gate.at(0)
        writer.write(SSE_HEAD + F.chunk(ROLE) + F.chunk(TOKENS[0]))
        await writer.drain()
        await gate.at(1)
        writer.write(REST)
        await writer.drain()

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0.1)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    c = await Client.post(app.port, body())
    await c.expect(CLIENT_HEAD + HB_CHUNK)
    first = loop.time() - t0
    await c.expect(HB_CHUNK)
    second = loop.time() - t0
    assert first >= 0.09 and second >= 0.18  # one heartbeat_s apart, not sooner
    gate.open(0)
    # the upstream's head is not sent again; its events follow in the relay's chunks until
    # both sides stand between chunks, then its own chunks pass as they are
    await c.expect(F.chunk(ROLE + TOKENS[0]))
    gate.open(1)
    await c.expect(REST)
    c.close()
    [row] = await rows_of(app, 1)
    assert (
        row["status"],
        row["ok"],
        row["error_code"],
        row["completion_tokens"],
        row["tokens_source"],
    ) == (200, 1, None, 3, "exact")
    assert row["ttft_ms"] >= 180  # the heartbeats are no first token


async def test_no_heartbeat_when_content_comes_in_time(make_relay, upstreams):
    async def script(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD + F.chunk(ROLE) + F.chunk(TOKENS[0]) + REST)
        await writer.drain()

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=5)
    c = await Client.post(app.port, body())
    # head, role and first token in one piece, the upstream's own chunks throughout
    await c.expect(CLIENT_HEAD + F.chunk(ROLE) + F.chunk(TOKENS[0]) + REST)
    c.close()


async def test_heartbeat_off_holds_pings_as_before(make_relay, upstreams):
    gate = Gate()

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD + F.chunk(PING))
        await writer.drain()
        await gate.at(0)
        writer.write(F.chunk(ROLE) + F.chunk(TOKENS[0]) + REST)
        await writer.drain()

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0)
    c = await Client.post(app.port, body())
    await wait_for(lambda: hold_of(app) is not None and hold_of(app).hold.parts)  # the ping is in
    reply = hold_of(app)
    assert (reply.hold.sent, reply.deadline, reply.hold.parts) == (False, None, [F.chunk(PING)])
    gate.open(0)
    await c.expect(CLIENT_HEAD + F.chunk(PING) + F.chunk(ROLE) + F.chunk(TOKENS[0]) + REST)
    c.close()


# ---- the upstream pings ------------------------------------------------------------------------
async def test_upstream_pings_pass_once_the_head_is_committed(make_relay, upstreams):
    gate = Gate()

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD + F.chunk(PING))
        await writer.drain()
        await gate.at(0)
        writer.write(F.chunk(PING))
        await writer.drain()
        await gate.at(1)
        writer.write(F.chunk(ROLE))  # held: not a comment
        await writer.drain()
        await gate.at(2)
        writer.write(F.chunk(PING))  # held behind the role event
        await writer.drain()
        await gate.at(3)
        writer.write(F.chunk(TOKENS[0]))
        await writer.drain()
        await gate.at(4)
        writer.write(REST)
        await writer.drain()

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0.1, stream_idle_timeout_s=5)
    c = await Client.post(app.port, body())
    # the first heartbeat commits the upstream's own head; the held ping goes with it
    await c.expect(CLIENT_HEAD + F.chunk(PING) + HB_CHUNK)
    gate.open(0)
    await c.expect(F.chunk(PING))  # at once, not at the next heartbeat
    gate.open(1)
    await c.expect(HB_CHUNK)  # the role event is held; the relay keeps the client company
    gate.open(2)
    gate.open(3)
    await c.expect(F.chunk(ROLE + PING + TOKENS[0]))
    gate.open(4)
    await c.expect(REST)
    c.close()
    [row] = await rows_of(app, 1)
    assert (row["ok"], row["completion_tokens"]) == (1, 3)


async def test_pings_are_upstream_activity_for_the_idle_bound(make_relay, upstreams):
    async def script(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD)
        for _ in range(8):  # 0.4 s of pings, every 0.05 s, against an idle bound of 0.25 s
            writer.write(F.chunk(PING))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(F.chunk(ROLE) + F.chunk(TOKENS[0]) + REST)
        await writer.drain()

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0.02, stream_idle_timeout_s=0.25)
    resp = await httpc.fetch(app.port, "POST", CHAT, body(), headers={"X-Request-Id": RID})
    assert resp.complete
    assert resp.body.replace(HB, b"") == PING * 8 + ROLE + b"".join(TOKENS) + FINISH + DONE
    [row] = await rows_of(app, 1)
    assert (row["ok"], row["error_code"], row["completion_tokens"]) == (1, None, 3)


async def test_total_bound_still_ends_an_endless_ping(make_relay, upstreams):
    async def script(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD)
        while True:
            writer.write(F.chunk(PING))
            await writer.drain()
            await asyncio.sleep(0.03)

    up = await upstreams(script)
    app = await make_relay(
        up.url, heartbeat_s=0.02, stream_idle_timeout_s=0.2, stream_total_timeout_s=0.4
    )
    resp = await httpc.fetch(app.port, "POST", CHAT, body(), headers={"X-Request-Id": RID})
    assert resp.complete
    events = resp.data_events()
    assert events[-1] == "[DONE]" and events[0]["x_relay_stall"]["reason"] == "total"
    [row] = await rows_of(app, 1)
    assert (row["ok"], row["error_code"]) == (0, "stream_stall_total")


# ---- fallback after heartbeats -----------------------------------------------------------------
async def test_fallback_after_heartbeats_continues_the_same_response(make_relay, upstreams):
    gate = Gate()

    async def primary(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD + F.chunk(PING) + F.chunk(ROLE))
        await writer.drain()
        await gate.at(0)
        writer.transport.abort()  # gone before any content

    async def fallback(up, index, reader, writer):
        await up.read_request(reader)
        # another framing on purpose: close-delimited, the relay frames it for the client
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Connection: close\r\n\r\n" + PING + ROLE + TOKENS[0]
        )
        await writer.drain()
        writer.write(b"".join(TOKENS[1:]) + FINISH + DONE)
        await writer.drain()

    a, b = await upstreams(primary), await upstreams(fallback)
    app = await make_relay(
        upstreams=[
            UpstreamConfig(name="a", url=a.url, fallback=["b"]),
            UpstreamConfig(name="b", url=b.url),
        ],
        heartbeat_s=0.1,
    )
    c = await Client.post(app.port, body())
    await c.expect(CLIENT_HEAD + F.chunk(PING) + HB_CHUNK)
    gate.open(0)
    rest = await c.until(b"\r\n0\r\n\r\n")
    # one response: the primary's role event never reached the client; the fallback's events
    # continue it, in chunks of the relay's own, and end cleanly
    payload = b"".join(httpc_chunks(rest))
    assert rest.endswith(b"0\r\n\r\n")
    assert payload.replace(HB, b"") == PING + ROLE + b"".join(TOKENS) + FINISH + DONE
    assert CLIENT_HEAD not in rest  # no second head
    rows = await rows_of(app, 1)
    assert [
        (r["upstream_served"], r["fallback_attempts"], r["ok"], r["completion_tokens"])
        for r in rows
    ] == [("b", 1, 1, 3)]
    [fb] = app.log.of("fallback")
    assert (fb["upstream"], fb["next"]) == ("a", "b")


def httpc_chunks(raw: bytes) -> list[bytes]:
    """Payloads of a chunked body (strict)."""
    out, pos = [], 0
    while True:
        nl = raw.index(b"\r\n", pos)
        size = int(raw[pos:nl], 16)
        if size == 0:
            assert raw[nl + 2 :] == b"\r\n"
            return out
        out.append(raw[nl + 2 : nl + 2 + size])
        assert raw[nl + 2 + size : nl + 4 + size] == b"\r\n"
        pos = nl + 4 + size


async def test_fallback_after_heartbeats_before_any_head(make_relay, upstreams):
    gate = Gate()
    primary = json_after_gate(gate, b"503 Service Unavailable", b"{}")

    async def fallback(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD + F.chunk(ROLE) + F.chunk(TOKENS[0]))
        await writer.drain()
        await gate.at(1)
        writer.write(REST)
        await writer.drain()

    a, b = await upstreams(primary), await upstreams(fallback)
    app = await make_relay(
        upstreams=[
            UpstreamConfig(name="a", url=a.url, fallback=["b"]),
            UpstreamConfig(name="b", url=b.url),
        ],
        heartbeat_s=0.1,
    )
    c = await Client.post(app.port, body())
    await c.expect(CLIENT_HEAD + HB_CHUNK)
    gate.open(0)
    # the fallback's own head is not sent; its events continue the response
    await c.expect(F.chunk(ROLE + TOKENS[0]))
    gate.open(1)
    await c.expect(REST)
    c.close()
    [row] = await rows_of(app, 1)
    assert (row["upstream_served"], row["fallback_attempts"], row["status"], row["ok"]) == (
        "b",
        1,
        200,
        1,
    )


# ---- failures told in-band ---------------------------------------------------------------------
def inband(message: str, type_: str, code: str) -> bytes:
    doc = {"error": {"message": message, "type": type_, "code": code}}
    return (
        F.chunk(b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n" + DONE)
        + b"0\r\n\r\n"
    )


async def test_every_candidate_failed_after_heartbeats_is_told_in_band(make_relay, upstreams):
    gate = Gate()

    async def gone(up, index, reader, writer):
        await up.read_request(reader)
        await gate.at(0)
        writer.transport.abort()

    a = await upstreams(gone)
    app = await make_relay(
        upstreams=[
            UpstreamConfig(name="a", url=a.url, fallback=["b"]),
            UpstreamConfig(name="b", url=f"http://127.0.0.1:{closed_port()}"),
        ],
        heartbeat_s=0.1,
    )
    c = await Client.post(app.port, body())
    await c.expect(CLIENT_HEAD + HB_CHUNK)
    gate.open(0)
    told = inband(
        "upstream b is unavailable: connect failed: Connection refused",
        "upstream_error",
        "upstream_unavailable",
    )
    await c.expect(told)
    # a clean end: the connection stays usable
    c.writer.write(httpc.build_request("GET", "/v1/models", None))
    await c.expect(b"HTTP/1.1 ")
    c.close()
    row = (await rows_of(app, 2))[0]
    assert (row["status"], row["ok"], row["error_code"], row["upstream_served"]) == (
        502,
        0,
        "upstream_unavailable",
        None,
    )
    # No upstream served, yet the client got a body: the heartbeat and the error, as chunks.
    assert row["bytes_out"] == len(HB_CHUNK + told)


async def test_upstream_error_status_after_heartbeats_is_told_in_band(make_relay, upstreams):
    gate = Gate()
    err = b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}'
    script = json_after_gate(gate, b"401 Unauthorized", err)

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0.1)
    c = await Client.post(app.port, body())
    await c.expect(CLIENT_HEAD + HB_CHUNK)
    gate.open(0)
    await c.expect(inband("Invalid API Key", "authentication_error", "upstream_401"))
    c.close()
    [row] = await rows_of(app, 1)
    assert (row["status"], row["ok"], row["error_code"], row["upstream_served"]) == (
        401,
        0,
        "upstream_401",
        "llm",
    )


async def test_error_event_after_heartbeats_is_told_in_band(make_relay, upstreams):
    gate = Gate()
    error = b'data: {"error":{"code":500,"message":"context overflow","type":"server_error"}}\n\n'

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD + F.chunk(PING))
        await writer.drain()
        await gate.at(0)
        writer.write(F.chunk(error) + b"0\r\n\r\n")
        await writer.drain()

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0.1)
    c = await Client.post(app.port, body())
    await c.expect(CLIENT_HEAD + F.chunk(PING) + HB_CHUNK)
    gate.open(0)
    await c.expect(inband("context overflow", "server_error", "upstream_error"))
    c.close()
    [row] = await rows_of(app, 1)
    assert (row["status"], row["ok"], row["error_code"]) == (200, 0, "upstream_error_event")


async def test_openai_client_raises_the_in_band_error(make_relay, upstreams):
    openai = need_extra("test", "openai")
    err = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        await wait_for(lambda: beats(app) >= 2)  # the client has its head and heartbeats
        writer.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(err), err)
        )
        await writer.drain()

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0.05)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{app.port}/v1", api_key="sk-x", max_retries=0, timeout=10
    )
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    with pytest.raises(openai.APIError) as info:
        async for _ in stream:
            pass
    await client.close()
    assert info.value.message == "Loading model"
    assert info.value.body == {
        "message": "Loading model",
        "type": "unavailable_error",
        "code": "upstream_503",
    }
    [row] = await rows_of(app, 1)
    assert (row["status"], row["error_code"]) == (503, "upstream_503")


def hold_of(app):
    """The reply holding the one request in flight (None before its exchange exists, and once
    the hold opened)."""
    for c in app.clients:
        if c.exchange is not None:
            return c.exchange.reply
    return None


def beats(app) -> int:
    return max(
        (
            c.exchange.reply.beats
            for c in app.clients
            if c.exchange is not None and c.exchange.reply is not None
        ),
        default=0,
    )


async def test_http10_client_gets_a_close_delimited_heartbeat_stream(make_relay, upstreams):
    gate = Gate()

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        await gate.at(0)
        writer.write(SSE_HEAD + F.chunk(ROLE) + F.chunk(TOKENS[0]) + REST)
        await writer.drain()

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0.1)
    c = await Client.post(app.port, body(), http="1.0")
    await c.expect(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Cache-Control: no-cache\r\nX-Request-Id: hb-1\r\nConnection: close\r\n\r\n" + HB
    )
    gate.open(0)
    assert await c.rest() == ROLE + b"".join(TOKENS) + FINISH + DONE
    c.close()


async def test_unstreamed_request_gets_no_heartbeat(make_relay, upstreams):
    gate = Gate()
    doc = b'{"choices":[{"message":{"content":"hi"}}]}'
    script = json_after_gate(gate, b"200 OK", doc)

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0.05)
    task = asyncio.ensure_future(httpc.fetch(app.port, "POST", CHAT, body(stream=False)))
    await wait_for(lambda: up.heads)
    hold = hold_of(app)
    assert (hold.interval, hold.deadline) == (0, None)  # no heartbeat is armed
    gate.open(0)
    resp = await task
    assert (resp.status, resp.body) == (200, doc)


async def test_json_answer_after_heartbeats_is_told_in_band(make_relay, upstreams):
    gate = Gate()
    doc = b'{"choices":[{"message":{"content":"hi"}}]}'
    script = json_after_gate(gate, b"200 OK", doc)

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0.1)
    c = await Client.post(app.port, body())
    await c.expect(CLIENT_HEAD + HB_CHUNK)
    gate.open(0)
    # an event stream was promised: a whole JSON body cannot continue it
    await c.expect(
        inband(
            "upstream llm answered 200 without an event stream",
            "upstream_error",
            "upstream_bad_response",
        )
    )
    c.close()
    [row] = await rows_of(app, 1)
    assert (row["status"], row["ok"], row["error_code"]) == (200, 0, "upstream_bad_response")


async def test_no_head_in_time_after_heartbeats_is_told_in_band(make_relay, upstreams):
    async def silent(up, index, reader, writer):
        await up.read_request(reader)
        await reader.read()  # never answers; ends when the relay gives up

    up = await upstreams(silent)
    app = await make_relay(up.url, heartbeat_s=0.05, direct_read_timeout_s=0.3)
    c = await Client.post(app.port, body())
    await c.expect(CLIENT_HEAD + HB_CHUNK)
    tail = await c.until(b"\r\n0\r\n\r\n")
    events = tail.replace(HB_CHUNK, b"")
    assert events == inband(
        "upstream llm sent no response head within 0.3s", "timeout_error", "upstream_timeout"
    )
    c.close()
    [row] = await rows_of(app, 1)
    assert (row["status"], row["ok"], row["error_code"]) == (504, 0, "upstream_timeout")


async def test_openai_client_streams_through_heartbeats(make_relay, upstreams):
    openai = need_extra("test", "openai")

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        await wait_for(lambda: beats(app) >= 2)  # the client has its head and heartbeats
        writer.write(SSE_HEAD + F.chunk(PING) + F.chunk(ROLE) + F.chunk(TOKENS[0]) + REST)
        await writer.drain()

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0.05)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{app.port}/v1", api_key="sk-x", max_retries=0, timeout=10
    )
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    await client.close()
    assert "".join(text) == "Hello there friend"


async def test_drain_after_heartbeats_is_told_in_band(make_relay, upstreams):
    async def silent(up, index, reader, writer):
        await up.read_request(reader)
        await reader.read()  # never answers

    up = await upstreams(silent)
    app = await make_relay(up.url, heartbeat_s=0.05)
    c = await Client.post(app.port, body())
    await c.expect(CLIENT_HEAD + HB_CHUNK)
    stop = asyncio.ensure_future(app.stop(drain_timeout_s=0.1))
    tail = await c.until(b"\r\n0\r\n\r\n")
    assert tail.replace(HB_CHUNK, b"") == inband(
        "the relay is shutting down", "server_error", "shutting_down"
    )
    await stop
    c.close()
    [line] = app.log.of("access")
    assert (line["status"], line["error_code"]) == (503, "shutdown")

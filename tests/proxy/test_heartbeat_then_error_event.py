"""After heartbeats committed a 200 head, an upstream answers a non-2xx event stream whose
first event is an error: the error event ends its exchange, so the next candidate serves,
or the error is told in-band as the upstream's own (`upstream_error`)."""

from __future__ import annotations

from relay.config import UpstreamConfig
from relay.sim import frames as F
from tests.proxy.test_heartbeat import (  # noqa: F401
    CLIENT_HEAD,
    FINISH,
    HB_CHUNK,
    REST,
    ROLE,
    SSE_HEAD,
    TOKENS,
    Client,
    Gate,
    body,
    upstreams,
)
from tests.support.helpers import rows_of

ERR = b'data: {"error":{"message":"bad things","type":"invalid_request_error"}}\n\n'
SSE_400 = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/event-stream\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


async def test_error_event_of_a_400_stream_after_heartbeats(make_relay, upstreams):  # noqa: F811
    gate = Gate()

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        await gate.at(0)
        writer.write(SSE_400 + F.chunk(ERR) + b"0\r\n\r\n")
        await writer.drain()

    up = await upstreams(script)
    app = await make_relay(up.url, heartbeat_s=0.1)
    c = await Client.post(app.port, body())
    await c.expect(CLIENT_HEAD + HB_CHUNK)
    gate.open(0)
    tail = await c.until(b"\r\n0\r\n\r\n")
    c.close()
    [row] = await rows_of(app, 1)
    print(tail)
    assert b'"code":"upstream_error"' in tail
    assert (row["status"], row["error_code"]) == (400, "upstream_error_event")


async def test_error_event_of_a_400_stream_after_heartbeats_falls_back(make_relay, upstreams):  # noqa: F811
    gate = Gate()

    async def primary(up, index, reader, writer):
        await up.read_request(reader)
        await gate.at(0)
        writer.write(SSE_400 + F.chunk(ERR))
        await writer.drain()
        await gate.at(7)

    async def fallback(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD + F.chunk(ROLE) + F.chunk(TOKENS[0]) + REST)
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
    tail = await c.until(b"\r\n0\r\n\r\n", timeout=3)
    c.close()
    gate.open(7)
    [row] = await rows_of(app, 1)
    assert b"Hello" in tail, tail
    assert (row["upstream_served"], row["ok"]) == ("b", 1)

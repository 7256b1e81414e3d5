"""What a failed first candidate leaves in a request's figures when the next one fails too,
or the client leaves while it is tried: the row and the access line say how the request
itself ended, and a stall is counted on the upstream that stalled."""

from __future__ import annotations

import asyncio

from relay.config import UpstreamConfig
from relay.sim import frames as F
from tests.proxy.test_heartbeat import ROLE, SSE_HEAD, Client, body, upstreams  # noqa: F401
from tests.support.helpers import closed_port, rows_of, wait_for


async def test_a_stall_before_content_is_counted_on_its_upstream(make_relay, upstreams):  # noqa: F811
    async def stalls(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD + F.chunk(ROLE))
        await writer.drain()
        await reader.read()

    a = await upstreams(stalls)
    app = await make_relay(
        upstreams=[
            UpstreamConfig(name="a", url=a.url, fallback=["b"]),
            UpstreamConfig(name="b", url=f"http://127.0.0.1:{closed_port()}"),
        ],
        stream_idle_timeout_s=0.2,
    )
    c = await Client.post(app.port, body())
    await c.until(b"\r\n\r\n")
    c.close()
    [row] = await rows_of(app, 1)
    [line] = app.log.of("access")
    assert (row["status"], row["error_code"], row["upstream_served"]) == (
        502,
        "upstream_unavailable",
        None,
    )
    # The request was answered with an error (b refused): its own outcome, not a's stall.
    assert line["outcome"] == "error"
    assert app.upstreams["a"].metrics.stall_trips["idle"] == 1
    assert app.upstreams["b"].metrics.stall_trips["idle"] == 0


async def test_a_client_that_leaves_while_the_next_candidate_queues(make_relay, upstreams):  # noqa: F811
    busy = asyncio.Event()

    async def drops(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD + F.chunk(ROLE))
        await writer.drain()
        writer.transport.abort()

    async def silent(up, index, reader, writer):
        await up.read_request(reader)
        busy.set()
        await reader.read()

    a, b = await upstreams(drops), await upstreams(silent)
    app = await make_relay(
        upstreams=[
            UpstreamConfig(name="a", url=a.url, fallback=["b"]),
            UpstreamConfig(name="b", url=b.url, parallel=1, models=["b-only"]),
        ],
    )
    # b's only slot is taken by another request, so the next one queues for it.
    other = await Client.post(app.port, {**body(), "model": "b-only"})
    await asyncio.wait_for(busy.wait(), 5)
    c = await Client.post(app.port, {**body(), "model": "any"})
    await wait_for(lambda: app.upstreams["b"].slots.queued == 1)
    c.close()
    [row] = await rows_of(app, 1)
    other.close()
    assert (row["fallback_attempts"], row["error_code"], row["client_closed"]) == (
        1,
        "client_closed",
        1,
    )

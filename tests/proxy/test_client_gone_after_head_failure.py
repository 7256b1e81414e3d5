"""The client leaves while its request, whose first candidate failed before a head (a
close, a bad head, a timeout), waits for the next candidate's slot: the request is cancelled
at once, not carried on to the next upstream for nobody."""

from __future__ import annotations

import asyncio

from relay.config import UpstreamConfig
from tests.proxy.test_heartbeat import Client, body, upstreams  # noqa: F401
from tests.support.helpers import wait_for


async def test_client_gone_while_queued_after_a_head_failure(make_relay, upstreams):  # noqa: F811
    busy = asyncio.Event()

    async def closes(up, index, reader, writer):
        await up.read_request(reader)
        writer.transport.abort()

    async def silent(up, index, reader, writer):
        await up.read_request(reader)
        busy.set()
        await reader.read()

    a, b = await upstreams(closes), await upstreams(silent)
    app = await make_relay(
        upstreams=[
            UpstreamConfig(name="a", url=a.url, fallback=["b"]),
            UpstreamConfig(name="b", url=b.url, parallel=1),
        ],
        pool_timeout_s=3,
    )
    other = await Client.post(app.port, {**body(), "model": "b"})
    await asyncio.wait_for(busy.wait(), 5)
    c = await Client.post(app.port, body())
    await asyncio.sleep(0.3)
    c.close()
    # cancelled at once: its row is in well before the slot wait's 3 s
    await wait_for(lambda: len(app.log.of("access")) == 1, timeout=1.5)
    [line] = app.log.of("access")
    assert (line["fallback_attempts"], line["error_code"]) == (1, "client_closed")
    other.close()

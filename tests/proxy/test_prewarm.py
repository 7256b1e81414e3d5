"""The spare upstream connection: ready for the next request when the upstream closes after
every stream (llama-server does), never a loop of connects when it closes idle ones too."""

import asyncio

from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import wait_for


async def test_a_connected_spare_waits_for_each_next_stream(make_relay, sim):
    app = await make_relay()
    pool = app.upstreams["llm"].pool
    for _i in range(4):
        resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))
        assert resp.complete and resp.data_events()[-1] == "[DONE]"
        # the simulator closed the stream's connection; a spare is connected before the next
        await wait_for(lambda: len(pool.idle) == 1 and not pool._warming)
    # one connection per stream, plus the spare waiting now: no request waited for a connect
    assert pool.connects == 5 and sim.connections_opened == 5
    assert [r.path for r in sim.requests] == ["/v1/chat/completions"] * 4


async def test_a_request_taking_the_spare_readies_the_next_before_its_head(make_relay, sim):
    # a long prompt: the next request, arriving meanwhile, must not wait for a connect
    app = await make_relay()
    pool = app.upstreams["llm"].pool
    assert (await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(2))).complete
    await wait_for(lambda: len(pool.idle) == 1 and not pool._warming)
    slow = asyncio.ensure_future(
        httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(2, head_delay_ms=600))
    )
    await wait_for(lambda: len(sim.requests) == 2)  # the slow one holds the old spare
    await wait_for(lambda: len(pool.idle) == 1 and not pool._warming)
    assert not slow.done()  # its head has not come yet, and a spare is already connected
    assert (await slow).complete


async def test_no_spare_when_prewarm_is_off(make_relay, sim):
    app = await make_relay(prewarm=False)
    pool = app.upstreams["llm"].pool
    for _ in range(2):
        assert (await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))).complete
    await wait_for(lambda: sim.open_connections == 0)
    assert pool.idle == [] and pool.connects == 2 and sim.connections_opened == 2


async def test_no_spare_for_an_upstream_that_keeps_connections(make_relay, sim):
    app = await make_relay()
    pool = app.upstreams["llm"].pool
    for _ in range(3):  # non-streamed answers keep the connection alive: it is reused
        assert (
            await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3, stream=False))
        ).status == 200
    assert pool.connects == 1 and len(pool.idle) == 1


async def test_spares_closed_unused_by_the_upstream_are_not_replaced(make_relay):
    body = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\ndata: [DONE]\n\n'
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )

    async def script(up, index, reader, writer):
        # answers one request then closes; closes a connection idle for 0.5 s unanswered (the
        # request's own connection carries its request at once: 0.5 s is far beyond that)
        try:
            head = await asyncio.wait_for(up.read_request(reader), 0.5)
        except TimeoutError:
            return
        if head is not None:
            writer.write(answer)
            await writer.drain()

    up = await Scripted(script).start()
    app = await make_relay(url=up.url)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(1))
    assert resp.body == body
    # the used connection closed -> one spare; the upstream closes that spare unused -> none
    pool = app.upstreams["llm"].pool
    await wait_for(lambda: up.connections == 2 and len(up.closed_at) == 2 and pool.idle == [])
    # the relay has seen the spare close; replacing it would have started a warm-up at once
    assert not pool._warming and pool.connects == 2 and up.connections == 2
    await up.stop()

"""Peers vanishing and peers too slow: disconnects, drops, backpressure, shutdown."""

import asyncio
import socket

from relay.proxy.client_writer import WRITE_HIGH_WATER
from tests.support import httpc
from tests.support.helpers import settled, wait_for
from tests.support.sockets import READ_SIZE, open_stream, paused_stream


async def test_client_disconnect_closes_upstream_within_100ms(make_relay, sim):
    app = await make_relay()
    reader, writer, resp = await open_stream(app.port, httpc.chat(chatty=True, interval_ms=5))
    assert resp.status == 200
    await reader.readuntil(b'"content":" a"')  # a few tokens in
    upstream_req = sim.requests[-1]
    loop = asyncio.get_running_loop()
    closed_at = loop.time()
    writer.transport.abort()
    await asyncio.wait_for(upstream_req.closed.wait(), 2)
    assert upstream_req.peer_closed_at is not None
    assert upstream_req.peer_closed_at - closed_at < 0.1
    await wait_for(lambda: app.log.of("access"))
    access = app.log.of("access")[-1]
    assert access["outcome"] == "client_closed" and access["client_closed"] is True
    assert access["completion_tokens"] >= 3


async def test_client_disconnect_while_waiting_for_head(make_relay, sim):
    app = await make_relay()
    _reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(
        httpc.build_request("POST", "/v1/chat/completions", httpc.chat(3, head_delay_ms=5000))
    )
    await wait_for(lambda: sim.requests)
    loop = asyncio.get_running_loop()
    closed_at = loop.time()
    writer.transport.abort()
    await asyncio.wait_for(sim.requests[-1].closed.wait(), 2)
    assert sim.requests[-1].peer_closed_at - closed_at < 0.1
    await wait_for(lambda: app.log.of("access"))
    assert app.log.of("access")[-1]["outcome"] == "client_closed"


async def test_upstream_drop_mid_stream_is_visible_to_the_client(make_relay, sim):
    app = await make_relay()
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(20, drop_after=3))
    assert resp.status == 200
    assert not resp.complete  # no terminating chunk: truncation is not disguised as success
    contents = [
        e["choices"][0]["delta"].get("content") for e in resp.data_events() if isinstance(e, dict)
    ]
    assert contents == [None, "Hello", " from", " a"]
    assert b"[DONE]" not in resp.body
    access = app.log.of("access")[-1]
    assert access["outcome"] == "upstream_dropped" and access["completion_tokens"] == 3


async def test_upstream_drop_before_first_content_gives_502(make_relay, sim):
    app = await make_relay()
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(20, drop_after=0))
    assert resp.status == 502
    assert resp.json()["error"]["code"] == "upstream_unavailable"


async def test_slow_reader_keeps_relay_buffer_bounded(make_relay, sim):
    app = await make_relay()
    # events sent as fast as the sockets allow, so the simulator must feel the pause
    n = 60000
    reader, writer, resp, client, ex = await paused_stream(app, n)
    upstream_req = sim.requests[-1]
    # while the client reads nothing, the upstream side stays paused and the buffer bounded;
    # the simulator goes on only until the kernel buffers between it and the relay are full
    sent = await settled(lambda: upstream_req.tokens_sent)
    buffered = client.transport.get_write_buffer_size() + (ex.reply.hold.size if ex.reply else 0)
    assert buffered <= WRITE_HIGH_WATER + READ_SIZE, buffered
    assert not ex.conn.transport.is_reading()
    assert sent < n * 0.8  # the simulator was held back too
    # then the client drains everything, unharmed
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    await httpc.read_body(reader, resp)
    writer.close()
    assert resp.complete
    assert resp.body.count(b'"delta":{"content":') == n
    assert resp.data_events()[-1] == "[DONE]"


async def test_client_that_never_reads_is_dropped_after_write_timeout(make_relay, sim):
    app = await make_relay(write_timeout_s=0.3)
    _reader, writer, _resp = await open_stream(app.port, httpc.chat(200000), rcvbuf=4096)
    await asyncio.wait_for(sim.requests[-1].closed.wait(), 10)
    assert not sim.requests[-1].finished
    await wait_for(lambda: app.log.of("access"))
    assert app.log.of("access")[-1]["outcome"] == "client_write_timeout"
    writer.close()


async def test_shutdown_lets_in_flight_streams_finish(make_relay, sim):
    app = await make_relay()
    reader, writer, resp = await open_stream(app.port, httpc.chat(30, interval_ms=10))
    stopping = asyncio.create_task(app.stop(drain_timeout_s=5))
    await wait_for(lambda: app.draining)  # (the listener is closed in the same step)
    # no new connections are accepted while draining
    try:
        r2, w2 = await asyncio.open_connection("127.0.0.1", app.port)
        refused = await r2.read() == b""
        w2.close()
    except OSError:
        refused = True
    assert refused
    await httpc.read_body(reader, resp)
    await stopping
    writer.close()
    assert resp.complete and resp.data_events()[-1] == "[DONE]"
    assert app.log.of("access")[-1]["outcome"] == "done"


async def test_shutdown_drain_timeout_cuts_what_is_left(make_relay, sim):
    app = await make_relay()
    reader, writer, resp = await open_stream(app.port, httpc.chat(chatty=True, interval_ms=10))
    await app.stop(drain_timeout_s=0.2)
    await asyncio.wait_for(httpc.read_body(reader, resp), 5)
    writer.close()
    assert not resp.complete
    assert app.log.of("access")[-1]["outcome"] == "shutdown"
    await asyncio.wait_for(sim.requests[-1].closed.wait(), 2)

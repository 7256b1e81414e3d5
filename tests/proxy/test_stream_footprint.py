"""What an open stream keeps (issue 15, part 3), over real sockets: the memory tricks change
nothing a client sees."""

import asyncio
import json

from relay.sim import frames as F
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import wait_for
from tests.support.sockets import open_stream

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nServer: llama.cpp\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'


async def test_a_streaming_request_keeps_one_frame_no_h11_no_request(make_relay, sim):
    app = await make_relay()
    reader, writer, resp = await open_stream(app.port, httpc.chat(12, interval_ms=40))
    assert resp.status == 200
    client = next(iter(app.clients))
    await wait_for(lambda: client.exchange is not None and client.exchange.reply is None)
    ex = client.exchange
    # the request is read whole: no h11 connection until the next request's first byte
    assert client.h11 is None and client.head is None
    # the upstream's head was written and seen: not kept
    assert ex.head_resp is None and ex.head_fut is None
    # the client never fell behind: no flow-control object; the guard is one shared deadline
    assert ex.flow is None and ex.guard.deadline is not None and len(app.deadlines) == 1
    # the request's task waits with the dispatcher's entry frame alone, the request dropped
    frames = client.task.get_stack()
    assert [f.f_code.co_name for f in frames] == ["handle"]
    assert "req" not in frames[0].f_locals
    await asyncio.wait_for(httpc.read_body(reader, resp, "POST"), 10)
    writer.close()
    body = resp.body
    assert body.count(b'"content"') >= 12 and body.endswith(b"data: [DONE]\n\n")
    await wait_for(lambda: not client.busy)
    assert len(app.deadlines) == 0
    assert app.log.of("access")[-1]["completion_tokens"] == 12


async def test_a_stream_waiting_for_its_first_token_keeps_little_more(make_relay):
    """A long prompt: the upstream's head and role event are in, its first token is not. With
    no other candidate the request waits as a streaming one does (issue 35: it held 14 KB,
    twice what a streaming one holds): the dispatcher's entry frame alone, the request
    dropped, of the upstream's head only its bytes, the heartbeat one more shared deadline,
    no gaps counted yet; then the first token goes out with the head and the role event."""
    go = asyncio.Event()

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(SSE_HEAD + F.chunk(ROLE))
        await writer.drain()
        await asyncio.wait_for(go.wait(), 10)
        writer.write(F.chunk(TOKEN) + F.chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    up = await Scripted(script).start()
    try:
        app = await make_relay(up.url, heartbeat_s=60)
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
        writer.write(httpc.build_request("POST", "/v1/chat/completions", httpc.chat(1)))
        await wait_for(lambda: app.clients)
        client = next(iter(app.clients))
        await wait_for(
            lambda: (
                client.exchange is not None
                and client.exchange.reply is not None
                and client.exchange.reply.hold.parts
            )  # the role event is held
        )
        ex = client.exchange
        frames = client.task.get_stack()
        assert [f.f_code.co_name for f in frames] == ["handle"]
        assert "req" not in frames[0].f_locals
        assert client.head is None and client.body == b"" and client.head_bytes == b""
        assert ex.head_resp is None and ex.head_raw == SSE_HEAD
        assert ex.observer.gaps is None and ex.observer.scanner.blocks is None
        # the stall guard and the heartbeat: two entries of the one shared timer
        assert ex.reply.deadline is not None and len(app.deadlines) == 2
        go.set()
        resp = await asyncio.wait_for(httpc.read_head(reader), 10)
        await asyncio.wait_for(httpc.read_body(reader, resp, "POST"), 10)
        writer.close()
        assert resp.status == 200 and resp.header("server") == "llama.cpp"
        assert resp.body == ROLE + TOKEN + b"data: [DONE]\n\n"
        await wait_for(lambda: not client.busy)
        assert len(app.deadlines) == 0
        assert app.log.of("access")[-1]["completion_tokens"] == 1
    finally:
        await up.stop()


async def test_an_idle_keep_alive_connection_holds_no_h11_and_serves_the_next(make_relay, sim):
    app = await make_relay()
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("GET", "/health"))
    first = await httpc.read_head(reader)
    await httpc.read_body(reader, first, "GET")
    client = next(iter(app.clients))
    await wait_for(lambda: not client.busy)
    assert client.h11 is None
    req = httpc.build_request("POST", "/v1/chat/completions", httpc.chat(3))
    writer.write(req[:7])  # the first bytes make a parser; the rest arrive later
    await writer.drain()
    await wait_for(lambda: client.h11 is not None)
    writer.write(req[7:])
    second = await asyncio.wait_for(httpc.read_head(reader), 5)
    await asyncio.wait_for(httpc.read_body(reader, second, "POST"), 5)
    writer.close()
    body = second.body
    assert first.json() == {"status": "ok"} and second.status == 200
    assert body.count(b'"content"') >= 3 and body.endswith(b"data: [DONE]\n\n")


async def test_a_request_pipelined_behind_a_stream_is_answered_after_it(make_relay, sim):
    app = await make_relay()
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    # one write: a stream, then a second request that h11 holds past the first one's body
    writer.write(
        httpc.build_request("POST", "/v1/chat/completions", httpc.chat(4))
        + httpc.build_request("GET", "/health")
    )
    first = await asyncio.wait_for(httpc.read_head(reader), 5)
    await asyncio.wait_for(httpc.read_body(reader, first, "POST"), 5)
    body = first.body
    second = await asyncio.wait_for(httpc.read_head(reader), 5)
    await httpc.read_body(reader, second, "GET")
    writer.close()
    assert first.status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert second.status == 200 and second.json() == {"status": "ok"}


async def test_every_one_of_many_idle_streams_is_cut_by_its_guard_on_time(make_relay, sim):
    """40 streams go quiet at once after a few tokens: each one's guard (one shared loop timer)
    trips with its own idle frame, about idle_s after its last read."""
    idle = 0.3
    app = await make_relay(stream_idle_timeout_s=idle, stream_total_timeout_s=0)
    resps = await asyncio.gather(
        *(
            httpc.fetch(
                app.port, "POST", "/v1/chat/completions", httpc.chat(50, stall_after=2 + i % 3)
            )
            for i in range(40)
        )
    )
    for resp in resps:
        assert resp.status == 200 and resp.complete
        events = resp.events()
        assert events[-1].strip(b"\n") == b"data: [DONE]"
        stall = json.loads(events[-2].strip(b"\n")[len(b"data: ") :])["x_relay_stall"]
        assert stall["reason"] == "idle" and idle <= stall["elapsed_s"] < idle + 0.25
    trips = app.log.of("stream_stall_guard_tripped")
    assert len(trips) == 40 and {t["reason"] for t in trips} == {"idle"}
    assert len(app.deadlines) == 0

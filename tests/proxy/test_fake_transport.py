"""The client connection and the exchange driven with fake transports, as uvicorn's tests drive
its protocol: bytes in through the asyncio callbacks, the bytes the client gets read back
from what its one writer wrote. No socket; the exchange's clock is a fake loop."""

from __future__ import annotations

import asyncio
import types

from relay.config import Config, DispatcherConfig, ServerConfig, StoreConfig, UpstreamConfig
from relay.errors import Outcome
from relay.http.chunked import LAST_CHUNK, frame
from relay.observe.log import quiet
from relay.proxy import exchange as X
from relay.proxy.client import ClientConn
from relay.proxy.client_writer import ClientWriter
from relay.proxy.deadlines import Deadlines
from relay.proxy.reply import Reply
from relay.proxy.request import Request
from relay.stream.content_hold import HEARTBEAT, Hold
from relay.stream.stall import StallPolicy, StallReason
from tests.support.fake_loop import FakeLoop


class FakeTransport(asyncio.Transport):
    """A client's transport: what is written is kept; reading, closing and EOF are noted."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []
        self.closed = self.eof = self.paused = False

    def write(self, data) -> None:
        assert not self.closed, "a write after the close"
        self.out.append(bytes(data))

    def sent(self) -> bytes:
        return b"".join(self.out)

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 50000) if name == "peername" else default

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


class _Loop(FakeLoop):
    """An exchange's loop: the fake clock and timers, futures of a loop that never runs."""

    def __init__(self, futures: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.futures = futures

    def create_future(self) -> asyncio.Future:
        return self.futures.create_future()


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'


def exchange(loop: _Loop, transport: FakeTransport, hold: Hold | None = None, idle_s=300.0):
    writer = ClientWriter(loop, transport)
    req = Request(b"POST", b"/v1/chat/completions", [], b"{}", True, True)
    reply = Reply(loop, writer, hold or Hold(b"r1"), 0.0, Deadlines(loop))
    aborted = []
    conn = types.SimpleNamespace(handler=None, transport=None, abort=lambda: aborted.append(1))
    relaying = X.Relaying(loop, Deadlines(loop), StallPolicy(idle_s, 0.0, 300.0), 10.0)
    return X.Exchange(relaying, conn, req, reply, X.Hop("llm", "tiny", False)), aborted


def test_the_hold_then_the_stream_go_through_the_one_writer():
    futures = asyncio.new_event_loop()
    loop, transport = _Loop(futures), FakeTransport()
    ex, _ = exchange(loop, transport)
    ex.upstream_data(SSE_HEAD + frame(ROLE))
    assert transport.out == []  # held until the first content event
    ex.upstream_data(frame(TOKEN))
    head, _, body = transport.sent().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked" in head
    assert body == frame(ROLE) + frame(TOKEN) and len(transport.out) == 1  # one write
    ex.upstream_data(frame(TOKEN) + LAST_CHUNK)
    summary = ex.summary
    assert summary is not None and summary.ending is Outcome.DONE
    assert summary.content_events == 2 and ex.writer.sent == len(body) + len(frame(TOKEN)) + 5
    futures.close()


def test_a_response_that_cannot_continue_a_committed_stream_writes_nothing():
    """Heartbeats went out (a 200 event-stream head and comments); the upstream then answers
    a whole JSON body: nothing of it reaches the client (the dispatcher answers in-band)."""
    futures = asyncio.new_event_loop()
    loop, transport = _Loop(futures), FakeTransport()
    hold = Hold(b"r1")
    ex, _ = exchange(loop, transport, hold)
    ex.writer.write(hold.beat())
    before = transport.sent()
    assert before.endswith(frame(HEARTBEAT)) and hold.committed
    body = b'{"error":{"message":"no","type":"x"}}'
    ex.upstream_data(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert transport.sent() == before and hold.committed
    summary = ex.summary
    assert summary is not None and (summary.ending, summary.body) == (Outcome.DONE, body)
    futures.close()


def test_a_stall_ends_the_stream_with_its_frame_through_the_writer():
    futures = asyncio.new_event_loop()
    loop, transport = _Loop(futures), FakeTransport()
    ex, aborted = exchange(loop, transport, idle_s=30.0)
    ex.upstream_data(SSE_HEAD + frame(ROLE + TOKEN))
    loop.run_until(29.9)
    assert ex.ending is None
    loop.run_until(30.0)
    summary = ex.summary
    assert summary is not None and summary.ending is Outcome.STALL and aborted
    assert summary.stall is not None and summary.stall.reason is StallReason.IDLE
    sent = transport.sent()
    assert sent.endswith(b"data: [DONE]\n\n\r\n" + LAST_CHUNK)
    assert b'"x_relay_stall":{"reason":"idle","elapsed_s":30.0,"upstream":"llm"}' in sent
    futures.close()


def test_a_client_that_leaves_after_the_streams_end_had_it_whole():
    futures = asyncio.new_event_loop()
    loop, transport = _Loop(futures), FakeTransport()
    ex, _ = exchange(loop, transport)
    ex.upstream_data(SSE_HEAD + frame(ROLE + TOKEN) + frame(b"data: [DONE]\n\n"))
    ex.writer.closed()
    ex.client_gone()
    summary = ex.summary
    assert summary is not None and (summary.ending, summary.whole) == (Outcome.DONE, True)
    futures.close()


async def _app(**server):
    from relay.app import App

    cfg = Config(
        server=ServerConfig(port=0, **server),
        dispatcher=DispatcherConfig(health_interval_s=0),
        upstream=[UpstreamConfig(name="llm", url="http://127.0.0.1:9", models=["tiny"])],
        key=[],
        store=StoreConfig(path=":memory:"),
    )
    app = App(cfg, log=quiet())
    await app.start()
    return app


async def _until(pred) -> None:
    for _ in range(1000):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError("not reached")


async def test_a_client_connection_answers_through_its_writer_and_reads_the_next():
    app = await _app()
    try:
        conn, transport = ClientConn(app), FakeTransport()
        conn.connection_made(transport)
        conn.data_received(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/mod")
        await _until(lambda: transport.out)
        first = transport.sent()
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b'"id":"tiny"' in first
        assert not transport.closed
        conn.data_received(b"els HTTP/1.1\r\nHost: x\r\n\r\n")
        await _until(lambda: len(transport.out) == 2)
        assert transport.out[1].startswith(b"HTTP/1.1 200 OK\r\n")
        conn.connection_lost(None)
    finally:
        await app.stop(0.5)


async def test_a_refused_head_is_answered_then_the_output_ends():
    app = await _app()
    try:
        conn, transport = ClientConn(app), FakeTransport()
        conn.connection_made(transport)
        conn.data_received(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        sent = transport.sent()
        assert sent.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert b"Connection: close\r\n" in sent and transport.eof and conn.lingering
        # Whatever the client still sends is read and discarded: nothing more is written.
        conn.data_received(b"abc")
        assert transport.sent() == sent
        conn.connection_lost(None)
    finally:
        await app.stop(0.5)

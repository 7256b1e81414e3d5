"""Hostile upstream heads and framing, over real sockets (issue 10).

The rule (RFC 9112 6.1 / 6.3, as nginx applies it): a response whose framing is ambiguous or
in a transfer coding the relay does not carry is a bad response - a 502 before anything
reached the client, never a client head with both Content-Length and Transfer-Encoding,
never a content coding silently dropped.
"""

import asyncio
import json
import time

import pytest

from tests.support import httpc
from tests.support.fakeup import Scripted

SSE_BODY = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\ndata: [DONE]\n\n'


def answer(raw: bytes, linger: float = 0.5):
    async def script(up, index, reader, writer):
        if await up.read_request(reader) is None:
            return
        writer.write(raw)
        await writer.drain()
        await asyncio.sleep(linger)

    return script


async def relay_for(make_relay, raw: bytes):
    up = await Scripted(answer(raw)).start()
    app = await make_relay(url=up.url)
    return up, app


def error_code(resp) -> str:
    assert resp.header("content-type") == "application/json"
    return json.loads(resp.body)["error"]["code"]


def chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)


BAD_HEADS = {
    "te_and_cl": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" + chunked(SSE_BODY),
    "cl_and_te": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"
    + chunked(b"hello world"),
    "gzip_and_cl": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nContent-Length: 5\r\n\r\n"
    b"\x1f\x8b\x08\x00\x00",
    "gzip_alone": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: gzip\r\n\r\n\x1f\x8b\x08\x00\x00",
    "gzip_then_chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    + chunked(b"\x1f\x8b\x08\x00\x00"),
    "two_te_lines": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b"hello"),
    "chunked_on_http10": b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    + chunked(b"hello"),
    "huge_cl": b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\nhello",
    "19_digit_cl": b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000000000\r\n\r\nhello",
    "differing_cls": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n"
    b"hello, world",
    "cl_list": b"HTTP/1.1 200 OK\r\nContent-Length: 5, 7\r\n\r\nhello, world",
    "signed_cl": b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello",
    "bare_lf_ends_head": b"HTTP/1.1 200 OK\r\nContent-Length: 5\n\r\nhello",
    "reason_with_nul": b"HTTP/1.1 200 O\x00K\r\nContent-Length: 5\r\n\r\nhello",
    "reason_with_esc": b"HTTP/1.1 200 \x1b[2JOK\r\nContent-Length: 5\r\n\r\nhello",
    "reason_with_del": b"HTTP/1.1 200 OK\x7f\r\nContent-Length: 5\r\n\r\nhello",
}


@pytest.mark.parametrize("http", ["1.1", "1.0"])
@pytest.mark.parametrize("name", sorted(BAD_HEADS))
async def test_ambiguous_or_unknown_framing_is_a_bad_response(make_relay, name, http):
    up, app = await relay_for(make_relay, BAD_HEADS[name])
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(3), http=http, timeout=5
    )
    assert resp.status == 502, resp.raw_head
    assert error_code(resp) == "upstream_bad_response"
    assert resp.complete and resp.header("transfer-encoding") is None
    assert resp.header("content-length") == str(len(resp.body))
    await up.stop()


@pytest.mark.parametrize("http", ["1.1", "1.0"])
@pytest.mark.parametrize("coding", [b"CHUNKED", b"Chunked"])
async def test_transfer_encoding_chunked_in_any_case_is_relayed_as_chunked(
    make_relay, coding, http
):
    up, app = await relay_for(
        make_relay,
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: "
        + coding
        + b"\r\n\r\n"
        + chunked(SSE_BODY),
    )
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3), http=http)
    assert resp.status == 200 and resp.complete
    assert resp.body == SSE_BODY
    # (The relay's own lines: the request id and its Server-Timing, this run's durations.)
    named = [(k, v) for k, v in resp.headers if k not in ("X-Request-Id", "Server-Timing")]
    if http == "1.1":  # the chunks passed through as they came, under the relay's own header
        assert named == [("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked")]
        assert resp.raw_body == chunked(SSE_BODY)
    else:  # de-chunked for an HTTP/1.0 client: the body ends at the close
        assert named == [("Content-Type", "text/event-stream"), ("Connection", "close")]
        assert resp.raw_body == SSE_BODY
    await up.stop()


def _without_request_id(raw_head: bytes) -> bytes:
    """The head without the relay's own lines that differ per request (the id, and the
    Server-Timing durations)."""
    own = (b"X-Request-Id:", b"Server-Timing:")
    return b"".join(x for x in raw_head.splitlines(True) if not x.startswith(own))


@pytest.mark.parametrize("http", ["1.1", "1.0"])
async def test_a_lone_transfer_encoding_in_any_spelling_is_relayed_as_the_canonical_one(
    make_relay, http
):
    """(issue 21 item 9) The single-framing-header shape, its name and coding in any case: the
    client gets the very bytes the canonical `Transfer-Encoding: chunked` gets."""

    async def client_sees(line: bytes) -> tuple[int, bytes, bytes]:
        up, app = await relay_for(
            make_relay,
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            + line
            + b"\r\n\r\n"
            + chunked(SSE_BODY),
        )
        resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3), http=http)
        await up.stop()
        assert resp.complete
        return resp.status, _without_request_id(resp.raw_head), resp.raw_body

    want = await client_sees(b"Transfer-Encoding: chunked")
    assert want[0] == 200 and want[2] == (chunked(SSE_BODY) if http == "1.1" else SSE_BODY)
    for line in (
        b"transfer-encoding: chunked",
        b"TRANSFER-ENCODING: Chunked",
        b"tRaNsFeR-eNcOdInG: CHUNKED",
        b"transfer-encoding:chunked",
    ):
        assert await client_sees(line) == want, line


async def test_bad_framing_falls_back_to_the_next_upstream(make_relay):
    from relay.config import UpstreamConfig

    bad = await Scripted(answer(BAD_HEADS["te_and_cl"])).start()
    good = await Scripted(
        answer(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunked(SSE_BODY)
        )
    ).start()
    app = await make_relay(
        upstreams=[
            UpstreamConfig(name="bad", url=bad.url, models=["m"], fallback=["good"]),
            UpstreamConfig(name="good", url=good.url, models=["other"]),
        ]
    )
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3, model="m"))
    assert resp.status == 200 and resp.body == SSE_BODY and resp.complete
    assert resp.header("content-length") is None
    await bad.stop()
    await good.stop()


@pytest.mark.parametrize("http", ["1.1", "1.0"])
async def test_204_never_reaches_the_client_with_a_content_length(make_relay, http):
    up, app = await relay_for(
        make_relay, b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\nX-Kept: yes\r\n\r\n"
    )
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3), http=http)
    assert resp.status == 204 and resp.body == b""
    assert resp.header("content-length") is None and resp.header("transfer-encoding") is None
    assert resp.header("x-kept") == "yes"
    await up.stop()


async def test_304_keeps_its_content_length_and_sends_no_body(make_relay):
    up, app = await relay_for(make_relay, b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n")
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("GET", "/v1/models/x"))
    raw_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert raw_head.startswith(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n")
    assert b"transfer-encoding" not in raw_head.lower()
    writer.close()
    await up.stop()


async def _keep_alive_pair(port: int, first: str, second: str):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    a = await httpc.exchange(reader, writer, "POST", first, httpc.chat(3, stream=False))
    await asyncio.sleep(0.2)
    b = await httpc.exchange(reader, writer, "POST", second, httpc.chat(3, stream=False))
    writer.close()
    return a, b


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


@pytest.mark.parametrize(
    "first",
    [
        ok(b"first"),  # a clean response, then junk a little later on the idle connection
        b"HTTP/1.1 204 No Content\r\n\r\n",
        ok(b""),  # Content-Length: 0
    ],
)
@pytest.mark.parametrize("together", [False, True])
async def test_a_pooled_connection_that_received_unsolicited_bytes_is_not_reused(
    make_relay, first, together
):
    """Whatever an upstream sends after a whole response (in the same read or while the
    connection idles in the pool) makes the connection unusable: the next request opens a
    new one and gets its own answer, never the junk."""
    junk = ok(b"JUNK!")

    async def script(up, index, reader, writer):
        while await up.read_request(reader) is not None:
            if index == 0:
                if together:
                    writer.write(first + junk)
                else:
                    writer.write(first)
                    await writer.drain()
                    await asyncio.sleep(0.05)
                    writer.write(junk)
            else:
                writer.write(ok(b"second"))
            await writer.drain()

    up = await Scripted(script).start()
    app = await make_relay(url=up.url, upstream_keepalive_s=30, prewarm=False)
    a, b = await _keep_alive_pair(app.port, "/v1/chat/completions", "/v1/chat/completions")
    assert a.status == int(first[9:12])
    assert b.status == 200 and b.body == b"second", b.body
    assert up.connections == 2
    await up.stop()


async def test_endless_interim_heads_end_in_a_prompt_502_and_do_not_starve_others(make_relay):
    sent = []

    async def script(up, index, reader, writer):
        if await up.read_request(reader) is None:
            return
        burst = b"HTTP/1.1 100 Continue\r\n\r\n" * 64
        while True:
            writer.write(burst)
            sent.append(len(burst))
            await writer.drain()
            await asyncio.sleep(0)

    up = await Scripted(script).start()
    app = await make_relay(url=up.url, direct_read_timeout_s=8.0)
    t0 = time.monotonic()
    task = asyncio.create_task(
        httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3), timeout=10)
    )
    await asyncio.sleep(0.05)
    t1 = time.monotonic()
    metrics = await httpc.fetch(app.port, "GET", "/api/slots/metrics", timeout=10)
    assert metrics.status == 200 and time.monotonic() - t1 < 1.0
    resp = await task
    assert resp.status == 502 and error_code(resp) == "upstream_bad_response"
    assert time.monotonic() - t0 < 1.5
    assert "interim" in json.loads(resp.body)["error"]["details"]["error"]
    await up.stop()


async def test_a_head_over_max_head_in_one_read_is_refused(make_relay):
    from relay.http.response_head import MAX_HEAD

    raw = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * MAX_HEAD + b"\r\nContent-Length: 2\r\n\r\nok"
    up, app = await relay_for(make_relay, raw)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))
    assert resp.status == 502 and error_code(resp) == "upstream_bad_response"
    await up.stop()


async def test_the_pool_never_hands_out_a_connection_with_unread_bytes():
    """Bytes the loop has not read yet (it reads them at its next poll; a connection can be
    released and taken again before that) still retire the connection."""
    import select
    import socket

    from relay.proxy.pool import Pool

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(5)
    pool = Pool("127.0.0.1", srv.getsockname()[1], keepalive_s=30)
    conn, reused = await pool.acquire(5)
    peer, _ = srv.accept()
    pool.release(conn, True)
    peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nJUNK")
    fd = conn.transport.get_extra_info("socket").fileno()
    assert select.select([fd], [], [], 5)[0]  # landed; the loop has not run since
    again, reused = await pool.acquire(5)
    assert again is not conn and not reused and pool.connects == 2
    assert conn.transport.is_closing() and not conn.alive
    again.abort()
    pool.close()
    peer.close()
    srv.close()


async def test_one_large_event_in_small_reads_is_scanned_in_linear_time(make_relay, monkeypatch):
    """The scanner's unfinished event grows in place (it was re-joined on every read: 9.6 s
    of CPU for 20 MB in 1 KB reads); the stream still passes byte for byte."""
    from relay.stream import observer, sse

    spent = {"cpu": 0.0, "calls": 0}

    class Timed(sse.SseScanner):
        __slots__ = ()

        def feed(self, data):
            t = time.process_time()
            super().feed(data)
            spent["cpu"] += time.process_time() - t
            spent["calls"] += 1

    monkeypatch.setattr(observer, "SseScanner", Timed)
    first = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
    huge = b'data: {"choices":[{"delta":{"content":"' + b"x" * (6 << 20) + b'"}}]}\n\n'
    last = b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n'

    async def script(up, index, reader, writer):
        if await up.read_request(reader) is None:
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(first), first)
        )
        for i in range(0, len(huge), 1024):
            piece = huge[i : i + 1024]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))
        await writer.drain()
        await asyncio.sleep(0.5)

    up = await Scripted(script).start()
    app = await make_relay(url=up.url)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3), timeout=60)
    assert resp.status == 200 and resp.complete and resp.body == first + huge + last
    assert spent["calls"] > 1500  # the event really came in small reads
    assert spent["cpu"] < 0.5, spent
    await up.stop()

"""Request bodies in tiny chunks (issue 10): bounded chunk count, the loop never held by one
client, and the head deadline covering head and body, over real sockets."""

from __future__ import annotations

import asyncio
import json
import time

from tests.support import httpc

CHAT = "/v1/chat/completions"


def one_byte_chunks(body: bytes) -> bytes:
    return b"".join(b"1\r\n%c\r\n" % c for c in body) + b"0\r\n\r\n"


def chunked_head(path: str = CHAT) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: relay.test\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()


def padded_chat(size: int) -> bytes:
    body = httpc.chat(2, stream=False)
    body["pad"] = ""
    raw = json.dumps(body).encode()
    body["pad"] = "x" * (size - len(raw))
    return json.dumps(body).encode()


async def send_and_read_head(port: int, data: bytes, timeout: float):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    try:
        writer.write(data)
        resp = await asyncio.wait_for(httpc.read_head(reader), timeout)
        await asyncio.wait_for(httpc.read_body(reader, resp), timeout)
        return resp, time.monotonic() - t0
    finally:
        writer.close()


async def test_a_body_in_too_many_chunks_is_refused_413_early(make_relay, sim):
    app = await make_relay(max_body_chunks=4096)
    data = chunked_head() + one_byte_chunks(padded_chat(1_000_000))
    cpu0 = time.process_time()
    resp, _took = await send_and_read_head(app.port, data, 5.0)
    cpu = time.process_time() - cpu0
    assert resp.status == 413
    err = resp.json()["error"]
    assert err["code"] == "request_too_large" and err["details"] == {"limit_chunks": 4096}
    assert "more than 4096 chunks" in err["message"]
    assert sim.requests == []
    assert cpu < 1.5, cpu  # was 5.5 s of CPU for this body (loop held all along)


async def test_as_many_chunks_as_allowed_are_served(make_relay, sim):
    app = await make_relay(max_body_chunks=4096)
    body = padded_chat(4000)
    resp, _ = await send_and_read_head(app.port, chunked_head() + one_byte_chunks(body), 5.0)
    assert resp.status == 200
    assert sim.requests[0].body == body


async def test_the_head_deadline_covers_the_body_even_under_tiny_chunks(make_relay, sim):
    # chunk count unbounded here, so only the deadline can stop this 4 MB body of 1-byte chunks
    app = await make_relay(max_body_chunks=1 << 24, header_timeout_s=1.0)
    data = chunked_head() + one_byte_chunks(padded_chat(4_000_000))
    other = asyncio.create_task(_paced_requests(app.port, 0.8))
    resp, took = await send_and_read_head(app.port, data, 6.0)
    assert resp.status == 408 and resp.json()["error"]["code"] == "request_timeout"
    assert 0.95 <= took < 1.6, took  # was 15.1 s for a 10 s deadline
    worst = await other
    assert worst < 0.5, worst  # another client was served meanwhile, the loop was not held
    assert sim.requests and all(r.path == "/props" for r in sim.requests)


async def _paced_requests(port: int, duration: float) -> float:
    """Latency of the slowest of small requests sent while the flood is parsed."""
    worst = 0.0
    end = time.monotonic() + duration
    await asyncio.sleep(0.1)
    while time.monotonic() < end:
        t0 = time.monotonic()
        # (forwarded: the relay's own /health would not reach the upstream)
        resp = await httpc.fetch(port, "GET", "/props", timeout=3.0)
        assert resp.status == 200
        worst = max(worst, time.monotonic() - t0)
        await asyncio.sleep(0.05)
    return worst

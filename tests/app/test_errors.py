"""relay.errors: status, type and exact OpenAI-shaped JSON bodies; then the errors the relay
answers itself, each over a real socket, with exact bodies."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from relay.errors import RelayError, reason_phrase
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import closed_port, error_of

# docs/operations.md, "Errors the relay answers with": code -> (status, type)
DOCS_TABLE = [
    ("bad_request", 400, "invalid_request_error"),
    ("invalid_json", 400, "invalid_request_error"),
    ("invalid_api_key", 401, "authentication_error"),
    ("model_not_found", 404, "invalid_request_error"),
    ("request_timeout", 408, "timeout_error"),
    ("request_too_large", 413, "invalid_request_error"),
    ("budget_exceeded", 429, "rate_limit_error"),
    ("headers_too_large", 431, "invalid_request_error"),
    ("upstream_unavailable", 502, "upstream_error"),
    ("upstream_busy", 503, "server_error"),
    ("upstream_timeout", 504, "timeout_error"),
]


@pytest.mark.parametrize("code,status,type_", DOCS_TABLE)
def test_every_design_code(code, status, type_):
    err = RelayError(code, "msg")
    assert (err.code, err.status, err.type) == (code, status, type_)
    assert err.body() == (
        b'{"error":{"message":"msg","type":"'
        + type_.encode()
        + b'","code":"'
        + code.encode()
        + b'","param":null,"details":{}}}'
    )
    assert err.headers == [] and err.details == {} and str(err) == "msg"
    assert isinstance(err, Exception)


def test_budget_exceeded_body_exact():
    err = RelayError(
        "budget_exceeded",
        "daily token budget used up",
        {
            "limit": "daily_tokens",
            "used": 100000,
            "limit_value": 100000,
            "resets_at": "2026-01-02T00:00:00Z",
        },
        headers=[(b"Retry-After", b"3600")],
    )
    assert err.status == 429
    assert err.headers == [(b"Retry-After", b"3600")]
    assert err.body() == (
        b'{"error":{"message":"daily token budget used up","type":"rate_limit_error",'
        b'"code":"budget_exceeded","param":null,"details":{"limit":"daily_tokens",'
        b'"used":100000,"limit_value":100000,"resets_at":"2026-01-02T00:00:00Z"}}}'
    )


def test_upstream_unavailable_body_exact():
    err = RelayError(
        "upstream_unavailable",
        "no upstream reachable",
        {"upstream": "llm", "error": "connection refused"},
    )
    assert err.body() == (
        b'{"error":{"message":"no upstream reachable","type":"upstream_error",'
        b'"code":"upstream_unavailable","param":null,"details":{"upstream":"llm",'
        b'"error":"connection refused"}}}'
    )


def test_body_key_order_and_escaping():
    err = RelayError("invalid_json", 'bad "json"\n\u00e9', {"pos": 3})
    obj = json.loads(err.body())
    assert list(obj) == ["error"]
    assert list(obj["error"]) == ["message", "type", "code", "param", "details"]
    assert obj["error"]["message"] == 'bad "json"\n\u00e9'
    assert obj["error"]["param"] is None and obj["error"]["details"] == {"pos": 3}
    assert b'"bad \\"json\\"\\n' in err.body()


def test_unknown_code_rejected():
    with pytest.raises(KeyError):
        RelayError("no_such_code", "x")


@pytest.mark.parametrize(
    "status,phrase",
    [
        (200, b"OK"),
        (400, b"Bad Request"),
        (401, b"Unauthorized"),
        (404, b"Not Found"),
        (408, b"Request Timeout"),
        (429, b"Too Many Requests"),
        (431, b"Request Header Fields Too Large"),
        (502, b"Bad Gateway"),
        (503, b"Service Unavailable"),
        (504, b"Gateway Timeout"),
        (599, b""),
        (999, b""),
    ],
)
def test_reason_phrase(status, phrase):
    assert reason_phrase(status) == phrase


def test_reason_phrase_413():
    # the phrase changed name in Python 3.13 (RFC 9110 "Content Too Large")
    assert reason_phrase(413) in (b"Request Entity Too Large", b"Content Too Large")


# ---- errors the relay answers itself, over real sockets ------------------------------------------
async def raw_exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = await asyncio.wait_for(reader.read(), timeout)
    writer.close()
    return out


def parse(raw: bytes):
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, head, body


async def test_502_when_upstream_refuses(make_relay):
    app = await make_relay(url=f"http://127.0.0.1:{closed_port()}")
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))
    assert resp.status == 502
    err = error_of(resp)
    assert err["code"] == "upstream_unavailable" and err["details"]["upstream"] == "llm"
    assert "connect failed" in err["details"]["error"]
    assert resp.header("x-request-id")


def _unanswering_listener() -> tuple[socket.socket, list[socket.socket]]:
    # a listener whose accept queue is full never completes the handshake
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    port = lsock.getsockname()[1]
    fillers = []
    for _ in range(8):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)
    return lsock, fillers


async def test_connect_deadline_and_an_outside_cancel_are_told_apart():
    from relay.proxy.pool import ConnectError, Pool

    lsock, fillers = _unanswering_listener()
    pool = Pool("127.0.0.1", lsock.getsockname()[1], keepalive_s=5.0)
    try:
        try:
            await pool.acquire(0.1)
            raise AssertionError("the connect should not have completed")
        except ConnectError as exc:
            assert str(exc) == "connect timed out after 0.1s"
        assert asyncio.current_task().cancelling() == 0  # the deadline's cancel was taken back
        task = asyncio.ensure_future(pool.acquire(5.0))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
            raise AssertionError("an outside cancel must stay a cancel")
        except asyncio.CancelledError:
            pass
        assert pool.connects == 0
    finally:
        for s in fillers:
            s.close()
        lsock.close()


async def test_502_when_connect_times_out(make_relay):
    lsock, fillers = _unanswering_listener()
    port = lsock.getsockname()[1]
    try:
        app = await make_relay(url=f"http://127.0.0.1:{port}", connect_timeout_s=0.2)
        t0 = asyncio.get_running_loop().time()
        resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))
        elapsed = asyncio.get_running_loop().time() - t0
        assert resp.status in (502, 504)
        err = error_of(resp)
        if resp.status == 502:
            assert err["code"] == "upstream_unavailable"
            assert "timed out" in err["details"]["error"]
            assert 0.15 < elapsed < 2.0
    finally:
        for s in fillers:
            s.close()
        lsock.close()


async def test_504_when_head_does_not_arrive(make_relay, sim):
    app = await make_relay(direct_read_timeout_s=0.2)
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(3, head_delay_ms=2000)
    )
    assert resp.status == 504
    err = error_of(resp)
    assert err["code"] == "upstream_timeout" and err["details"] == {"upstream": "llm"}
    # nothing reached the client before, and the upstream connection was closed
    await asyncio.wait_for(sim.requests[-1].closed.wait(), 2)


async def test_502_when_upstream_closes_without_answering(make_relay):
    async def script(up, index, reader, writer):
        await up.read_request(reader)

    up = await Scripted(script).start()
    app = await make_relay(url=up.url)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))
    assert resp.status == 502 and error_of(resp)["code"] == "upstream_unavailable"
    await up.stop()


async def test_502_on_malformed_upstream_head(make_relay):
    async def script(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(b"HTTP/1.1 abc nonsense\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    up = await Scripted(script).start()
    app = await make_relay(url=up.url)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))
    assert resp.status == 502 and error_of(resp)["code"] == "upstream_bad_response"
    await up.stop()


async def test_400_for_unparsable_http(make_relay, sim):
    app = await make_relay()
    status, head, body = parse(await raw_exchange(app.port, b"GARBAGE\r\n\r\n"))
    assert status == 400
    assert json.loads(body)["error"]["code"] == "bad_request"
    assert b"Connection: close" in head
    assert sim.requests == []


async def test_400_for_invalid_json(make_relay, sim):
    app = await make_relay()
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", b'{"messages": [')
    assert resp.status == 400
    assert error_of(resp)["code"] == "invalid_json"
    assert sim.requests == []


async def test_408_when_head_does_not_arrive(make_relay, sim):
    app = await make_relay(header_timeout_s=0.2)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    raw = await raw_exchange(app.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    status, _, body = parse(raw)
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
    assert 0.15 < loop.time() - t0 < 2.0


async def test_408_when_body_does_not_arrive(make_relay, sim):
    app = await make_relay(header_timeout_s=0.2)
    raw = await raw_exchange(
        app.port,
        b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"mod',
    )
    assert parse(raw)[0] == 408
    assert sim.requests == []


async def test_idle_keep_alive_connection_closed_silently(make_relay, sim):
    app = await make_relay(keepalive_timeout_s=0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    resp = await httpc.exchange(reader, writer, "GET", "/health")
    assert resp.status == 200
    rest = await asyncio.wait_for(reader.read(), 2)
    assert rest == b""  # closed, with no 408 written
    writer.close()


async def test_413_for_declared_oversized_body(make_relay, sim):
    app = await make_relay(max_body_bytes=1024)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 5000\r\n\r\n"
    )
    status, head, body = parse(await raw_exchange(app.port, head + b"x" * 5000))
    assert status == 413
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and err["details"] == {"limit_bytes": 1024}
    assert sim.requests == []


async def test_413_for_chunked_body_that_grows_too_large(make_relay, sim):
    app = await make_relay(max_body_bytes=1024)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunks = b"".join(b"200\r\n" + b"x" * 512 + b"\r\n" for _ in range(4)) + b"0\r\n\r\n"
    status, _, _ = parse(await raw_exchange(app.port, head + chunks))
    assert status == 413
    assert sim.requests == []


async def test_431_for_oversized_head(make_relay, sim):
    app = await make_relay(max_header_bytes=2048)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4000 + b"\r\n\r\n"
    status, _, body = parse(await raw_exchange(app.port, head))
    assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
    assert sim.requests == []


async def test_upstream_error_status_passes_through_verbatim(make_relay, sim):
    app = await make_relay()
    direct = await httpc.fetch(sim.port, "POST", "/v1/chat/completions", httpc.chat(3, status=400))
    relayed = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3, status=400))
    assert relayed.status == direct.status == 400
    assert relayed.body == direct.body
    assert relayed.header("content-length") == direct.header("content-length")


async def test_an_internal_error_still_answers_and_writes_a_row(make_relay, sim, monkeypatch):
    app = await make_relay()

    real = app.router.candidates

    def broken_once(model):
        monkeypatch.setattr(app.router, "candidates", real)
        raise RuntimeError("boom")

    monkeypatch.setattr(app.router, "candidates", broken_once)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))
    assert resp.status == 500 and error_of(resp)["code"] == "internal_error"
    assert app.log.of("internal_error")[0]["error"] == "RuntimeError: boom"
    app.store.flush()
    [row] = app.store.query("SELECT status, ok, error_code FROM request")
    assert row == {"status": 500, "ok": 0, "error_code": "internal_error"}
    ok = await httpc.fetch(app.port, "GET", "/health")  # the relay goes on serving
    assert ok.status == 200

"""relay/http/to_client.py: the head a client gets, from the upstream's or the relay's own answer:
what is stripped, what is added, exact bytes."""

from __future__ import annotations

import h11

from relay.http.to_client import client_response, relay_response

UPSTREAM_SSE = [
    (b"Server", b"llama.cpp"),
    (b"Access-Control-Allow-Origin", b""),
    (b"X-Accel-Buffering", b"no"),
    (b"Content-Type", b"text/event-stream"),
    (b"Transfer-Encoding", b"chunked"),
    (b"Keep-Alive", b"timeout=5, max=100"),
]


def test_client_response_sse_chunked_keepalive():
    head = client_response(200, b"OK", UPSTREAM_SSE, b"rid-9", chunked=True, keep_alive=True)
    assert head == (
        b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nAccess-Control-Allow-Origin: \r\n"
        b"X-Accel-Buffering: no\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\nX-Request-Id: rid-9\r\n\r\n"
    )


def test_client_response_dechunked_close():
    head = client_response(200, b"OK", UPSTREAM_SSE, b"r", chunked=False, keep_alive=False)
    assert head == (
        b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nAccess-Control-Allow-Origin: \r\n"
        b"X-Accel-Buffering: no\r\nContent-Type: text/event-stream\r\n"
        b"X-Request-Id: r\r\nConnection: close\r\n\r\n"
    )


def test_client_response_keeps_content_length_case_and_order():
    upstream = [
        (b"content-type", b"application/json; charset=utf-8"),
        (b"X-Request-Id", b"upstream-id"),
        (b"CONTENT-LENGTH", b"646"),
        (b"Connection", b"close, X-Secret-Hop"),
        (b"X-Secret-Hop", b"v"),
        (b"x-Mixed-Case", b"a"),
        (b"Set-Cookie", b"a=1"),
        (b"Set-Cookie", b"b=2"),
    ]
    head = client_response(404, b"Not Found", upstream, b"mine", chunked=False, keep_alive=True)
    assert head == (
        b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json; charset=utf-8\r\n"
        b"CONTENT-LENGTH: 646\r\nx-Mixed-Case: a\r\nSet-Cookie: a=1\r\n"
        b"Set-Cookie: b=2\r\nX-Request-Id: mine\r\n\r\n"
    )


def test_client_response_empty_reason_and_parses_with_h11():
    head = client_response(200, b"", UPSTREAM_SSE, b"r", chunked=True, keep_alive=True)
    assert head.startswith(b"HTTP/1.1 200 \r\n")
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=b"POST", target=b"/", headers=[(b"Host", b"x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(head + b"0\r\n\r\n")
    resp = conn.next_event()
    assert isinstance(resp, h11.Response) and resp.status_code == 200
    assert dict(resp.headers)[b"transfer-encoding"] == b"chunked"
    assert isinstance(conn.next_event(), h11.EndOfMessage)


def test_relay_response_exact():
    body = b'{"error":{}}'
    out = relay_response(429, b"Too Many Requests", body, b"rid", True, [(b"Retry-After", b"30")])
    assert out == (
        b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
        b"Content-Length: 12\r\nRetry-After: 30\r\nX-Request-Id: rid\r\n\r\n" + body
    )


def test_relay_response_no_request_id_close_and_content_type():
    out = relay_response(
        200, b"OK", b"# metrics\n", None, False, content_type=b"text/plain; version=0.0.4"
    )
    assert out == (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
        b"Content-Length: 10\r\nConnection: close\r\n\r\n# metrics\n"
    )
    assert relay_response(204, b"No Content", b"", None, True) == (
        b"HTTP/1.1 204 No Content\r\nContent-Type: application/json\r\nContent-Length: 0\r\n\r\n"
    )


def _names(head: bytes) -> list[bytes]:
    return [line.split(b":", 1)[0].lower() for line in head.split(b"\r\n")[1:] if line]


def test_client_response_never_holds_a_length_beside_the_relays_chunking():
    upstream = [
        (b"Content-Type", b"text/event-stream"),
        (b"Content-Length", b"5"),
        (b"content-length", b"7"),
        (b"Transfer-Encoding", b"gzip"),
    ]
    head = client_response(200, b"OK", upstream, b"r", chunked=True, keep_alive=True)
    assert head == (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\nX-Request-Id: r\r\n\r\n"
    )
    head = client_response(200, b"OK", upstream, b"r", chunked=False, keep_alive=False)
    assert b"transfer-encoding" not in _names(head)


def test_client_response_204_carries_no_content_length():
    up = [(b"Content-Length", b"5"), (b"X-Kept", b"1")]
    assert client_response(204, b"No Content", up, b"r", chunked=False, keep_alive=True) == (
        b"HTTP/1.1 204 No Content\r\nX-Kept: 1\r\nX-Request-Id: r\r\n\r\n"
    )
    # a 304's Content-Length describes the representation: it stays
    assert b"content-length" in _names(
        client_response(304, b"Not Modified", up, b"r", chunked=False, keep_alive=True)
    )

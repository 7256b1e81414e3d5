"""Unit tests for relay/headers.py: what crosses each edge, what is stripped, what is added."""

from __future__ import annotations

import h11

from relay.http.fields import HOP_BY_HOP, get, has_token
from relay.http.to_client import client_response, relay_response
from relay.http.to_upstream import upstream_request_headers

CLIENT = [
    (b"Host", b"relay.example:8080"),
    (b"User-Agent", b"ua/1"),
    (b"Connection", b"keep-alive, X-Hop-One"),
    (b"connection", b"x-hop-two"),
    (b"X-Hop-One", b"1"),
    (b"X-Hop-Two", b"2"),
    (b"Keep-Alive", b"timeout=5"),
    (b"Proxy-Connection", b"keep-alive"),
    (b"Proxy-Authorization", b"Basic c2VjcmV0"),
    (b"Authorization", b"Bearer sk-client-secret"),
    (b"x-api-key", b"sk-client-key"),
    (b"Content-Type", b"application/json"),
    (b"Content-Length", b"999"),
    (b"Transfer-Encoding", b"chunked"),
    (b"TE", b"trailers"),
    (b"Trailer", b"X-Sum"),
    (b"Upgrade", b"h2c"),
    (b"X-Request-Id", b"client-chosen"),
    (b"Expect", b"100-continue"),
    (b"Accept", b"text/event-stream"),
    (b"x-Custom-Case", b"kept"),
]


def test_hop_by_hop_set():
    assert {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    } == HOP_BY_HOP


def test_upstream_request_headers_no_auth():
    out = upstream_request_headers(CLIENT, b"127.0.0.1:8081", 42, b"rid-1", None)
    assert out == [
        (b"Host", b"127.0.0.1:8081"),
        (b"User-Agent", b"ua/1"),
        (b"Content-Type", b"application/json"),
        (b"Accept", b"text/event-stream"),
        (b"x-Custom-Case", b"kept"),
        (b"X-Request-Id", b"rid-1"),
        (b"Content-Length", b"42"),
    ]
    flat = b"\n".join(k + b":" + v for k, v in out)
    assert b"secret" not in flat and b"sk-client" not in flat and b"client-chosen" not in flat


def test_upstream_request_headers_injected_auth_replaces_same_name():
    client = [(b"host", b"h"), (b"X-Upstream-Token", b"from-client"), (b"Accept", b"*/*")]
    out = upstream_request_headers(client, b"up", 0, b"r", (b"x-upstream-token", b"real"))
    assert out == [
        (b"Host", b"up"),
        (b"Accept", b"*/*"),
        (b"x-upstream-token", b"real"),
        (b"X-Request-Id", b"r"),
        (b"Content-Length", b"0"),
    ]


def test_upstream_request_headers_injected_authorization():
    out = upstream_request_headers(CLIENT, b"up", 7, b"r", (b"Authorization", b"Bearer up"))
    names = [k.lower() for k, _ in out]
    assert names.count(b"authorization") == 1
    assert (b"Authorization", b"Bearer up") in out
    assert out[-3:] == [
        (b"Authorization", b"Bearer up"),
        (b"X-Request-Id", b"r"),
        (b"Content-Length", b"7"),
    ]
    assert b"x-api-key" not in names


def test_upstream_request_headers_connection_listed_names_case_insensitive():
    client = [(b"Connection", b" Content-Type ,close"), (b"content-type", b"x"), (b"Accept", b"a")]
    out = upstream_request_headers(client, b"h", 1, b"r", None)
    assert out == [
        (b"Host", b"h"),
        (b"Accept", b"a"),
        (b"X-Request-Id", b"r"),
        (b"Content-Length", b"1"),
    ]


def test_upstream_request_headers_valid_for_h11():
    out = upstream_request_headers(
        CLIENT, b"127.0.0.1:8081", 2, b"rid", (b"Authorization", b"Bearer u")
    )
    conn = h11.Connection(h11.CLIENT)
    wire = conn.send(h11.Request(method=b"POST", target=b"/v1/chat/completions", headers=out))
    wire += conn.send(h11.Data(data=b"{}")) + conn.send(h11.EndOfMessage())
    assert wire.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8081\r\n")
    assert wire.endswith(b"Content-Length: 2\r\n\r\n{}")


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


def test_get_and_has_token():
    h = [(b"Content-Type", b"a"), (b"content-type", b"b"), (b"Connection", b"Keep-Alive, Close")]
    assert get(h, b"content-type") == b"a"
    assert get(h, b"x-missing") is None
    assert has_token(h, b"connection", b"close")
    assert has_token(h, b"connection", b"keep-alive")
    assert not has_token(h, b"connection", b"upgrade")
    assert not has_token(h, b"content-type", b"close")
    assert has_token([(b"TE", b"gzip ,chunked")], b"te", b"chunked")


# ---- issue 12: a remote upstream's own key and static headers -------------------------------
def test_upstream_with_own_key_gets_none_of_the_clients_credentials():
    client = [
        (b"Host", b"relay"),
        (b"Authorization", b"Bearer sk-client"),
        (b"api-key", b"azure-client"),
        (b"X-API-Key", b"k"),
        (b"Cookie", b"s=1"),
        (b"Proxy-Authorization", b"Basic x"),
        (b"Accept", b"*/*"),
    ]
    out = upstream_request_headers(
        client, b"api.example.com", 2, b"r", (b"Authorization", b"Bearer sk-relay")
    )
    assert out == [
        (b"Host", b"api.example.com"),
        (b"Accept", b"*/*"),
        (b"Authorization", b"Bearer sk-relay"),
        (b"X-Request-Id", b"r"),
        (b"Content-Length", b"2"),
    ]
    # with another header name for the upstream's key, the client's Authorization is still
    # not forwarded to it
    out = upstream_request_headers(client, b"h", 0, b"r", (b"api-key", b"azure-relay"))
    flat = b"\n".join(k + b":" + v for k, v in out)
    assert b"client" not in flat and b"s=1" not in flat and b"Basic" not in flat
    assert (b"api-key", b"azure-relay") in out


def test_static_headers_replace_the_clients_of_that_name():
    client = [(b"Host", b"relay"), (b"openai-organization", b"org-client"), (b"Accept", b"a")]
    out = upstream_request_headers(
        client, b"h", 0, b"r", (b"Authorization", b"Bearer k"), [(b"OpenAI-Organization", b"org-x")]
    )
    assert out == [
        (b"Host", b"h"),
        (b"Accept", b"a"),
        (b"OpenAI-Organization", b"org-x"),
        (b"Authorization", b"Bearer k"),
        (b"X-Request-Id", b"r"),
        (b"Content-Length", b"0"),
    ]


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

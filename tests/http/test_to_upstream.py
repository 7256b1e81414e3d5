"""relay/http/to_upstream.py: the head an upstream gets from a client's, what is stripped, what is
added (the relay's own key, static headers)."""

from __future__ import annotations

import h11

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

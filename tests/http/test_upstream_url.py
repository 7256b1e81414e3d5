"""Unit tests for relay/http/upstream_url.py: URL -> address, Host header, path prefix joining."""

from __future__ import annotations

import pytest

from relay.http.upstream_url import TargetError, parse_target


@pytest.mark.parametrize(
    "url,scheme,host,port,host_header,prefix",
    [
        ("http://127.0.0.1:8081", "http", "127.0.0.1", 8081, b"127.0.0.1:8081", b""),
        ("http://llm", "http", "llm", 80, b"llm", b""),
        ("http://llm:443", "http", "llm", 443, b"llm:443", b""),
        ("https://api.example.com", "https", "api.example.com", 443, b"api.example.com", b""),
        ("https://api.example.com/", "https", "api.example.com", 443, b"api.example.com", b""),
        (
            "https://api.example.com:443/v1",
            "https",
            "api.example.com",
            443,
            b"api.example.com",
            b"/v1",
        ),
        ("https://h:8443/api/v1/", "https", "h", 8443, b"h:8443", b"/api/v1"),
        ("https://h:80", "https", "h", 80, b"h:80", b""),
        ("http://[::1]:9000/x", "http", "::1", 9000, b"[::1]:9000", b"/x"),
        ("https://[::1]", "https", "::1", 443, b"[::1]", b""),
    ],
)
def test_parse(url, scheme, host, port, host_header, prefix):
    t = parse_target(url)
    assert (t.scheme, t.host, t.port, t.host_header, t.prefix) == (
        scheme,
        host,
        port,
        host_header,
        prefix,
    )
    assert t.tls == (scheme == "https")


@pytest.mark.parametrize(
    "url",
    [
        "ftp://h",
        "https://",
        "http://h?x",
        "http://h/#x",
        "http://u@h",
        "http://h/a/./b",
        "http://h/a/../b",
        "http://h:0",
        "http://h/%2e%2e",
    ],
)
def test_parse_refuses(url):
    with pytest.raises(TargetError):
        parse_target(url)


@pytest.mark.parametrize(
    "prefix,client,sent",
    [
        # no prefix: the client's target unchanged, whatever it is
        ("", b"/v1/chat/completions", b"/v1/chat/completions"),
        ("", b"/x/../y?q=1", b"/x/../y?q=1"),
        # the OpenAI base-URL rule: a prefix ending in /v1 does not double /v1
        ("/v1", b"/v1/chat/completions", b"/v1/chat/completions"),
        ("/api/v1", b"/v1/chat/completions", b"/api/v1/chat/completions"),
        ("/api/v1", b"/v1/models?limit=5", b"/api/v1/models?limit=5"),
        ("/api/v1", b"/v1", b"/api/v1"),
        ("/api/v1", b"/v1?x=1", b"/api/v1?x=1"),
        # a client path without /v1 is put under the prefix as is
        ("/api/v1", b"/chat/completions", b"/api/v1/chat/completions"),
        ("/api/v1", b"/health", b"/api/v1/health"),
        ("/api/v1", b"/v10/x", b"/api/v1/v10/x"),  # "/v10" is not "/v1/"
        ("/api/v1", b"/v1beta/x", b"/api/v1/v1beta/x"),
        # a prefix not ending in /v1 keeps the client's /v1
        ("/llama", b"/v1/chat/completions", b"/llama/v1/chat/completions"),
        ("/openai/v1beta", b"/v1/chat/completions", b"/openai/v1beta/v1/chat/completions"),
        ("/api/v1", b"/", b"/api/v1/"),
        # absolute-form request target: its path part
        ("/api/v1", b"http://relay.test/v1/chat/completions", b"/api/v1/chat/completions"),
        # escaped characters pass as they came
        ("/api", b"/v1/chat/%63ompletions", b"/api/v1/chat/%63ompletions"),
    ],
)
def test_join(prefix, client, sent):
    t = parse_target("https://h" + prefix)
    assert t.join(client) == sent


@pytest.mark.parametrize(
    "client", [b"/../admin", b"/v1/../../admin", b"/v1/%2e%2e/x", b"/%2E%2E/x", b"/./x", b"*"]
)
def test_join_refuses_what_could_leave_the_prefix(client):
    t = parse_target("https://h/api/v1")
    with pytest.raises(TargetError):
        t.join(client)

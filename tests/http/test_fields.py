"""relay/http/fields.py: the hop-by-hop set, header lookup and token lists."""

from __future__ import annotations

from relay.http.fields import HOP_BY_HOP, get, has_token


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


def test_get_and_has_token():
    h = [(b"Content-Type", b"a"), (b"content-type", b"b"), (b"Connection", b"Keep-Alive, Close")]
    assert get(h, b"content-type") == b"a"
    assert get(h, b"x-missing") is None
    assert has_token(h, b"connection", b"close")
    assert has_token(h, b"connection", b"keep-alive")
    assert not has_token(h, b"connection", b"upgrade")
    assert not has_token(h, b"content-type", b"close")
    assert has_token([(b"TE", b"gzip ,chunked")], b"te", b"chunked")

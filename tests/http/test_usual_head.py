"""relay/http/usual_head.py without sockets, h11 as the oracle: a head it takes is what h11
reads of the same bytes (`fields.request_head` of h11's Request), field for field; any other
head is left to h11 (None)."""

from __future__ import annotations

import h11
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.http import usual_head
from relay.http.fields import request_head

LIMIT = 16 * 1024
BODY = b'{"model":"m"}'


def h11_request(data: bytes) -> tuple[h11.Request, bytes, bytes] | None:
    """What h11 (as a server) reads of `data`: the request, its body, the bytes after it; None
    when it refuses the bytes or needs more."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=LIMIT)
    conn.receive_data(data)
    body = b""
    try:
        ev = conn.next_event()
        if not isinstance(ev, h11.Request):
            return None
        req = ev
        while True:
            ev = conn.next_event()
            if isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                return req, body, conn.trailing_data[0]
            else:
                return None
    except h11.RemoteProtocolError:
        return None


def same(data: bytes) -> usual_head.Head | None:
    """usual_head's reading of `data`, checked against h11's when it takes the head."""
    head = usual_head.read(data, LIMIT)
    if head is None:
        return None
    oracle = h11_request(data)
    assert oracle is not None, data
    req, body, rest = oracle
    mine, theirs = head.request, request_head(req)
    assert (mine.method, mine.target, mine.http_version) == (
        req.method,
        req.target,
        req.http_version,
    )
    assert mine.headers == req.headers.raw_items() == theirs.headers
    assert (
        mine.headers.lows == [low for _, low, _ in req.headers._full_items] == theirs.headers.lows
    )
    end = head.body_at + head.length
    assert data[head.body_at : end] == body and data[end:] == rest
    return head


def test_the_usual_head_is_read_as_h11_reads_it():
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: relay:8080\r\n"
        b"Content-Type: application/json\r\nAuthorization: Bearer k\r\n"
        b"Content-Length: %d\r\n\r\n%sGET /next HTTP/1.1\r\n" % (len(BODY), BODY)
    )
    head = same(data)
    assert head is not None and head.length == len(BODY)
    assert head.request.headers[1] == (b"Content-Type", b"application/json")


def test_a_bodiless_and_an_http10_head_are_read():
    assert same(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") is not None
    assert same(b"GET / HTTP/1.0\r\n\r\n") is not None
    assert same(b"GET / HTTP/1.1\r\nHost: x\r\nX-Empty:\r\nX-Sp:  a b \t\r\n\r\n") is not None


# Each of these is h11's to read (or to refuse): usual_head leaves it alone.
LEFT_TO_H11 = [
    b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n",  # a blank line first
    b"GET / HTTP/1.1\nHost: x\n\n",  # bare LF
    b"GET / HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n",  # a bare CR
    b"GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n",  # obs-fold
    b"GET / HTTP/1.1\r\n\r\n",  # no Host
    b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",  # two
    b"GET / HTTP/2.0\r\nHost: x\r\n\r\n",
    b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nab",
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 2\r\n\r\nab",
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab",
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n\r\nab",
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1" + b"0" * 20 + b"\r\n\r\n",
    b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n",
    b"G@T / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHo st: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\n",  # unfinished
]


def test_what_is_not_the_usual_head_is_left_to_h11():
    for data in LEFT_TO_H11:
        assert usual_head.read(data, LIMIT) is None, data


def test_a_head_past_the_bound_is_left_to_h11():
    data = b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 100 + b"\r\n\r\n"
    assert usual_head.read(data, 64) is None
    assert usual_head.read(data, LIMIT) is not None


_token = st.text(
    alphabet="-!#$%&'*+.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    min_size=1,
    max_size=8,
)
_junk = st.sampled_from(
    ["", " ", "\t", ":", "\r", "\n", "\r\n", "\x00", "\x7f", "\x80", "é", ",", "  x", "0"]
)
_names = st.one_of(
    _token,
    st.sampled_from(
        [
            "Host",
            "host",
            "Content-Length",
            "content-length",
            "Transfer-Encoding",
            "Expect",
            "Upgrade",
            "Connection",
            "X-Api-Key",
        ]
    ),
)


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    method = draw(st.one_of(st.sampled_from(["GET", "POST", "CONNECT"]), _token))
    target = draw(st.sampled_from(["/", "/v1/chat/completions", "*", "http://a/b", "/a b"]))
    version = draw(st.sampled_from(["1.1", "1.0", "2.0", "1.x"]))
    lines = [f"{method} {target} HTTP/{version}"]
    for _ in range(draw(st.integers(0, 5))):
        name = draw(_names) + draw(_junk)
        value = draw(st.sampled_from(["", "x", "5", "5, 5", " 7 ", "chunked", "100-continue"]))
        lines.append(f"{name}:{draw(_junk)}{value}{draw(_junk)}")
    sep = draw(st.sampled_from(["\r\n", "\r\n", "\r\n", "\n"]))
    body = draw(st.sampled_from(["", "ab", "abcde", "0\r\n\r\n"]))
    return (sep.join(lines) + sep + sep + body).encode("utf-8", "surrogatepass")


@settings(max_examples=3000, deadline=None)
@given(heads())
def test_every_head_usual_head_takes_is_h11s_request(data: bytes):
    same(data)


_vchar = st.text(alphabet=[chr(c) for c in range(0x21, 0x7F)] + ["é"], min_size=1, max_size=6)
_value = st.lists(_vchar, min_size=0, max_size=3).map(" ".join)


@st.composite
def usual_heads(draw: st.DrawFn) -> bytes:
    """Mostly the usual kind: h11's grammar, one Host, a Content-Length or none."""
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS"]))
    version = draw(st.sampled_from(["1.1", "1.1", "1.0"]))
    lines = [f"{method} /{draw(_vchar)} HTTP/{version}", f"Host: {draw(_vchar)}"]
    for _ in range(draw(st.integers(0, 6))):
        lines.append(
            f"{draw(_token)}:{draw(st.sampled_from(['', ' ', '  ', chr(9)]))}{draw(_value)}"
        )
    body = draw(st.binary(max_size=12))
    if draw(st.booleans()):
        lines.append(f"Content-Length: {len(body)}")
    order = draw(st.permutations(lines[1:]))
    tail = draw(st.sampled_from([b"", b"GET / HTTP/1.1\r\n"]))
    return ("\r\n".join([lines[0], *order]) + "\r\n\r\n").encode() + body + tail


@settings(max_examples=3000, deadline=None)
@given(usual_heads())
def test_the_usual_heads_are_h11s_requests(data: bytes):
    same(data)

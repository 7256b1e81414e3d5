"""relay/http/response_head.py held to h11 as the oracle (DESIGN: "it is held to h11 as the
oracle by tests").

Random response heads - odd status lines and reason phrases, odd header names, values and
whitespace, obs-fold, bare LFs, Content-Length / Transfer-Encoding combinations, interim 1xx
heads - go to `parse_response_head` and to an `h11.Connection(CLIENT)` that sent a request:
  * wherever h11 refuses, head.py refuses;
  * where both accept, the status, reason and headers agree;
  * what head.py accepts frames one way: `framing.upstream_body` takes it, and the head
    `headers.client_response` builds from it has never Content-Length and Transfer-Encoding
    together and is itself a head h11 accepts;
  * the same bytes split anywhere across reads give the same result as fed whole.
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.http import response_framing as framing
from relay.http.response_head import MAX_HEAD, BadHead, HeadReader, parse_response_head
from relay.http.to_client import client_response

SETTINGS = settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def mostly(good, odd, odds: int = 4, of: int = 10):
    """`good` about (of - odds) times in `of`, `odd` otherwise."""
    return st.integers(0, of - 1).flatmap(lambda i: good if i < of - odds else odd)


ODD = b'\x00\x01\x08\t\x0b\x0c\x0e\x1b\x1f\x7f\x80\xff \r\n:;,"=/'
odd_text = st.binary(max_size=12).map(lambda b: bytes(ODD[x % len(ODD)] for x in b))
word = st.sampled_from([b"OK", b"Continue", b"Not Found", b"", b"x", b"caf\xe9", b"a\tb"])
text = mostly(
    word, st.one_of(odd_text, st.lists(st.one_of(word, odd_text), max_size=3).map(b"".join))
)

version = mostly(
    st.sampled_from([b"HTTP/1.1"] * 3 + [b"HTTP/1.0"]),
    st.sampled_from([b"HTTP/2.0", b"HTTP/1.2", b"http/1.1", b"HTTP/1.1 ", b"HTTP/11", b""]),
    1,
)
code = mostly(
    st.sampled_from([200] * 8 + [100, 101, 103, 199, 204, 205, 304, 404, 500, 999]).map(
        lambda c: b"%d" % c
    ),
    st.sampled_from([b"20", b"2000", b"099", b"1xx", b"", b" 200", b"+20"]),
    1,
)
status_line = st.builds(
    lambda v, sep, c, r: v + sep + c + r,
    version,
    mostly(st.just(b" "), st.sampled_from([b"  ", b"\t"]), 1),
    code,
    st.one_of(st.just(b""), st.builds(lambda r: b" " + r, text)),
)

benign_name = st.sampled_from(
    [b"Content-Type", b"Connection", b"X-A", b"X_B", b"Server", b"!#$%&'*+-.^_`|~", b"set-COOKIE"]
)
framing_name = st.sampled_from(
    [
        b"Content-Length",
        b"content-length",
        b"CONTENT-LENGTH",
        b"Transfer-Encoding",
        b"transfer-encoding",
    ]
)
odd_name = st.one_of(
    st.sampled_from([b"", b"Bad Name", b"X\x00", b"X:Y", b" X", b"X ", b"\xe9"]), odd_text
)
cl_value = st.one_of(
    st.integers(0, 10**20).map(lambda n: b"%d" % n),
    st.sampled_from(
        [b"5, 5", b"5,7", b"+5", b"-1", b"0x5", b"", b" 5 ", b"1" * 19, b"9" * 300, b"5\t"]
    ),
)
te_value = st.sampled_from(
    [
        b"chunked",
        b"Chunked",
        b" chunked ",
        b"gzip",
        b"gzip, chunked",
        b"chunked, gzip",
        b"identity",
        b"chunked,",
        b"",
        b"chunked\x00",
    ]
)
ows = st.sampled_from([b"", b" ", b" ", b" ", b"  ", b"\t", b" \t"])
eol = mostly(st.just(b"\r\n"), st.sampled_from([b"\n", b"\r", b"\r\r\n"]), 1, 40)


def line(name, value, end=eol):
    return st.builds(lambda n, a, v, b, e: n + b":" + a + v + b + e, name, ows, value, ows, end)


header_line = mostly(
    line(benign_name, word, st.just(b"\r\n")),
    st.one_of(
        line(framing_name, st.one_of(cl_value, te_value)),
        line(st.one_of(benign_name, odd_name), text),
        st.builds(lambda f, e: f + e, st.sampled_from([b" folded", b"\tfolded", b" "]), eol),
    ),
    3,
)


@st.composite
def one_head(draw, final: bool) -> bytes:
    line = (
        draw(status_line)
        if final
        else draw(
            st.sampled_from(
                [
                    b"HTTP/1.1 100 Continue",
                    b"HTTP/1.1 103 Early Hints",
                    b"HTTP/1.1 100",
                    b"HTTP/1.0 102 Processing",
                ]
            )
        )
    )
    lines = draw(st.lists(header_line, max_size=6 if final else 2))
    if final and draw(st.booleans()):  # the usual shape, a framing header or two
        lines += draw(
            st.lists(
                st.sampled_from(
                    [
                        b"Content-Length: 5\r\n",
                        b"Transfer-Encoding: chunked\r\n",
                        b"Content-Length: 7\r\n",
                        b"Transfer-Encoding: gzip\r\n",
                        b"Content-Type: text/event-stream\r\n",
                    ]
                ),
                max_size=3,
            )
        )
    return line + draw(eol) + b"".join(lines) + b"\r\n"


@st.composite
def response(draw) -> bytes:
    interim = draw(
        mostly(
            st.lists(one_head(False), max_size=2),
            st.lists(one_head(False), min_size=7, max_size=10),
            1,
        )
    )
    return b"".join(interim) + draw(one_head(True)) + draw(st.sampled_from([b"", b"hello"]))


def h11_reads(data: bytes):
    """('ok', response) | ('refused', None) | ('more', None) as h11's client sees `data`."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
    conn.send(
        h11.Request(
            method=b"POST",
            target=b"/v1/chat/completions",
            headers=[(b"Host", b"up"), (b"Content-Length", b"0")],
        )
    )
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    try:
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                return "more", None
            if isinstance(ev, h11.Response):
                return "ok", ev
    except h11.RemoteProtocolError:
        return "refused", None


def head_py_reads(data: bytes):
    try:
        got = parse_response_head(data)
    except BadHead:
        return "refused", None
    return ("more", None) if got is None else ("ok", got)


def fields(head) -> tuple:
    return (head.http_version, head.status_code, head.reason, list(head.headers))


@SETTINGS
@given(response())
def test_head_py_refuses_whatever_h11_refuses_and_agrees_where_both_accept(data):
    mine, got = head_py_reads(data)
    theirs, ev = h11_reads(data)
    if theirs == "refused":
        assert mine == "refused", (data, fields(got[0]) if got else None)
    if mine == "ok" and theirs == "ok":
        head, used = got
        assert head.status_code == ev.status_code
        assert head.http_version == ev.http_version
        assert head.reason == ev.reason
        assert [(k, v) for k, v in head.headers] == [(raw, v) for raw, v in ev.headers.raw_items()]
        assert data[used:] in (b"", b"hello")
    if mine == "ok":
        assert theirs == "ok", data  # head.py never accepts what h11 would not read as one


@SETTINGS
@given(response(), st.lists(st.integers(0, 4000), max_size=8))
def test_any_split_across_reads_reads_the_same_as_whole(data, cuts):
    whole = head_py_reads(data)
    cuts = sorted({c % (len(data) + 1) for c in cuts})
    reader, out, refused = HeadReader(), None, False
    sent = 0
    try:
        for a, b in zip([0] + cuts, cuts + [len(data)]):
            out = reader.feed(data[a:b])
            sent = b
            if out is not None:
                break
    except BadHead:
        refused = True
    if whole[0] == "refused":
        assert refused
    elif whole[0] == "more":
        assert out is None and not refused
    else:
        assert not refused and out is not None
        head, used = whole[1]
        assert fields(out[0]) == fields(head)
        assert out[1] + data[sent:] == data[used:]


@SETTINGS
@given(response(), st.sampled_from([b"POST", b"HEAD", b"GET"]), st.booleans(), st.booleans())
def test_an_accepted_head_frames_one_way_and_the_client_head_is_valid(
    data, method, http11, keep_alive
):
    mine, got = head_py_reads(data)
    if mine != "ok":
        return
    head = got[0]
    kind, _ = framing.upstream_body(method, head.status_code, head.headers)  # never raises
    mode = framing.carriage(kind, http11)
    out = client_response(
        head.status_code,
        head.reason or b"OK",
        head.headers,
        b"rid",
        framing.client_chunked(kind, mode),
        keep_alive,
    )
    names = [line.split(b":", 1)[0].lower() for line in out.split(b"\r\n")[1:] if line]
    assert not (b"content-length" in names and b"transfer-encoding" in names), out
    assert names.count(b"content-length") <= 1 and names.count(b"transfer-encoding") <= 1
    if head.status_code == 204:
        assert b"content-length" not in names
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=method, target=b"/", headers=[(b"Host", b"relay")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(out)
    assert isinstance(conn.next_event(), h11.Response)


@pytest.mark.parametrize("n,ok", [(8, True), (9, False)])
def test_interim_heads_are_bounded_in_number(n, ok):
    data = b"HTTP/1.1 100 Continue\r\n\r\n" * n + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    if ok:
        assert parse_response_head(data)[0].status_code == 200
    else:
        with pytest.raises(BadHead, match="interim"):
            parse_response_head(data)


def test_all_heads_together_are_bounded_by_max_head():
    pad = b"X-Pad: " + b"p" * 8000 + b"\r\n"
    interim = b"HTTP/1.1 100 Continue\r\n" + pad * 3 + b"\r\n"  # ~24 KB each
    final = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    assert parse_response_head(interim * 2 + final) is not None
    with pytest.raises(BadHead, match="too large"):
        parse_response_head(interim * 3 + final)
    reader = HeadReader()  # the same, one byte per read: refused as soon as it is too large
    with pytest.raises(BadHead, match="too large"):
        for i, b in enumerate(interim * 3 + final):  # noqa: B007 - read after the loop
            reader.feed(bytes([b]))
    assert i < MAX_HEAD + 1


def test_a_head_split_in_single_bytes_is_read_in_linear_time():
    import time

    data = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"
        + b"X-Pad: "
        + b"p" * (MAX_HEAD - 200)
        + b"\r\nContent-Length: 2\r\n\r\nok"
    )
    reader = HeadReader()
    t = time.process_time()
    out = None
    for i in range(len(data)):
        out = reader.feed(data[i : i + 1]) or out
        if out:
            break
    assert time.process_time() - t < 1.0
    assert out[0].status_code == 200 and out[1] == b"" and i == len(data) - 3

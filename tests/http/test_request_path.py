"""The per-request shortcuts of issue 15 part 4 agree with the plain code they replace.

Each cheaper form is held to the form it stands in for, on generated input: headers looked up
by their kept lower-case names (`headers.HeaderList`) against a scan that lowers every name;
`timing.round3` against `round(v, 3)`; the remembered route path against `normalize`; the
access line's fields and the store's row read off the `Record` against the dicts they were
built from before; the response head's framing check on its fast path against the loop.
"""

from __future__ import annotations

import math
import random

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.http import fields as hdr
from relay.http import request_path as paths
from relay.http import response_head as head_mod
from relay.http.response_head import BadHead, HeadReader
from relay.http.to_client import client_response
from relay.http.to_upstream import upstream_request_headers
from relay.observe.record import LOG_FIELDS, Record, _log_values, user_agent
from relay.observe.row_timings import round3
from relay.store.schema import COLUMNS
from relay.store.sqlite import Store

SETTINGS = settings(max_examples=400, deadline=None, derandomize=True)

NAMES = [
    b"Connection",
    b"connection",
    b"CONNECTION",
    b"Content-Length",
    b"content-type",
    b"Transfer-Encoding",
    b"User-Agent",
    b"user-agent",
    b"X-Request-Id",
    b"Origin",
    b"Authorization",
    b"x-api-key",
    b"Keep-Alive",
    b"X-Hop",
    b"Accept",
    b"Expect",
]
VALUES = [
    b"close",
    b"keep-alive, X-Hop",
    b" Close ",
    b"x-hop",
    b"",
    b"1",
    b"chunked",
    b"application/json",
    b"ua/1 \x01\x7f\xe9",
    b"sk-1",
    b"100-continue",
    b"a, , b",
]
pairs = st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(VALUES)), max_size=10)


def as_header_list(items) -> hdr.HeaderList:
    return hdr.header_list(items, [k.lower() for k, _ in items])


@SETTINGS
@given(
    pairs,
    st.sampled_from([n.lower() for n in NAMES] + [b"absent"]),
    st.sampled_from([b"close", b"keep-alive", b"x-hop", b"b"]),
)
def test_header_list_lookups_agree_with_a_plain_scan(items, name, token):
    kept = as_header_list(items)
    assert kept == items
    assert hdr.get(kept, name) == hdr.get(list(items), name)
    assert hdr.has_token(kept, name, token) == hdr.has_token(list(items), name, token)
    assert hdr.connection_tokens(kept) == hdr.connection_tokens(list(items))
    assert user_agent(kept) == user_agent(list(items))
    for chunked in (False, True):
        assert client_response(200, b"OK", kept, b"rid", chunked, True) == client_response(
            200, b"OK", list(items), b"rid", chunked, True
        )
    for creds in (False, True):
        assert upstream_request_headers(
            kept, b"h:1", 3, b"rid", None, [(b"X-S", b"1")], pass_credentials=creds
        ) == upstream_request_headers(
            list(items), b"h:1", 3, b"rid", None, [(b"X-S", b"1")], pass_credentials=creds
        )


def test_request_headers_come_from_h11_with_its_lower_case_names():
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(
        b"POST /v1/x HTTP/1.1\r\nHost: a\r\nUser-AGENT: ua\r\nX-Dup: 1\r\n"
        b"x-dup: 2\r\nContent-Length: 0\r\n\r\n"
    )
    ev = conn.next_event()
    kept = hdr.request_headers(ev.headers)
    assert kept == ev.headers.raw_items()
    assert kept.lows == [b"host", b"user-agent", b"x-dup", b"x-dup", b"content-length"]
    assert hdr.get(kept, b"x-dup") == b"1"  # the first of several
    assert user_agent(kept) == "ua"


def _old_user_agent(headers):  # what observe.record did before it read HeaderList names
    for k, v in headers:
        if k.lower() == b"user-agent":
            text = v[:200].decode("latin-1")
            return "".join(c if " " <= c != "\x7f" else "?" for c in text)
    return None


@SETTINGS
@given(st.binary(max_size=300))
def test_user_agent_is_cleaned_as_before(value):
    items = [(b"User-Agent", value)]
    assert user_agent(as_header_list(items)) == _old_user_agent(items)


@SETTINGS
@given(st.floats(min_value=-1e9, max_value=1e9, allow_nan=False))
def test_round3_is_round_to_three_digits(v):
    assert round3(v) == round(v, 3)
    assert math.copysign(1, round3(v)) == math.copysign(1, round(v, 3)) or round3(v) == 0


def test_round3_on_ties_and_measured_times():
    rnd = random.Random(15)
    values = [k / 2000 for k in range(-4000, 4000)]  # every x.xxx5 tie and its neighbours
    values += [k / 16 for k in range(-1000, 1000)]  # ties exact in binary
    values += [rnd.random() * 10 ** rnd.randint(-3, 7) for _ in range(200_000)]
    values += [(rnd.random() * 5.0) * 1000 for _ in range(100_000)]  # seconds -> ms
    assert [round3(v) for v in values] == [round(v, 3) for v in values]


def test_route_path_is_normalize_bounded_and_stays_bounded(monkeypatch):
    monkeypatch.setattr(paths, "_SEEN", {})
    targets = [
        b"/v1/chat/completions",
        b"/v1//chat/%63ompletions?x=1",
        b"/a/../b/",
        b"http://h/v1/models",
        b"/" + b"x" * 5000,
    ]
    for t in targets * 2:
        assert paths.route_path(t) == paths.bounded(paths.normalize(t), paths.MAX_PATH_CHARS)
    assert b"/" + b"x" * 5000 not in paths._SEEN  # long targets are not kept
    for i in range(paths._SEEN_MAX * 3):
        paths.route_path(b"/p/%d" % i)
        assert len(paths._SEEN) <= paths._SEEN_MAX


def _record(**over) -> Record:
    rec = Record(
        ts=1.5,
        request_id="r1",
        path="/v1/chat/completions",
        method="POST",
        model="m",
        stream=True,
        status=200,
        ok=True,
        ttft_ms=1.25,
        total_ms=9.5,
        client_closed=False,
        user_agent="ua",
        outcome="done",
    )
    for k, v in over.items():
        setattr(rec, k, v)
    return rec


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"key_id": "k", "error": "e", "ok": False},
        {"stream": False, "itl_hist": "x", "bytes_out": 0},
    ],
)
def test_log_fields_are_the_non_none_fields_in_order(over):
    rec = _record(**over)
    want = {k: v for k, v in zip(LOG_FIELDS, _log_values(rec)) if v is not None}
    got = rec.log_fields()
    assert got == want and list(got) == list(want)


def test_a_record_put_straight_stores_the_same_row_as_its_dict(tmp_path):
    store = Store(str(tmp_path / "a.db"))
    store.start()
    try:
        recs = [
            _record(),
            _record(
                key_id="k", ok=False, status=502, error_code="x", client_closed=True, stream=False
            ),
        ]
        for rec in recs:
            store.put(rec.row() | {"admission_id": None})
            store.put_record(rec, None)
        store.flush()
        rows = store.query("SELECT * FROM request ORDER BY rowid")
    finally:
        store.close()
    assert len(rows) == 4
    assert rows[0] == rows[1] and rows[2] == rows[3]
    assert [rows[2][c] for c in ("stream", "ok", "client_closed")] == [0, 0, 1]
    assert set(rows[0]) >= set(COLUMNS)


BAD_CL = "bad Content-Length "
UNKNOWN_TE = "upstream sent unknown Transfer-Encoding "
FRAMING_HEADS = [  # (version, headers, the refusal or None), the refusals written out
    (b"1.1", [(b"Content-Length", b"12")], None),
    (b"1.1", [(b"content-length", b"1x")], BAD_CL + "b'1x'"),
    (b"1.1", [(b"Content-Length", b"1" * 19)], BAD_CL + "b'1111111111111111111'"),
    (b"1.1", [(b"Transfer-Encoding", b"chunked")], None),
    (b"1.1", [(b"Transfer-Encoding", b"gzip")], UNKNOWN_TE + "b'gzip'"),
    (b"1.1", [(b"Transfer-Encoding", b"CHUNKED")], None),
    (b"1.1", [(b"transfer-encoding", b"chunked")], None),
    (b"1.1", [(b"TRANSFER-ENCODING", b"Chunked")], None),
    (
        b"1.0",
        [(b"TRANSFER-ENCODING", b"Chunked")],
        "upstream sent Transfer-Encoding in an HTTP/1.0 response",
    ),
    (b"1.1", [(b"CONTENT-LENGTH", b"+5")], BAD_CL + "b'+5'"),
    (
        b"1.0",
        [(b"Transfer-Encoding", b"chunked")],
        "upstream sent Transfer-Encoding in an HTTP/1.0 response",
    ),
    (b"1.0", [(b"Transfer-Encoding", b"gzip")], UNKNOWN_TE + "b'gzip'"),
    (b"1.1", [(b"Server", b"x")], None),
    (b"1.1", [(b"Transfer-Encoding", b"gzip"), (b"Content-Length", b"x")], UNKNOWN_TE + "b'gzip'"),
    (b"1.1", [(b"Content-Length", b"x"), (b"Transfer-Encoding", b"gzip")], BAD_CL + "b'x'"),
    (
        b"1.1",
        [(b"Content-Length", b"1"), (b"Content-Length", b"1")],
        "upstream sent several Content-Length headers",
    ),
    (
        b"1.1",
        [(b"Transfer-Encoding", b"Chunked"), (b"Content-Length", b"1")],
        'upstream sent "Content-Length" and "Transfer-Encoding" headers at the same time',
    ),
]


@pytest.mark.parametrize("version,items,want", FRAMING_HEADS)
def test_framing_check_fast_path_says_what_the_loop_says(version, items, want):
    def outcome(headers):
        try:
            head_mod._check_framing(version, headers)
        except BadHead as exc:
            return str(exc)
        return None

    assert outcome(as_header_list(items)) == want
    assert outcome(list(items)) == want


def test_a_parsed_response_head_keeps_its_lower_case_names():
    head, rest = HeadReader().feed(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\nX-A:  v \r\n\r\nbody"
    )
    assert rest == b"body"
    assert head.headers == [
        (b"Content-Type", b"text/event-stream"),
        (b"Transfer-Encoding", b"chunked"),
        (b"X-A", b"v"),
    ]
    assert head.headers.lows == [b"content-type", b"transfer-encoding", b"x-a"]
    assert hdr.get(head.headers, b"x-a") == b"v"


CL, TE = b"Content-Length", b"Transfer-Encoding"
AMBIGUOUS = ("bad_request", "Transfer-Encoding and Content-Length together: ambiguous framing")
NOT_CHUNKED = ("not_implemented", "only a single Transfer-Encoding: chunked is supported")
CONFLICT = ("bad_request", "conflicting Content-Length values")
NOT_A_NUMBER = ("bad_request", "Content-Length is not a number")
REQUEST_FRAMING = [  # (headers, HTTP/1.1, the refusal or None), the refusals written out
    ([], True, None),
    ([(CL, b"1")], True, None),
    ([(b"content-length", b" 1 ")], True, None),
    ([(CL, b"1, 1")], True, None),
    ([(CL, b"1,2")], True, CONFLICT),
    ([(CL, b"x")], True, NOT_A_NUMBER),
    ([(CL, b"")], True, NOT_A_NUMBER),
    ([(CL, b"1"), (b"content-length", b"1")], True, None),
    ([(CL, b"1"), (CL, b"2")], True, CONFLICT),
    ([(b"X-A", b"1,2"), (CL, b"1")], False, None),
    ([(TE, b"chunked")], True, None),
    ([(TE, b"chunked"), (b"X-A", b"x")], True, None),
    ([(TE, b"chunked")], False, ("bad_request", "Transfer-Encoding on an HTTP/1.0 request")),
    ([(TE, b"gzip, chunked")], True, NOT_CHUNKED),
    ([(TE, b"chunked"), (TE, b"chunked")], True, NOT_CHUNKED),
    ([(b"X-A", b"1,2"), (TE, b"")], True, NOT_CHUNKED),
    ([(TE, b"chunked"), (CL, b"1")], True, AMBIGUOUS),
    ([(CL, b"x"), (TE, b"x")], False, AMBIGUOUS),
]


@pytest.mark.parametrize("items,http11,want", REQUEST_FRAMING)
def test_request_framing_fast_path_says_what_the_loop_says(items, http11, want):
    from relay.http.request_framing import framing_error

    def outcome(headers):
        err = framing_error(headers, http11)
        return None if err is None else (err.code, err.message)

    assert outcome(as_header_list(items)) == want
    assert outcome(list(items)) == want


async def test_streamed_requests_leave_no_cyclic_garbage(make_relay):
    """A request's objects are freed by reference counting when it ends: the exchange breaks
    the cycles through its own bound methods (its data_received, the scanner's first-content
    hook, the flow's on_stuck), so the client connection, transports and exchange of every
    request do not wait for the cyclic collector (memory and collector work per request)."""
    import gc

    from relay.proxy.client import ClientConn
    from relay.proxy.exchange import Exchange
    from tests.support import httpc
    from tests.support.helpers import wait_for

    app = await make_relay()
    await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(4))  # warm the pool
    await wait_for(lambda: not app.tasks and not app.clients)
    gc.collect()
    # What an earlier test left alive (a transport's pending close) is not these requests':
    # held here, so that none of them is freed and its id taken by a new one.
    earlier = [o for o in gc.get_objects() if type(o) in (Exchange, ClientConn)]
    gc.disable()
    try:
        for _ in range(5):
            resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(4))
            assert resp.complete and resp.status == 200
        await wait_for(lambda: not app.tasks and not app.clients)
        seen = {id(o) for o in earlier}

        def left() -> list[str]:
            return [
                type(o).__name__
                for o in gc.get_objects()
                if type(o) in (Exchange, ClientConn) and id(o) not in seen
            ]

        # A closed transport holds its protocol until the loop has closed its handle, a pass
        # or so after connection_lost: freed by reference counting, it goes; a cycle, with
        # the collector off, never does.
        try:
            await wait_for(lambda: not left(), timeout=10.0, step=0.05)
        except AssertionError:
            pass
        still = left()
    finally:
        gc.enable()
    assert still == []


# ---- the path a request names (issue 21 item 2): one reading of it for routing and prefixes
@pytest.mark.parametrize(
    "target,path",
    [
        (b"/v1/chat/%63ompletions", "/v1/chat/completions"),  # decoded once, as llama-server
        (b"/v1//chat/./completions/", "/v1/chat/completions"),
        (b"/a/../slots?x=/../..", "/slots"),  # the query is no part of it
        (b"/v1/models/org%2Fname", "/v1/models/org/name"),
        (b"/v1/models/org%252Fname", "/v1/models/org%2Fname"),  # decoded once only
        (b"/v1/x#/../..", "/v1/x"),
        # the same separators and dot segments as the prefix check (`dot_segment_in`)
        (b"/v1/models\\..\\..\\slots", "/slots"),
        (b"/v1/models%5c..%5c..%5cslots", "/slots"),
        (b"/a/..;x/slots", "/slots"),
        (b"/a/.;/slots", "/a/slots"),
        (b"/a/%c0%ae%c0%ae/slots", "/slots"),
        (b"/a/...", "/a/..."),
        # absolute-form: its path, the scheme in any case
        (b"http://h/v1/models", "/v1/models"),
        (b"HTTPS://h:1/v1/models?x", "/v1/models"),
        (b"http://h", "/"),
        (b"http://h?x=/a", "/"),
    ],
)
def test_normalize_reads_the_path_as_the_prefix_check_does(target, path):
    assert paths.normalize(target) == path


@pytest.mark.parametrize(
    "path,dots",
    [
        (b"/v1/chat/completions", False),
        (b"/a.b/.c/c./...", False),
        (b"/a/%2e%2e%2e", False),
        (b"/a/..", True),
        (b"/a/%2e", True),
        (b"/a%2f..", True),
        (b"/a\\..", True),
        (b"/a/%252e%252e", True),
        (b"/a/..;b", True),
        (b"/a/..%00", True),
        (b"/a/%" + b"25" * 7 + b"2e", True),  # `.` after 8 decoding rounds
        (b"/a/%" + b"25" * 7 + b"41", False),  # `A` after 8: decoding stopped there
        (b"/a/%" + b"25" * 8 + b"41", True),  # still changing after 8 rounds
    ],
)
def test_dot_segment_in_follows_every_decoding_round(path, dots):
    assert paths.dot_segment_in(path) is dots

"""Unit tests for relay/stream/sse.py: SseScanner and carries_content, against real captures."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

from relay.http.chunked import ChunkTracker
from relay.stream.sse import SseScanner, carries_content, event_json
from tests.support.fixtures import FIXTURES

SEP = b"======== RESPONSE (raw bytes) ========\n"


def dechunk(body: bytes) -> bytes:
    t = ChunkTracker()
    out, payloads = t.feed(body)
    assert out == body or not t.done
    return b"".join(payloads)


def sse_body(name: str) -> bytes:
    raw = Path(f"{FIXTURES}/{name}").read_bytes()
    head, _, body = raw.partition(SEP)[2].partition(b"\r\n\r\n")
    assert b"text/event-stream" in head
    assert b"transfer-encoding: chunked" in head.lower()
    return dechunk(body)


def last_event_with(body: bytes, marker: bytes) -> bytes:
    return [e for e in body.split(b"\n\n") if marker in e][-1]


# name -> (events, content_events, done_seen, marker of the meta event); events documents
# the capture (SseScanner no longer counts them); llama native's end is its `"stop":true`
EXPECTED = {
    "chat_stream.http": (11, 8, True, b'"timings"'),
    "chat_stream_usage.http": (12, 8, True, b'"usage"'),
    "chat_stream_stopword.http": (8, 5, True, b'"timings"'),
    "completions_stream.http": (7, 4, True, b'"usage"'),
    "completions_stream_usage.http": (7, 5, True, b'"usage"'),
    "native_completion_stream.http": (4, 3, True, b'"timings"'),
    "disconnect_huge_npredict.http": (8, 7, False, None),
}


def test_all_sse_fixtures_covered():
    names = set()
    for path in glob.glob(f"{FIXTURES}/*.http"):
        if b"text/event-stream" in Path(path).read_bytes():
            names.add(path.rsplit("/", 1)[1])
    assert names == set(EXPECTED)


def state(s: SseScanner, calls: list) -> tuple:
    return (
        s.content_events,
        s.done_seen,
        s.error_first,
        s.meta,
        s.oversized,
        tuple(calls),
        s.pending,
        s.first_event,
    )


def scan(reads: list[bytes]) -> tuple:
    calls = []
    s = SseScanner()
    s.on_first_content = lambda: calls.append(s.content_events)
    for r in reads:
        s.feed(r)
    return state(s, calls)


def relay_scan(reads: list[bytes]) -> tuple:
    """Drive tracker + scanner the way proxy.exchange does for a chunked SSE body."""
    calls = []
    s = SseScanner()
    s.on_first_content = lambda: calls.append(s.content_events)
    t = ChunkTracker()
    fwd = b""
    for r in reads:
        spans, ended = t.whole_chunks(r)
        if spans is not None and not ended:
            for i in range(0, len(spans), 2):
                s.feed_span(r, spans[i], spans[i + 1])
            fwd += r
            continue
        out, payloads = t.feed(r)
        fwd += out
        for p in payloads:
            s.feed(p)
    return state(s, calls), fwd, t.done


def expected_result(name: str, body: bytes) -> tuple:
    _, content, done, marker = EXPECTED[name]
    meta = last_event_with(body, marker) if marker else b""
    return (content, done, False, meta, False, (1,), b"", False)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_one_read(name):
    body = sse_body(name)
    assert scan([body]) == expected_result(name, body)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_every_two_way_split(name):
    body = sse_body(name)
    want = expected_result(name, body)
    for i in range(len(body) + 1):
        assert scan([body[:i], body[i:]]) == want, i


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_crlf_every_two_way_split(name):
    lf = sse_body(name)
    body = lf.replace(b"\n", b"\r\n")
    want = expected_result(name, lf)  # meta is kept LF-normalized
    for i in range(len(body) + 1):
        assert scan([body[:i], body[i:]]) == want, i


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_cr_only_lines(name):
    lf = sse_body(name)
    body = lf.replace(b"\n", b"\r")
    assert scan([body]) == expected_result(name, lf)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_byte_by_byte_and_by_chunk(name):
    body = sse_body(name)
    want = expected_result(name, body)
    assert scan([body[k : k + 1] for k in range(len(body))]) == want
    raw = Path(f"{FIXTURES}/{name}").read_bytes()
    chunked_body = raw.partition(SEP)[2].partition(b"\r\n\r\n")[2]
    t = ChunkTracker()
    _, payloads = t.feed(chunked_body)
    assert scan(payloads) == want  # as the relay feeds it: one payload at a time


def test_chat_first_content_is_hello_event():
    body = sse_body("chat_stream.http")
    s = SseScanner()
    seen = []
    s.on_first_content = lambda: seen.append(s.pending)
    first_two = body.split(b"\n\n")
    role, hello = first_two[0], first_two[1]
    assert b'"content":null' in role and b'"content":"Hello"' in hello
    s.feed(role + b"\n\n")
    assert (s.first_event, s.content_events, seen) == (False, 0, [])
    s.feed(hello[:40])
    assert seen == []
    s.feed(hello[40:] + b"\n\n")
    assert (s.content_events, len(seen)) == (1, 1)


# ---- synthetic events -----------------------------------------------------------------------
def ev(obj: str) -> bytes:
    return b"data: " + obj.encode() + b"\n\n"


CHAT = '{"choices":[{"index":0,"delta":{"content":"%s"}}]}'


@pytest.mark.parametrize(
    "event,counts",
    [
        ('{"choices":[{"delta":{"content":"x"}}]}', True),
        ('{"choices":[{"delta":{"content":""}}]}', False),
        ('{"choices":[{"delta":{"role":"assistant","content":null}}]}', False),
        ('{"choices":[{"delta":{}}],"finish_reason":"stop"}', False),
        ('{"choices":[{"text":" Fine","index":0}]}', True),
        ('{"choices":[{"text":"","index":0}]}', False),
        ('{"index":0,"content":" Hello","stop":false}', True),
        ('{"index":0,"content":"","stop":true}', False),
        ('{"choices":[{"delta":{"reasoning_content":"think"}}]}', True),
        ('{"choices":[{"delta":{"reasoning_content":"","content":null}}]}', False),
        (
            '{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"a\\":1}"}}]}}]}',
            True,
        ),
        (
            '{"choices":[{"delta":{"tool_calls":[{"function":{"name":"f","arguments":""}}]}}]}',
            False,
        ),
        ('{"choices":[{"delta":{"content":"\\"q\\""}}]}', True),
        (
            '{"choices":[{"index":0,"delta":{"content":""}},{"index":1,"delta":{"content":"y"}}]}',
            True,
        ),
        ('{"choices":[],"usage":{"completion_tokens":3}}', False),
    ],
)
def test_carries_content(event, counts):
    assert carries_content(b"data: " + event.encode()) is counts
    s = SseScanner()
    s.feed(ev(event))
    assert (s.first_event, s.content_events) == (False, int(counts))


def test_marker_split_between_reads():
    data = ev(CHAT % "tok") * 3
    marker_at = data.index(b'"content":"') + 5
    for i in range(marker_at - 6, marker_at + 12):
        s = SseScanner()
        s.feed(data[:i])
        s.feed(data[i:])
        assert s.content_events == 3 and s.pending == b""


def test_on_first_content_called_once_and_optional():
    calls = []
    s = SseScanner(lambda: calls.append(s.content_events))
    s.feed(ev('{"choices":[{"delta":{"role":"assistant","content":null}}]}'))
    assert calls == []
    s.feed(ev(CHAT % "a") + ev(CHAT % "b"))
    assert calls == [1]
    s.feed(ev(CHAT % "c"))
    assert calls == [1] and s.content_events == 3
    s2 = SseScanner()  # no callback: no error
    s2.feed(ev(CHAT % "a"))
    assert s2.content_events == 1


def test_done_variants_and_not_counted():
    for done in (b"data: [DONE]\n\n", b"data:[DONE]\n\n", b"data: [DONE]\r\n\r\n"):
        s = SseScanner()
        s.feed(ev(CHAT % "a") + done)
        assert (s.done_seen, s.content_events) == (True, 1)
    s = SseScanner()
    s.feed(b"data: [DONE]")  # not terminated: not seen yet
    assert not s.done_seen
    s.feed(b"\n\n")
    assert s.done_seen


def test_error_first():
    s = SseScanner()
    s.feed(b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n')
    assert s.error_first and s.content_events == 0
    s = SseScanner()
    s.feed(ev(CHAT % "a") + b'data: {"error":{"message":"late"}}\n\n')
    assert not s.error_first
    s = SseScanner()
    s.feed(b'data: {"choices":[]}\n\n')
    assert not s.error_first


def test_meta_keeps_last_usage_or_timings_event():
    s = SseScanner()
    first = b'data: {"choices":[],"timings":{"predicted_n":1}}'
    second = b'data: {"choices":[],"usage":{"completion_tokens":2}}'
    s.feed(first + b"\n\n" + ev(CHAT % "x"))
    assert s.meta == first
    s.feed(second + b"\n\n" + b"data: [DONE]\n\n")
    assert s.meta == second


def test_meta_keeps_a_large_event_and_ignores_an_oversized_one():
    # a Responses `response.completed` repeats the output, instructions and tools: 70 KB
    s = SseScanner()
    small = b'data: {"usage":{"completion_tokens":2}}'
    big = b'data: {"usage":{"completion_tokens":3},"pad":"' + b"x" * 70000 + b'"}'
    s.feed(small + b"\n\n" + big + b"\n\n")
    assert s.meta == big and s.meta_first == small and s.content_events == 0
    huge = b'data: {"usage":{"completion_tokens":4},"pad":"' + b"x" * (1 << 20) + b'"}'
    s.feed(huge + b"\n\n")
    assert s.meta == big


def test_oversized_pending_event_given_up():
    s = SseScanner()
    s.feed(b'data: {"x":"' + b"y" * ((1 << 20) + 10))
    assert s.oversized and s.pending == b""


def test_blank_lines_and_comments():
    s = SseScanner()
    s.feed(b"\n\n\n\n: ping\n\n" + ev('{"error":{"message":"x"}}') + b"\n\n\n")
    # a comment (llama-server's ping during prompt processing) dispatches no event: the error
    # is the first event
    assert (s.error_first, s.content_events, s.pending) == (True, 0, b"")
    s.feed(ev(CHAT % "a"))
    assert s.content_events == 1


TWO_LINE = (
    b'id: 7\ndata: {"choices":[{"delta":{"content":"a"}}]}\n'
    b'data: {"usage":{"completion_tokens":1}}\n\n'
)


def test_multiline_event_lf_is_one_event():
    for i in range(len(TWO_LINE) + 1):
        s = SseScanner()
        s.feed(TWO_LINE[:i])
        s.feed(TWO_LINE[i:])
        assert (s.content_events, s.meta) == (1, TWO_LINE[:-2]), i


def test_multiline_event_crlf_every_split_is_one_event():
    data = TWO_LINE.replace(b"\n", b"\r\n")
    for i in range(len(data) + 1):
        s = SseScanner()
        s.feed(data[:i])
        s.feed(data[i:])
        assert (s.content_events, s.meta) == (1, TWO_LINE[:-2]), i


def test_event_json():
    assert event_json(b'data: {"a":1}') == b'{"a":1}'
    assert event_json(b'event: x\ndata:  {"a":1}  ') == b'{"a":1}'
    assert event_json(b"data: [DONE]") is None
    assert event_json(b": comment") is None
    assert event_json(b"") is None


# ---- the hot path: ChunkTracker.single + SseScanner.feed_span ------------------------------
def chunked_body(name: str) -> bytes:
    raw = Path(f"{FIXTURES}/{name}").read_bytes()
    return raw.partition(SEP)[2].partition(b"\r\n\r\n")[2]


def whole_chunks(body: bytes) -> list[bytes]:
    """The body cut at chunk boundaries: one read per chunk, as llama-server writes them."""
    out, pos = [], 0
    while pos < len(body):
        nl = body.index(b"\r\n", pos)
        size = int(body[pos:nl], 16)
        end = nl + 2 + size + 2 if size else body.index(b"\r\n\r\n", nl) + 4
        out.append(body[pos:end])
        pos = end
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_relay_path_one_read_per_chunk(name):
    body = chunked_body(name)
    reads = whole_chunks(body)
    assert b"".join(reads) == body and len(reads) > 3
    got, fwd, done = relay_scan(reads)
    assert got == expected_result(name, sse_body(name))
    assert fwd == body
    assert done is (name != "disconnect_huge_npredict.http")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_relay_path_every_split_of_each_chunk(name):
    """Each chunk read whole except one, which arrives in two reads at every split point."""
    body = chunked_body(name)
    reads = whole_chunks(body)
    want = expected_result(name, sse_body(name))
    for k, chunk in enumerate(reads):
        for i in range(1, len(chunk)):
            split = reads[:k] + [chunk[:i], chunk[i:]] + reads[k + 1 :]
            got, fwd, _ = relay_scan(split)
            assert (got, fwd) == (want, body), (k, i)


def _span_vs_feed(prior: bytes, span: bytes) -> tuple[tuple, tuple]:
    a, b = SseScanner(), SseScanner()
    ca, cb = [], []
    a.on_first_content = lambda: ca.append(a.content_events)
    b.on_first_content = lambda: cb.append(b.content_events)
    a.feed(prior)
    b.feed(prior)
    data = b"1f\r\n" + span + b"\r\n"
    a.feed_span(data, 4, 4 + len(span))
    b.feed(span)
    return state(a, ca), state(b, cb)


@pytest.mark.parametrize(
    "span",
    [
        ev(CHAT % "tok"),
        ev('{"choices":[{"text":" Fine","index":0}]}'),
        ev(CHAT % ""),
        ev('{"choices":[{"text":"","index":0}]}'),
        ev('{"choices":[{"delta":{"reasoning_content":"hm"}}]}'),
        ev(CHAT % "a") + ev(CHAT % "b"),
        ev(CHAT % "a") + b"data: [DONE]\n\n",
        b"data: [DONE]\n\n",
        ev('{"choices":[{"delta":{}}],"timings":{"predicted_n":3}}'),
        ev(CHAT % "a")[:-1],
        ev(CHAT % "a").replace(b"\n", b"\r\n"),
        b"id: 3\n" + ev(CHAT % "a"),
        b": ping\n\n" + ev(CHAT % "a"),
    ],
)
@pytest.mark.parametrize("prior", [b"", ev(CHAT % "first"), b'data: {"choices":[{"delta"'])
def test_feed_span_same_as_feed(prior, span):
    fast, slow = _span_vs_feed(prior, span)
    assert fast == slow


@pytest.mark.parametrize(
    "span",
    [
        ev(
            '{"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
        ),
        ev('{"index":0,"content":" a","stop":false,"timings":{"prompt_n":1,"predicted_n":2}}'),
        ev('{"choices":[],"usage":{"completion_tokens":2}}') + ev(CHAT % "x"),
    ],
)
def test_feed_span_keeps_meta_like_feed(span):
    fast, slow = _span_vs_feed(ev(CHAT % "first"), span)
    assert slow[3] != b""  # the general path keeps the event
    assert fast == slow


class _Rejoining(SseScanner):
    """The scanner as it was before issue 10: the unfinished event re-joined on every read
    (quadratic when one event spans many reads). The reference the linear one is held to."""

    __slots__ = ()

    def feed(self, data: bytes) -> None:
        if self.pending:
            data = self.pending + data
            self.pending = b""
        if b"\r" in data:
            if data.endswith(b"\r") and not data.endswith((b"\r\r", b"\n\r")):
                self.pending = data
                return
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        start = 0
        while True:
            end = data.find(b"\n\n", start)
            if end < 0:
                break
            if end > start:
                self._event(data[start:end])
            start = end + 2
        rest = data[start:]
        if rest.strip(b"\n"):
            self.pending = rest


_BITS = [
    b"data: ",
    b'{"choices":[{"delta":{"content":"a"}}]}',
    b'{"usage":{"x":1}}',
    b"[DONE]",
    b'{"error":{}}',
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b"\r\r",
    b": c",
    b"event: t",
    b"x" * 50,
    b'"content":"',
    b'"text":""',
    b'"timings"',
    b"\n\r",
]


def test_linear_scanner_agrees_with_the_rejoining_one_on_random_splits():
    import random

    rng = random.Random(1010)
    for _ in range(4000):
        body = b"".join(rng.choice(_BITS) for _ in range(rng.randint(1, 40)))
        cuts = sorted(rng.randint(0, len(body)) for _ in range(rng.randint(0, 12)))
        pieces = [body[a:b] for a, b in zip([0] + cuts, cuts + [len(body)])]
        got, want = [], []
        new, old = (
            SseScanner(lambda got=got: got.append(1)),
            _Rejoining(lambda want=want: want.append(1)),
        )
        for p in pieces + [b"x\n\n"]:  # a last event flushes a CR held by either
            new.feed(p)
            old.feed(p)
        assert (
            new.content_events,
            new.done_seen,
            new.error_first,
            new.meta,
            new.first_event,
            bytes(new.pending),
            got,
        ) == (
            old.content_events,
            old.done_seen,
            old.error_first,
            old.meta,
            old.first_event,
            old.pending,
            want,
        ), pieces


def test_one_event_over_many_reads_costs_linear_time():
    import time

    big = b'data: {"choices":[{"delta":{"content":"' + b"x" * (4 << 20) + b'"}}]}\n\n'
    for line_ends in (b"", b"\n"):  # one long line, or many lines (each read has a line end)
        data = big if not line_ends else big.replace(b"x" * 512, b"x" * 511 + b"\n")
        s = SseScanner()
        t = time.process_time()
        for i in range(0, len(data), 1024):
            s.feed(data[i : i + 1024])
        assert time.process_time() - t < 0.5
        assert s.oversized and not s.pending


def test_an_event_under_the_bound_in_many_reads_is_scanned_whole():
    ev = b'data: {"choices":[{"delta":{"content":"' + b"y" * 300000 + b'"}}],"usage":{}}\n\n'
    s = SseScanner()
    for i in range(0, len(ev), 1000):
        s.feed(ev[i : i + 1000])
    assert s.content_events == 1 and not s.oversized and s.pending == b"" and s.meta == ev[:-2]

"""The fast path must agree with the general chunk tracker + SSE scanner on every read it takes.

`fastpath.token_event(data)` non-zero (and `same_shape(data, shape)`, with a shape learned from an
earlier read of the stream) True means the exchange forwards `data` as is, counts one
content event and leaves the tracker and the scanner untouched. So for every such read the
general path, started from the state the fast path requires (between chunks, between events,
after the first content event), must forward the same bytes, count exactly one content event
and end in that same state, with no usage/timings event recorded and no [DONE] seen.
"""

from __future__ import annotations

import random

import pytest

from relay.chunked import SIZE, ChunkTracker
from relay.fastpath import same_shape, shape_of, size_line, token_event
from relay.sse import SseScanner

TOKEN = (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hi"}}],'
         b'"created":1764000000,"id":"chatcmpl-x","model":"m","system_fingerprint":"b1",'
         b'"object":"chat.completion.chunk"}\n\n')
LEGACY = b'data: {"choices":[{"text":" the","index":0,"logprobs":null,"finish_reason":null}]}\n\n'
NAMED = b'event: token\ndata: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'  # two lines, one event


def chunk(payload: bytes, size: int | None = None, size_text: bytes | None = None) -> bytes:
    text = size_text if size_text is not None else b"%x" % (len(payload) if size is None else size)
    return text + b"\r\n" + payload + b"\r\n"


def general(data: bytes):
    """What the general path makes of `data` from the fast path's starting state."""
    tracker = ChunkTracker()
    scanner = SseScanner()
    scanner.first_event = False
    scanner.content_events = 1  # the fast path only runs after the first content event
    out, payloads = tracker.feed(data)
    for p in payloads:
        scanner.feed(p)
    same_state = (tracker.state == SIZE and not tracker.held and not tracker.extra
                  and not scanner.pending and not scanner.meta and not scanner.done_seen
                  and not scanner.oversized)
    return out, scanner.content_events - 1, same_state


def agrees(data: bytes) -> bool:
    try:
        out, counted, same_state = general(data)
    except ValueError:  # broken framing: the fast path must not have taken it
        return False
    return out == data and counted == 1 and same_state


@pytest.mark.parametrize("data", [
    chunk(TOKEN),
    chunk(LEGACY),
    chunk(TOKEN, size_text=b"%X" % len(TOKEN)),  # upper-case hex
    chunk(b'data: {"choices":[{"delta":{"content":"{"}}]}\n\n'),  # a brace as the token
    chunk(NAMED),
])
def test_usual_reads_take_the_fast_path(data):
    assert token_event(data) > 0
    assert agrees(data)


@pytest.mark.parametrize("data", [
    chunk(TOKEN) + chunk(TOKEN),                                        # two chunks
    chunk(TOKEN + TOKEN),                                               # two events
    chunk(TOKEN)[:-1],                                                  # chunk not whole
    chunk(TOKEN, size=len(TOKEN) - 1),                                  # wrong size
    chunk(TOKEN, size_text=b"0x%x" % len(TOKEN)),                       # not plain hex
    chunk(TOKEN, size_text=b"%x;ext=1" % len(TOKEN)),                   # chunk extension
    chunk(TOKEN.replace(b'"Hi"', b'""')),                               # empty content
    chunk(TOKEN.replace(b'"object"', b'"usage":{"a":1},"object"')),     # usage after
    chunk(TOKEN.replace(b'{"choices"', b'{"usage":{"a":1},"choices"')),  # usage before
    chunk(TOKEN.replace(b'{"choices"', b'{"timings":{"a":1},"choices"')),
    chunk(TOKEN.replace(b'"object"', b'"usage":null,"object"')),         # null usage
    chunk(TOKEN.replace(b'"Hi"', b'"a"}\r\rdata: {"content":"b"')),     # CR CR ends an event
    chunk(TOKEN.replace(b'"Hi"', b'"a"}\rdata: {"x":"b"')),             # a lone CR line end
    chunk(TOKEN.replace(b"\n\n", b"\r\n\n")),                           # (any CR: general)
    chunk(b"data: [DONE]\n\n"),
    chunk(TOKEN[:-1]),                                                  # event not ended
    b"0\r\n\r\n",                                                       # the last chunk
])
def test_anything_else_takes_the_general_path(data):
    assert token_event(data) == 0


_PIECES = [b'"content":"', b'"content":""', b'"text":"', b'"reasoning_content":"', b'"usage"',
           b'"timings"', b'{', b'}', b'\r', b'\n', b'\r\n', b'\n\n', b'data: ', b'[DONE]', b'"',
           b'x', b'Hi', b':', b'event: e\n', b'\\"', b' ']


def _random_read(rng: random.Random) -> bytes:
    base = rng.choice([TOKEN, LEGACY, NAMED, TOKEN.replace(b"\n\n", b"\r\n\n")])
    payload = bytearray(base)
    for _ in range(rng.randint(0, 3)):  # splice fragments in at random places
        at = rng.randint(0, len(payload))
        payload[at:at] = rng.choice(_PIECES)
    if rng.random() < 0.2:  # cut or cut-and-end the payload
        payload = payload[:rng.randint(0, len(payload))] + rng.choice([b"", b"\n\n", b"\n"])
    payload = bytes(payload)
    size = len(payload) + rng.choice([0, 0, 0, 0, -1, 1])
    data = chunk(payload, size=max(size, 0))
    if rng.random() < 0.1:
        data = data[:rng.randint(0, len(data))]
    return data


def test_fast_path_agrees_with_the_general_path_on_random_reads():
    rng = random.Random(20261130)
    taken = 0
    for _ in range(30000):
        data = _random_read(rng)
        if token_event(data):
            taken += 1
            assert agrees(data), data
    assert taken > 3000  # the generator does reach the fast path often


def _scan_whole(payload: bytes) -> tuple:
    sc = SseScanner()
    sc.first_event = False
    sc.feed(payload)
    return sc.content_events, sc.pending, sc.meta, sc.done_seen


def test_scanning_a_span_in_place_agrees_with_scanning_a_copy():
    rng = random.Random(1130)
    for _ in range(30000):
        data = _random_read(rng)
        start = data.find(b"\r\n") + 2
        end = max(start, len(data) - 2)
        sc = SseScanner()
        sc.first_event = False
        sc.feed_span(data, start, end)
        assert (sc.content_events, sc.pending, sc.meta, sc.done_seen) == \
            _scan_whole(data[start:end]), data


def _token(text: bytes, base: bytes = TOKEN) -> bytes:
    return chunk(base.replace(b'"Hi"', b'"' + text + b'"').replace(b'" the"', b'"' + text + b'"'))


def _shape(base: bytes = TOKEN):
    first = _token(b"Hello", base)
    return shape_of(first, token_event(first))


def test_size_line_is_the_one_a_whole_chunk_of_that_length_has():
    for size in range(1, 4096):
        payload = b"x" * size
        n = len(chunk(payload))
        assert size_line(n) == b"%x\r\n" % size
    assert [size_line(n) for n in (0, 5, 21, 262, 4103)] == [None] * 5


def test_a_stream_shape_takes_reads_that_differ_only_in_the_text():
    for base in (TOKEN, LEGACY, NAMED):
        shape = _shape(base)
        assert shape is not None
        for text in (b"x", b" world", b"{", b"}", b"\\u00e9", b"usag", b"usages", b"a" * 3000):
            assert same_shape(_token(text, base), shape), text
            assert agrees(_token(text, base))


@pytest.mark.parametrize("text", [
    b"", b'"', b'a"b', b"a\nb", b"a\rb", b"\n\ndata: [DONE]", b"usage", b"timings",
])
def test_a_text_that_would_change_the_events_is_left_to_the_general_path(text):
    assert not same_shape(_token(text), _shape())


def test_other_reads_do_not_pass_for_the_stream_shape():
    shape = _shape()
    good = _token(b"ok")
    payload = good[good.index(b"\n") + 1:-2]
    for data in (good + good, good[:-1], good[1:], b"0" + good,           # framing
                 chunk(payload, size_text=b"%X" % len(payload)),           # upper-case hex
                 chunk(payload, size=len(payload) + 1),
                 good.replace(b"chat.completion.chunk", b"chat.completion.chunX"),  # suffix
                 good.replace(b"finish_reason", b"finish_reasoN"),         # prefix
                 b"0\r\n\r\n"):
        assert not same_shape(data, shape), data


def test_no_shape_is_learned_from_a_text_with_an_escape():
    data = _token(b'say \\"hi\\"')
    assert token_event(data) and shape_of(data, token_event(data)) is None


def test_the_stream_shape_agrees_with_the_general_path_on_random_reads():
    rng = random.Random(301130)
    taken = 0
    for _ in range(30000):
        base = rng.choice([TOKEN, LEGACY, NAMED])
        shape = _shape(base)
        text = bytes(rng.choice(b'ab "\\\r\n{}:usagetimings') for _ in range(rng.randint(0, 8)))
        if rng.random() < 0.3:
            text = rng.choice([b"usage", b"timings", b"", b"x"])
        data = bytearray(_token(text, base))
        if rng.random() < 0.3:  # and now and then a change elsewhere in the read
            at = rng.randint(0, len(data))
            data[at:at] = rng.choice(_PIECES)
        data = bytes(data)
        if same_shape(data, shape):
            taken += 1
            assert agrees(data), data
    assert taken > 5000

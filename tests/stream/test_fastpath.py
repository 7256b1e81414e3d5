"""The fast path must agree with the general chunk tracker + SSE scanner on every read it takes.

`fastpath.events_in(data, shape)` = k > 0 means the exchange forwards `data` as is, counts k
content events and leaves the tracker and the scanner untouched. So for every such read the
general path, started from the state the fast path requires (between chunks, between events,
after the first content event), must forward the same bytes, count exactly k content events
and end in that same state, with no usage/timings event kept and no [DONE] seen. The reads
come in every framing the simulator speaks (llama-server's chat and text chunks, vLLM's,
OpenAI's with `usage: null` and random `obfuscation`), several events per chunk and several
chunks per read, with random texts and random damage. Then whole streams go through an
`Exchange` with and without the fast path: same bytes out, tokens, usage and gap histogram.
"""

from __future__ import annotations

import asyncio
import random
import re
import types

import pytest

from relay.errors import Outcome
from relay.http.chunked import SIZE, ChunkTracker
from relay.proxy import exchange as X
from relay.proxy.client_writer import ClientWriter
from relay.proxy.deadlines import Deadlines
from relay.proxy.reply import Reply
from relay.proxy.request import Request
from relay.sim import frames as F
from relay.sim.completion import timings
from relay.stream import observer as O
from relay.stream.content_hold import Hold
from relay.stream.fastpath import events_in, learn, size_line
from relay.stream.sse import SseScanner, is_meta
from relay.stream.stall import StallPolicy
from relay.stream.usage import stream_usage
from tests.support.fake_loop import FakeLoop

TOKEN = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hi"}}],'
    b'"created":1764000000,"id":"chatcmpl-x","model":"m","system_fingerprint":"b1",'
    b'"object":"chat.completion.chunk"}\n\n'
)
LEGACY = b'data: {"choices":[{"text":" the","index":0,"logprobs":null,"finish_reason":null}]}\n\n'
NAMED = b'event: token\ndata: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'  # two lines, one event
# (kind, shape, include_usage) of every framing the simulator speaks
FRAMINGS = [
    ("chat", "llama", False),
    ("chat", "llama", True),
    ("chat", "vllm", False),
    ("chat", "vllm", True),
    ("chat", "openai", False),
    ("chat", "openai", True),
    ("text", "llama", True),
    ("native", "llama", True),
]
_TEXT = re.compile(rb'("content":"|"text":")((?:[^"\\]|\\.)*)"')
_PAD = re.compile(rb'("obfuscation":")([A-Za-z0-9]*)"')
_TEXTS = [
    b"x",
    b" world",
    b"{",
    b"}",
    b"\\u00e9",
    b'\\"',
    b"\\\\",
    b'say \\"hi\\"',
    b"a\\\\",
    b"usag",
    b"usages",
    b"",
    b'"',
    b'a"b',
    b"a\nb",
    b"a\rb",
    b"\n\ndata: [DONE]",
    b"usage",
    b"timings",
    b'x","usage":{"a":1},"y":"',
    b'x","timings":{},"y":"',
    b"\n",
    b"\\",
    b"a" * 300,
]
_PIECES = [
    b'"content":"',
    b'"content":""',
    b'"text":"',
    b'"reasoning_content":"',
    b'"usage"',
    b'"usage":null',
    b'"usage":{"a":1}',
    b'"timings"',
    b"{",
    b"}",
    b"\r",
    b"\n",
    b"\r\n",
    b"\n\n",
    b"data: ",
    b"[DONE]",
    b'"',
    b"x",
    b":",
    b"event: e\n",
    b'\\"',
    b" ",
]


def chunk(payload: bytes, size: int | None = None, size_text: bytes | None = None) -> bytes:
    text = size_text if size_text is not None else b"%x" % (len(payload) if size is None else size)
    return text + b"\r\n" + payload + b"\r\n"


def stream_frames(framing_: tuple, seed: int) -> F.StreamFrames:
    kind, shape, usage = framing_
    return F.StreamFrames(kind, "m", 3, include_usage=usage, shape=shape, rng=random.Random(seed))


def retext(event: bytes, text: bytes) -> bytes:
    """The event with its first content text replaced (raw bytes: may break the event)."""
    return _TEXT.sub(lambda m: m.group(1) + text + b'"', event, count=1)


def general(data: bytes):
    """What the general path makes of `data` from the fast path's starting state."""
    tracker = ChunkTracker()
    scanner = SseScanner()
    scanner.first_event = False
    scanner.content_events = 1  # the fast path only runs after the first content event
    out, payloads = tracker.feed(data)
    for p in payloads:
        scanner.feed(p)
    same_state = (
        tracker.state == SIZE
        and not tracker.held
        and not tracker.extra
        and not scanner.pending
        and not scanner.meta
        and not scanner.done_seen
        and not scanner.oversized
    )
    return out, scanner.content_events - 1, same_state


def agrees(data: bytes, k: int) -> bool:
    try:
        out, counted, same_state = general(data)
    except ValueError:  # broken framing: the fast path must not have taken it
        return False
    return out == data and counted == k and same_state


def shape_of(event: bytes):
    return learn(chunk(event))


# ---------------------------------------------------------------------------- fixed reads


@pytest.mark.parametrize("base", [TOKEN, LEGACY, NAMED])
@pytest.mark.parametrize(
    "text",
    [
        b"x",
        b" world",
        b"{",
        b"}",
        b"\\u00e9",
        b"usag",
        b"usages",
        b'say \\"hi\\"',
        b"a\\\\",
        b"a" * 3000,
    ],
)
def test_reads_of_the_stream_shape_take_the_fast_path(base, text):
    shape = shape_of(retext(base, b"Hello"))
    ev = retext(base, text)
    for data in (
        chunk(ev),
        chunk(ev + ev),
        chunk(ev) + chunk(ev + ev + ev),
        chunk(ev, size_text=b"%X" % len(ev)),
    ):  # (upper-case hex: chunk by chunk)
        k = data.count(b"\n\n")
        assert events_in(data, shape) == k, data
        assert agrees(data, k)


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b'"',
        b'a"b',
        b"a\nb",
        b"a\rb",
        b"\n\ndata: [DONE]",
        b"usage",
        b"timings",
        b'x","usage":{"a":1},"y":"',
        b'x","timings":{},"y":"',
        b"\n",
    ],
)
def test_a_text_that_would_change_the_events_is_left_to_the_general_path(text):
    shape = shape_of(TOKEN)
    for data in (
        chunk(retext(TOKEN, text)),
        chunk(TOKEN) + chunk(retext(TOKEN, text)),
        chunk(TOKEN + retext(TOKEN, text)),
    ):
        assert events_in(data, shape) == 0, data


def test_other_reads_do_not_pass_for_the_stream_shape():
    shape = shape_of(TOKEN)
    good = chunk(TOKEN)
    assert events_in(b"0" + good, shape) == 1 and agrees(b"0" + good, 1)  # (a leading zero)
    for data in (
        good[:-1],
        good[1:],
        good[:-2] + b"\r\r",  # the chunk's CRLF damaged, its length kept
        good[:-2] + b"\n\n",
        chunk(TOKEN, size=len(TOKEN) + 1),
        chunk(TOKEN, size=len(TOKEN) - 1),
        chunk(TOKEN, size_text=b"0x%x" % len(TOKEN)),
        chunk(TOKEN, size_text=b"%x;ext=1" % len(TOKEN)),
        chunk(TOKEN.replace(b'"object"', b'"usage":{"a":1},"object"')),
        chunk(TOKEN.replace(b'"object"', b'"timings":{},"object"')),
        chunk(TOKEN.replace(b'"object"', b'"objecT"')),  # suffix
        chunk(TOKEN.replace(b"finish_reason", b"finish_reasoN")),  # prefix
        chunk(TOKEN.replace(b"\n\n", b"\r\n\n")),
        chunk(TOKEN[:-1]),
        chunk(TOKEN + b"data: [DONE]\n\n"),
        chunk(b"data: [DONE]\n\n"),
        good + b"0\r\n\r\n",
        b"0\r\n\r\n",
        b"",
    ):
        assert events_in(data, shape) == 0, data


def test_nothing_is_learned_from_an_event_the_scanner_would_keep_or_not_count():
    for ev in (
        TOKEN.replace(b'"Hi"', b'""'),
        TOKEN.replace(b'"object"', b'"usage":{},"object"'),
        TOKEN.replace(b'"object"', b'"timings":{},"object"'),
        b"data: [DONE]\n\n",
        TOKEN.replace(b"\n\n", b"\r\n\r\n"),
        b": ping\n\n" + TOKEN,
    ):
        assert learn(chunk(ev)) is None, ev
    assert learn(chunk(TOKEN)[:-1]) is None
    assert learn(chunk(TOKEN + TOKEN)).suffix() == learn(chunk(TOKEN)).suffix()  # (the first)


def test_streams_whose_events_start_alike_share_one_prefix_and_its_heads():
    """What a stream keeps of its shape (issue 15 footprint): llama-server's events start the
    same for every stream (the id comes after the text), so its streams share the prefix and
    the size-line+prefix strings; vLLM's/OpenAI's start with the stream's id, each its own.
    The split around a varying value is made only when a read needs it."""
    from relay.stream import fastpath

    fastpath._SHARED.clear()  # (what earlier tests' streams left there)
    one = shape_of(TOKEN)
    two = shape_of(TOKEN.replace(b'"chatcmpl-x"', b'"chatcmpl-y"'))  # (after the text)
    assert two.sfxc != one.sfxc and two.prefix is one.prefix and two.heads is one.heads
    assert events_in(chunk(retext(TOKEN, b" a")), one) == 1 and len(two.heads) == 1
    assert one.segs is None and not one.split  # (never needed)
    f1, f2 = stream_frames(("chat", "openai", True), 1), stream_frames(("chat", "openai", True), 2)
    a, b = learn(f1.chunk(1)), learn(f2.chunk(1))
    assert a.prefix != b.prefix and a.heads is not b.heads
    assert events_in(f1.chunk(2), a) == 1 and a.split and a.segs is not None  # (the padding)
    for i in range(fastpath._PREFIXES + 5):  # bounded: forgotten at once past the limit
        learn(chunk(TOKEN.replace(b'{"choices"', b'{"id":"c%d","choices"' % i)))
    assert len(fastpath._SHARED) <= fastpath._PREFIXES


def test_usage_null_is_not_kept_but_a_usage_is():
    assert not is_meta(b'data: {"choices":[],"usage":null}')
    assert not is_meta(b'data: {"choices":[],"usage" : null}')
    assert is_meta(b'data: {"choices":[],"usage":{"completion_tokens":3}}')
    assert is_meta(b'data: {"usage":null,"timings":{}}')
    assert is_meta(b'data: {"usage":null,"x":{"usage":{}}}')
    sc = SseScanner()
    last = b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":5}}\n\n'
    sc.feed(
        retext(TOKEN, b"a").replace(b'"object"', b'"usage":null,"object"')
        + last
        + b'data: {"choices":[{"delta":{}}],"usage":null}\n\ndata: [DONE]\n\n'
    )
    assert sc.meta == last[:-2] and stream_usage(sc.meta).completion_tokens == 5


def test_size_line_is_the_one_a_whole_chunk_of_that_length_has():
    for size in range(1, 4096):
        n = len(chunk(b"x" * size))
        assert size_line(n) == b"%x\r\n" % size
    assert [size_line(n) for n in (0, 5, 21, 262, 4103)] == [None] * 5


# ---------------------------------------------------------------------------- random reads


def _mutate(data: bytes, rng: random.Random) -> bytes:
    """Now and then damage a read: a piece spliced in, cut short, a wrong size."""
    r = rng.random()
    if r < 0.15:
        at = rng.randint(0, len(data))
        return data[:at] + rng.choice(_PIECES) + data[at:]
    if r < 0.2:
        return data[: rng.randint(0, len(data))]
    if r < 0.25:
        nl = data.find(b"\r\n")
        size = int(data[:nl], 16) + rng.choice([-1, 1])
        return b"%x" % max(size, 0) + data[nl:]
    return data


def _random_read(f: F.StreamFrames, rng: random.Random, i: int) -> tuple[bytes, int]:
    """A read of whole chunks of token events of `f`'s stream (texts sometimes odd), and
    how many token events it holds before any damage."""
    chunks = []
    for _ in range(rng.choice([1, 1, 1, 2, 3, 4])):
        evs = []
        for _ in range(rng.choice([1, 1, 1, 2, 3, 4])):
            ev = f.event(i)
            i += 1
            if rng.random() < 0.3:
                ev = retext(ev, rng.choice(_TEXTS))
            if rng.random() < 0.1 and b"obfuscation" in ev:
                ev = _PAD.sub(
                    lambda m: (
                        m.group(1)
                        + rng.choice([b"", b"usage", b"timings", b'a"b', b"a\nb", b"\\", b"xyz"])
                        + b'"'
                    ),
                    ev,
                )
            evs.append(ev)
        chunks.append(chunk(b"".join(evs)))
    return b"".join(chunks), i


@pytest.mark.parametrize("framing_", FRAMINGS)
def test_fast_path_agrees_with_the_general_path_on_random_reads(framing_):
    rng = random.Random(FRAMINGS.index(framing_))
    taken = 0
    for n in range(4000):
        f = stream_frames(framing_, n)
        shape = learn(f.chunk(1))
        assert shape is not None
        data, _ = _random_read(f, rng, 2)
        data = _mutate(data, rng)
        k = events_in(data, shape)
        if k:
            taken += 1
            assert agrees(data, k), data
        own = learn(data)  # a shape learned from the read itself
        if own is not None and (k2 := events_in(data, own)):
            assert agrees(data, k2), data
    assert taken > 1000  # the generator does reach the fast path often


class _Stamped:
    """A framing whose token events end in a number that changes every event, as a
    server that stamps its events writes them (bench.transit's `t_ns`). (A string may vary
    only as the last value: OpenAI's padding followed by a stamp is a string that differs,
    so the general path reads such events; the framings with the padding are left out.)"""

    def __init__(self, f: F.StreamFrames, rng: random.Random) -> None:
        self.f, self.rng = f, rng

    def event(self, i: int) -> bytes:
        ev = self.f.event(i)
        return ev[: ev.rindex(b"}\n\n")] + b',"t_ns":%d}\n\n' % self.rng.randrange(10**20)

    def chunk(self, i: int) -> bytes:
        return chunk(self.event(i))


# What a damaged stamp may read: a number of any kind, or bytes that make another event.
_STAMPS = [
    *(b"", b"-1", b"1.5e-3", b"7", b'1"', b"1\n", b'1,"usage":{}', b"\\", b"1}", b"usage"),
    # Keys slipped in a number's place (a quote must never pass there), and white space.
    *(b'1,"usage":1', b'1,"timings":0', b'"stop":true', b'1,"x":"y', b" 5", b"5 "),
]
_STAMP = re.compile(rb'("t_ns":)([0-9]+)')
UNPADDED = [f for f in FRAMINGS if f[1] != "openai"]


@pytest.mark.parametrize("framing_", UNPADDED)
def test_a_stamp_that_varies_every_event_takes_the_fast_path_as_the_general_would(framing_):
    rng = random.Random(31 + UNPADDED.index(framing_))
    taken = 0
    for n in range(2000):
        f = _Stamped(stream_frames(framing_, n), rng)
        shape = learn(f.chunk(1))
        assert shape is not None
        data, _ = _random_read(f, rng, 2)
        data = _mutate(data, rng)
        if rng.random() < 0.3:
            # The first stamp of the read, or any of them.
            data = _STAMP.sub(
                lambda m: m.group(1) + (rng.choice(_STAMPS) if rng.random() < 0.5 else m.group(2)),
                data,
                count=rng.choice([0, 1]),
            )
        k = events_in(data, shape)
        if k:
            taken += 1
            assert agrees(data, k), data
    assert taken > 400


NATIVE = (
    b'data: {"index":0,"content":" from","tokens":[368],"stop":false,"id_slot":-1,'
    b'"tokens_predicted":2,"tokens_evaluated":8}\n\n'
)


@pytest.mark.parametrize(
    ("event", "number", "taken"),
    [
        # llama-server's native /completion: its token ids and counts change every event.
        (NATIVE, b"368", [b"369", b"368,369", b"0", b"12345678901234567890"]),
        (NATIVE, b"2", [b"3", b"10", b"-1", b"1.5", b"1e3"]),
        (NATIVE, b"-1", [b"0", b"7"]),
        # llama-server's chat: `created` each second.
        (TOKEN, b"1764000000", [b"1764000001", b"99"]),
    ],
)
def test_numbers_that_change_are_taken_and_what_is_no_number_is_not(event, number, taken):
    shape = shape_of(event)
    assert shape.segs is None  # (made by the first read that misses the suffix)
    at = event.index(number, event.index(b'"content":"') + 12)
    for value in taken:
        data = chunk(event[:at] + value + event[at + len(number) :])
        assert events_in(data, shape) == 1 and agrees(data, 1), data
        assert events_in(data + data, shape) == 2 and agrees(data + data, 2)
        two = chunk((event[:at] + value + event[at + len(number) :]) * 2)
        assert events_in(two, shape) == 2 and agrees(two, 2)
    # Cut around that number alone (and the last value if a string): the others stay.
    assert shape.segs is not None and len(shape.segs) == (3 if event is TOKEN else 2)
    for value in (b"", b'"1"', b"null", b"true", b"{}", b"[]", b"1\n", b"1\r", b"\\", b"1}"):
        data = chunk(event[:at] + value + event[at + len(number) :])
        assert events_in(data, shape) == 0, data


def test_a_number_that_did_not_differ_is_kept_and_a_read_changing_it_goes_the_general_way():
    shape = shape_of(NATIVE)
    first = chunk(NATIVE.replace(b"[368]", b"[369]").replace(b'd":2,', b'd":3,'))
    assert events_in(first, shape) == 1 and len(shape.segs) == 3  # (tokens, tokens_predicted)
    moved = chunk(NATIVE.replace(b'"id_slot":-1', b'"id_slot":4'))
    assert events_in(moved, shape) == 0 and agrees(moved, 1)
    # A first miss that differs but in numbers makes no template: the general path reads on.
    other = shape_of(NATIVE)
    odd = chunk(NATIVE.replace(b'"stop":false', b'"stop":true'))
    assert events_in(odd, other) == 0 and other.split and other.segs is None
    assert events_in(first, other) == 0


@pytest.mark.parametrize(
    ("framing_", "stamped"), [(f, False) for f in FRAMINGS] + [(f, True) for f in UNPADDED]
)
def test_every_clean_read_of_every_framing_takes_the_fast_path(framing_, stamped):
    rng = random.Random(7)
    f = _Stamped(stream_frames(framing_, 1), rng) if stamped else stream_frames(framing_, 1)
    shape = learn(f.chunk(1))
    i = 2
    for _ in range(300):
        start = i
        chunks = []
        for _ in range(rng.randint(1, 4)):
            per = rng.randint(1, 4)
            chunks.append(chunk(b"".join(f.event(j) for j in range(i, i + per))))
            i += per
        assert events_in(b"".join(chunks), shape) == i - start


def _scan_whole(payload: bytes) -> tuple:
    sc = SseScanner()
    sc.first_event = False
    sc.feed(payload)
    return sc.content_events, sc.pending, sc.meta, sc.done_seen


def test_scanning_a_span_in_place_agrees_with_scanning_a_copy():
    rng = random.Random(1130)
    for n in range(20000):
        f = stream_frames(FRAMINGS[n % len(FRAMINGS)], n)
        data = _mutate(_random_read(f, rng, 1)[0], rng)
        start = data.find(b"\r\n") + 2
        end = max(start, len(data) - 2)
        sc = SseScanner()
        sc.first_event = False
        sc.feed_span(data, start, end)
        assert (sc.content_events, sc.pending, sc.meta, sc.done_seen) == _scan_whole(
            data[start:end]
        ), data


# ---------------------------------------------------------------------------- whole streams


class _Loop(FakeLoop):
    """The exchange's loop: a fake clock and timers, and futures of a loop that never runs."""

    def __init__(self, futures: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.now = 100.0
        self.futures = futures

    def create_future(self) -> asyncio.Future:
        return self.futures.create_future()


class _Transport:
    """The client connection's transport: what is written to it is kept."""

    def __init__(self, out: list) -> None:
        self.write = out.append

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _exchange(loop: _Loop, out: list) -> X.Exchange:
    """An exchange relaying a chunked SSE stream to a client connection's writer, over a fake
    upstream connection and a fake client transport: the head is in, the hold keeps the body
    until its first content event."""
    writer = ClientWriter(loop, _Transport(out))
    req = Request(b"POST", b"/v1/chat/completions", [], b"", True, True)
    reply = Reply(loop, writer, Hold(b"r1"), 0.0, Deadlines(loop))
    conn = types.SimpleNamespace(handler=None, transport=None, abort=lambda: None)
    relaying = X.Relaying(loop, Deadlines(loop), StallPolicy(300.0, 0.0, 300.0), 10.0)
    ex = X.Exchange(relaying, conn, req, reply, X.Hop("llm", "m", False))
    ex.upstream_data(HEAD)
    assert ex.body_started
    return ex


def _stream(f: F.StreamFrames, n: int, rng: random.Random, batch: int | None) -> bytes:
    """A stream's body: chunks of `batch` events each (None: 1 to 3 at random)."""
    evs = [f.role_event() or b""] + [f.event(i) for i in range(n)]
    evs[0] += evs.pop(1)
    out, i = [], 0
    while i < len(evs):
        per = batch or rng.choice([1, 1, 1, 2, 3])
        out.append(chunk(b"".join(evs[i : i + per])))
        i += per
    tm = timings(3, n, 10.0)
    return b"".join(out) + f.tail_chunks(f.final_events(n, n, "length", tm))


def _run(body: bytes, reads: list[int], gaps: list[float], fast: bool, monkeypatch):
    taken = []  # token events the fast path counted
    if fast:
        real = O.events_in
        monkeypatch.setattr(O, "events_in", lambda d, s: taken.append(real(d, s)) or taken[-1])
    else:
        monkeypatch.setattr(O, "learn", lambda data: None)
    futures = asyncio.new_event_loop()
    loop, out = _Loop(futures), []
    monkeypatch.setattr(X, "_perf", loop.time)  # (the gaps' clock, read once a read)
    ex = _exchange(loop, out)
    pos = 0
    for cut, g in zip(reads, gaps):
        loop.now += g
        ex.upstream_data(body[pos:cut])
        pos = cut
    monkeypatch.undo()
    futures.close()
    sent = b"".join(out)
    assert sent.startswith(b"HTTP/1.1 200 OK\r\n")
    summary = ex.summary
    assert summary is not None and summary.gaps is not None
    return (
        sent[sent.index(b"\r\n\r\n") + 4 :],
        summary.content_events,
        stream_usage(summary.meta_event),
        summary.gaps.encode(),
        summary.gaps.max,
        ex.writer.sent,
        summary.ending,
    ), sum(taken)


@pytest.mark.parametrize("framing_", FRAMINGS)
def test_whole_streams_give_the_same_bytes_tokens_usage_and_gaps_either_way(framing_, monkeypatch):
    rng = random.Random(100 + FRAMINGS.index(framing_))
    fast_tokens, all_tokens = [0, 0], [0, 0]  # (odd n: 3 events in every chunk)
    for n in range(60):
        f = stream_frames(framing_, n)
        tokens = rng.randint(1, 120)
        body = _stream(f, tokens, rng, 3 if n % 2 else None)
        # reads: cut at chunk ends mostly (one or several chunks), sometimes anywhere
        ends = [m.end() for m in re.finditer(rb"\n\n\r\n|0\r\n\r\n$", body)]
        cuts = sorted(
            {e for e in ends if rng.random() < 0.6}
            | {len(body)}
            | {rng.randint(1, len(body)) for _ in range(rng.randint(0, 3))}
        )
        gaps = [rng.choice([0.0, 0.0004, 0.02, 0.02, 0.3]) for _ in cuts]
        fast, taken = _run(body, cuts, gaps, True, monkeypatch)
        ref, none = _run(body, cuts, gaps, False, monkeypatch)
        assert fast == ref and none == 0
        fast_tokens[n % 2] += taken
        all_tokens[n % 2] += tokens
        assert fast[0] == body and fast[1] == tokens and fast[-1] == Outcome.DONE
        if framing_[2] or framing_[1] == "llama":  # usage (or llama-server's timings) read
            assert fast[2] is not None and fast[2].completion_tokens == tokens
    assert fast_tokens[0] > all_tokens[0] / 2 and fast_tokens[1] > all_tokens[1] / 2  # (it ran)


def test_a_shape_is_learned_again_after_content_it_missed_not_after_a_miss_alone(monkeypatch):
    f = stream_frames(("chat", "llama", False), 5)
    first = [f.event(i) for i in range(6)]
    # The same stream's token events in another shape from the seventh on (a member that is
    # not the last string value changed: neither the suffix nor its varying split takes it).
    then = [f.event(i).replace(b'"model":"m"', b'"model":"m-2"') for i in range(6, 12)]
    assert (
        learn(chunk(then[0])) is not None and events_in(chunk(then[0]), learn(chunk(first[0]))) == 0
    )
    reads = [chunk(f.role_event() + first[0])] + [chunk(ev) for ev in first[1:] + then]
    reads += [f.tail_chunks(f.final_events(3, 12, "length", timings(3, 12, 10.0)))]
    lessons, taken = [], []
    real_learn, real_events_in = O.learn, O.events_in
    monkeypatch.setattr(O, "learn", lambda d: lessons.append(d) or real_learn(d))
    monkeypatch.setattr(
        O, "events_in", lambda d, s: taken.append(real_events_in(d, s)) or taken[-1]
    )
    futures = asyncio.new_event_loop()
    loop, out = _Loop(futures), []
    ex = _exchange(loop, out)
    for data in reads:
        loop.now += 0.02
        ex.upstream_data(data)
    futures.close()
    assert ex.summary is not None and ex.summary.content_events == 12
    assert b"".join(out).endswith(b"".join(reads))
    # Learned at the first fast read and at the read after the first one it missed; the
    # end's reads (usage, [DONE], the last chunk) miss it and teach nothing.
    assert lessons == [reads[1], reads[7]]
    # Every token event went fast but the first read's and the first of the new shape.
    assert sum(taken) == 12 - 2

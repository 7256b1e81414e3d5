"""Unit tests for relay/http/chunked.py: ChunkTracker, frame, close_with (no sockets)."""

from __future__ import annotations

import glob
import random
from pathlib import Path

import pytest

from relay.http import chunked
from relay.http.body import ChunkedReader
from relay.http.chunked import LAST_CHUNK, SIZE, ChunkError, ChunkTracker, frame
from tests.support.fixtures import FIXTURES, captured

SEP = b"======== RESPONSE (raw bytes) ========\n"
HEX = frozenset(b"0123456789abcdefABCDEF")


# ---- a tiny strict reference de-chunker (RFC 9112 section 7.1) ---------------------------
class Incomplete(Exception):
    """The input ended before the body did; `where` says in which part."""

    def __init__(self, where: str, content: bytes, owed: int = 0) -> None:
        super().__init__(where)
        self.where = where
        self.content = content
        self.owed = owed


def _line(buf: bytes, pos: int, where: str, content: bytes) -> tuple[bytes, int]:
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise Incomplete(where, content)
    line = buf[pos:end]
    assert b"\n" not in line and b"\r" not in line, f"bare CR/LF in {where}: {line!r}"
    return line, end + 2


def strict_dechunk(buf: bytes) -> tuple[bytes, bytes]:
    """(content, bytes after the body). Raises Incomplete when `buf` stops early,
    AssertionError on anything that is not strictly valid chunked framing."""
    content = b""
    pos = 0
    while True:
        if pos == len(buf):
            raise Incomplete("between", content)
        line, pos = _line(buf, pos, "size", content)
        size_txt = line.split(b";", 1)[0].rstrip(b" \t")
        assert size_txt and all(c in HEX for c in size_txt), f"bad chunk size {line!r}"
        size = int(size_txt, 16)
        if size == 0:
            break
        if len(buf) - pos < size:
            got = buf[pos:]
            raise Incomplete("data", content + got, size - len(got))
        content += buf[pos : pos + size]
        pos += size
        if len(buf) - pos < 2:
            assert buf[pos:] in (b"", b"\r"), f"chunk data not followed by CRLF: {buf[pos:]!r}"
            raise Incomplete("data_end" if pos == len(buf) else "crlf", content)
        assert buf[pos : pos + 2] == b"\r\n", f"chunk data not followed by CRLF at {pos}"
        pos += 2
    while True:  # trailer section
        line, pos = _line(buf, pos, "trailer", content)
        if not line:
            return content, buf[pos:]
        assert b":" in line, f"bad trailer line {line!r}"


def valid_complete(buf: bytes) -> bytes:
    """De-chunked content of a body that must be complete with nothing after it."""
    content, rest = strict_dechunk(buf)
    assert rest == b"", f"bytes after the end of the body: {rest[:40]!r}"
    return content


def prefix_state(buf: bytes) -> str:
    try:
        strict_dechunk(buf)
    except Incomplete as inc:
        return inc.where
    return "done"


SAFE_STATES = {"between", "data", "data_end", "done"}


def make_body(chunks: list[bytes], ext: bool = False, trailers: bytes = b"") -> bytes:
    out = []
    for i, c in enumerate(chunks):
        e = b";x=y" if ext and i % 2 else b""
        out.append(b"%x%b\r\n%b\r\n" % (len(c), e, c))
    out.append(b"0" + (b";last=1" if ext else b"") + b"\r\n" + trailers + b"\r\n")
    return b"".join(out)


def fixture_bodies() -> dict[str, bytes]:
    bodies = {}
    for path in sorted(glob.glob(f"{FIXTURES}/*.http")):
        raw = Path(path).read_bytes()
        resp = raw.partition(SEP)[2]
        head, _, body = resp.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in head.lower():
            bodies[path.rsplit("/", 1)[1]] = body
    return bodies


SMALL = make_body([b"hello", b"data: x\n\n", b"\r\n\r\n"], ext=True, trailers=b"X-T: 1\r\n")
SMALL_CONTENT = b"hellodata: x\n\n\r\n\r\n"


def feed_all(tracker: ChunkTracker, reads: list[bytes]) -> tuple[bytes, bytes, list[bool]]:
    fwd = b""
    payloads = b""
    dones = []
    for r in reads:
        out, ps = tracker.feed(r)
        assert isinstance(ps, list)
        fwd += bytes(out)
        payloads += b"".join(bytes(p) for p in ps)
        dones.append(tracker.done)
        assert prefix_state(fwd) in SAFE_STATES, (reads, fwd)
    return fwd, payloads, dones


# ---- the reference itself -----------------------------------------------------------------
def test_reference_dechunker_is_strict():
    assert valid_complete(SMALL) == SMALL_CONTENT
    assert prefix_state(b"5\r\nhel") == "data"
    assert prefix_state(b"5\r\nhello") == "data_end"
    assert prefix_state(b"5\r\nhello\r") == "crlf"
    assert prefix_state(b"5") == "size"
    assert prefix_state(b"0\r\n") == "trailer"
    with pytest.raises(AssertionError):
        strict_dechunk(b"0x5\r\nhello\r\n0\r\n\r\n")
    with pytest.raises(AssertionError):
        strict_dechunk(b"5\r\nhelloX\r\n0\r\n\r\n")


# ---- frame ---------------------------------------------------------------------------------
def test_frame_exact():
    assert frame(b"") == b""
    assert frame(b"hello") == b"5\r\nhello\r\n"
    assert frame(b"x" * 255) == b"ff\r\n" + b"x" * 255 + b"\r\n"
    assert frame(b"x" * 4096) == b"1000\r\n" + b"x" * 4096 + b"\r\n"
    assert LAST_CHUNK == b"0\r\n\r\n"


# ---- feed ----------------------------------------------------------------------------------
def test_fast_path_whole_chunk_returned_as_is():
    t = ChunkTracker()
    out, ps = t.feed(b"5\r\nhello\r\n")
    assert (bytes(out), ps) == (b"5\r\nhello\r\n", [b"hello"])
    assert t.state == chunked.SIZE and t.held == b"" and not t.done
    out, ps = t.feed(b"0\r\n\r\n")
    assert (out, ps) == (b"0\r\n\r\n", [])
    assert t.done and t.extra == b""


def test_single_read_of_whole_body():
    t = ChunkTracker()
    out, ps = t.feed(SMALL)
    assert out == SMALL
    assert b"".join(ps) == SMALL_CONTENT
    assert t.done and t.extra == b""


@pytest.mark.parametrize("i", range(len(SMALL) + 1))
def test_every_two_way_split(i):
    t = ChunkTracker()
    fwd, payloads, dones = feed_all(t, [SMALL[:i], SMALL[i:]])
    assert fwd == SMALL
    assert payloads == SMALL_CONTENT
    assert dones == [i == len(SMALL), True]
    assert t.extra == b""


def test_every_three_way_split():
    body = make_body([b"ab", b"c", b"defg"], ext=True, trailers=b"A: 1\r\nB: 2\r\n")
    content = b"abcdefg"
    n = len(body)
    for i in range(n + 1):
        for j in range(i, n + 1):
            t = ChunkTracker()
            fwd, payloads, dones = feed_all(t, [body[:i], body[i:j], body[j:]])
            assert fwd == body, (i, j)
            assert payloads == content, (i, j)
            assert dones == [i == n, j == n, True], (i, j)


@pytest.mark.parametrize(
    "body",
    [
        SMALL,
        make_body([b"x"]),
        make_body([b"a" * 20, b"b"]),
        make_body([]),
        make_body([b"yz"], trailers=b"T: v\r\n"),
    ],
)
def test_byte_by_byte(body):
    t = ChunkTracker()
    fwd, payloads, dones = feed_all(t, [body[k : k + 1] for k in range(len(body))])
    assert fwd == body
    assert payloads == valid_complete(body)
    assert dones == [False] * (len(body) - 1) + [True]


@pytest.mark.parametrize("seed", range(40))
def test_random_splits_of_large_body(seed):
    rnd = random.Random(seed)
    chunks = [
        rnd.randbytes(rnd.choice([1, 2, 15, 16, 17, 255, 256, 1000, 4096, 9000]))
        for _ in range(rnd.randint(1, 60))
    ]
    trailers = b"X-Checksum: abc\r\n" if seed % 3 == 0 else b""
    body = make_body(chunks, ext=seed % 2 == 1, trailers=trailers)
    reads, pos = [], 0
    while pos < len(body):
        step = rnd.choice([1, 2, 3, 5, 7, 64, 500, 4096, 16384])
        reads.append(body[pos : pos + step])
        pos += step
    t = ChunkTracker()
    fwd, payloads, dones = feed_all(t, reads)
    assert fwd == body
    assert payloads == b"".join(chunks)
    assert dones == [False] * (len(reads) - 1) + [True]


@pytest.mark.parametrize("name", captured(fixture_bodies()))
def test_fixture_bodies_every_split(name):
    body = fixture_bodies()[name]
    try:
        content, _rest = strict_dechunk(body)
        complete = True
    except Incomplete as inc:  # a capture cut short by the client (disconnect_*)
        content, complete = inc.content, False
    for i in range(len(body) + 1):
        t = ChunkTracker()
        fwd, payloads, dones = feed_all(t, [body[:i], body[i:]])
        if complete:
            assert fwd == body and payloads == content and dones[-1], i
        else:
            assert body.startswith(fwd) and content.startswith(payloads) and not dones[-1]
    assert name != "disconnect_huge_npredict.http" or not complete


def test_extension_and_trailers_not_in_payloads():
    body = b'4;name=val;q="x;y"\r\nwxyz\r\n0;end\r\nExpires: never\r\nX-A: b\r\n\r\n'
    t = ChunkTracker()
    out, ps = t.feed(body)
    assert out == body and ps == [b"wxyz"] and t.done


def test_last_chunk_and_trailers_held_until_complete():
    t = ChunkTracker()
    assert t.feed(b"3\r\nabc\r\n0\r\n") == (b"3\r\nabc\r\n", [b"abc"])
    assert not t.done
    assert t.feed(b"X-T: 1\r\n") == (b"", [])
    assert not t.done
    out, ps = t.feed(b"\r\n")
    assert (out, ps) == (b"0\r\nX-T: 1\r\n\r\n", [])
    assert t.done


def test_chunk_crlf_held_when_split():
    t = ChunkTracker()
    assert t.feed(b"3\r\nabc\r") == (b"3\r\nabc", [b"abc"])
    assert t.feed(b"\n") == (b"\r\n", [])
    assert t.state == chunked.SIZE


def test_size_line_held_when_split():
    t = ChunkTracker()
    assert t.feed(b"1") == (b"", [])
    assert t.feed(b"0;ext") == (b"", [])
    assert t.feed(b"\r\n0123") == (b"10;ext\r\n0123", [b"0123"])
    assert t.remaining == 12


def test_extra_bytes_after_end_same_read():
    t = ChunkTracker()
    out, ps = t.feed(b"2\r\nok\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n")
    assert out == b"2\r\nok\r\n0\r\n\r\n"
    assert ps == [b"ok"]
    assert t.done and t.extra == b"HTTP/1.1 200 OK\r\n"


def test_extra_bytes_after_end_later_reads():
    t = ChunkTracker()
    t.feed(b"2\r\nok\r\n0\r\n")
    out, _ = t.feed(b"\r\nGAR")
    assert out == b"0\r\n\r\n" and t.extra == b"GAR"
    assert t.feed(b"BAGE") == (b"", [])
    assert t.extra == b"GARBAGE" and t.done


@pytest.mark.parametrize(
    "bad",
    [
        b"zz\r\nhello\r\n",
        b"-5\r\nhello\r\n",
        b"\r\nhello\r\n",
        b"g\r\n",
        b";ext\r\n",
        b"5\r\nhelloXY0\r\n\r\n",
        b"3\r\nabc\n\n",
    ],
)
def test_bad_framing_raises(bad):
    t = ChunkTracker()
    with pytest.raises(ChunkError):
        t.feed(bad)


@pytest.mark.parametrize(
    "bad", [b"0x5\r\nhello\r\n", b"+5\r\nhello\r\n", b"0_5\r\nhello\r\n", b"-0\r\n\r\n"]
)
def test_non_hexdig_size_raises(bad):
    t = ChunkTracker()
    with pytest.raises(ChunkError):
        t.feed(bad)


def test_bad_size_split_across_reads_raises():
    t = ChunkTracker()
    assert t.feed(b"2\r\nok\r\nq") == (b"2\r\nok\r\n", [b"ok"])
    with pytest.raises(ChunkError):
        t.feed(b"q\r\n")


def test_overlong_size_line_raises():
    t = ChunkTracker()
    with pytest.raises(ChunkError):
        t.feed(b"1;" + b"e" * 5000)


def test_overlong_trailer_line_raises():
    t = ChunkTracker()
    t.feed(b"0\r\n")
    with pytest.raises(ChunkError):
        t.feed(b"X-Long: " + b"v" * 5000)


def test_whole_chunks_offsets():
    t = ChunkTracker()
    assert t.whole_chunks(b"5\r\nhello\r\n") == ([3, 8], False)
    assert t.whole_chunks(b"1fc\r\n" + b"x" * 0x1FC + b"\r\n") == ([5, 5 + 0x1FC], False)
    # CRLF inside the data is data
    assert t.whole_chunks(b"5\r\nhel\r\n\r\n") == ([3, 8], False)
    # several whole chunks
    assert t.whole_chunks(b"5\r\nhello\r\n2\r\nab\r\n") == ([3, 8, 13, 15], False)
    # The last chunk is no chunk of payload: the read is told to end the body.
    assert t.whole_chunks(b"5\r\nhello\r\n0\r\n\r\n") == ([3, 8], True)
    assert t.whole_chunks(b"0\r\n\r\n") == ([], True)
    for not_whole in (
        b"5\r\nhell",
        b"5\r\nhelloXY",
        b"5;x=1\r\nhello\r\n",
        b"zz\r\nhello\r\n",
        b"5\r\nhello\r\n5\r\nhel",
        b"0x5\r\nhello\r\n",
    ):
        assert t.whole_chunks(not_whole) == (None, False), not_whole
    assert t.whole_chunks(b"") == ([], False)
    t.feed(b"5\r\nhe")  # inside a chunk: nothing is whole
    assert t.whole_chunks(b"5\r\nhello\r\n") == (None, False)
    t = ChunkTracker()
    t.feed(b"5")  # a held size line
    assert t.whole_chunks(b"5\r\nhello\r\n") == (None, False)


def test_whole_chunks_see_the_last_chunk_that_ends_a_read():
    t = ChunkTracker()
    assert t.whole_chunks(b"5\r\nhello\r\n0\r\n\r\n") == ([3, 8], True)
    assert t.whole_chunks(b"0\r\n\r\n") == ([], True)
    assert t.whole_chunks(b"5\r\nhello\r\n") == ([3, 8], False)
    # A chunk whose data ends as a last chunk does is data; a trailer, a last chunk cut short
    # or followed by more, an extension, are the general path's.
    assert t.whole_chunks(b"5\r\n0\r\n\r\n\r\n") == ([3, 8], False)
    for other in (
        b"5\r\nhello\r\n0\r\nX-T: 1\r\n\r\n",
        b"5\r\nhello\r\n0\r\n\r",
        b"5\r\nhello\r\n0\r\n\r\nGET",
        b"5\r\nhello\r\n0;x=1\r\n\r\n",
        b"5\r\nhello\r\n00\r\n\r\nx",
    ):
        assert t.whole_chunks(other) == (None, False), other
    # The tracker is left as it was: the reader says the body is whole.
    assert t.state == SIZE
    r = ChunkedReader()
    assert r.read(b"5\r\nhello\r\n0\r\n\r\n") == (b"5\r\nhello\r\n0\r\n\r\n", [3, 8], True, True)
    assert r.done and r.reusable


@pytest.mark.parametrize("seed", range(10))
def test_whole_chunks_agree_with_feed(seed):
    rnd = random.Random(seed)
    for _ in range(200):
        chunks = [
            rnd.randbytes(rnd.choice([1, 2, 15, 16, 255, 256, 4095, 70000]))
            for _ in range(rnd.randint(1, 4))
        ]
        data = b"".join(frame(c) for c in chunks)
        t, u = ChunkTracker(), ChunkTracker()
        spans, ended = t.whole_chunks(data)
        assert spans is not None and not ended
        assert [data[spans[i] : spans[i + 1]] for i in range(0, len(spans), 2)] == chunks
        assert u.feed(data) == (data, chunks)
        assert (t.state, t.held) == (u.state, u.held) == (chunked.SIZE, b"")


# ---- close_with ----------------------------------------------------------------------------
PAYLOADS = [b"", b"ab", b'data: {"x":1}\n\ndata: [DONE]\n\n' * 3]
CLOSE_BODY = make_body([b"0123456789", b"ab", b"data: z\n\n"], ext=True, trailers=b"T: 1\r\n")


@pytest.mark.parametrize("payload", PAYLOADS, ids=["empty", "short", "long"])
@pytest.mark.parametrize("i", range(len(CLOSE_BODY)))  # every state except DONE
def test_close_with_from_every_state(i, payload):
    t = ChunkTracker()
    fwd, payloads, _ = feed_all(t, [CLOSE_BODY[:i]])
    assert not t.done
    owed = t.remaining if t.state == chunked.DATA else 0
    tail = t.close_with(payload)
    assert t.done and t.held == b""
    content = valid_complete(fwd + tail)
    pad = b"\n" * max(0, owed - len(payload))
    assert content == payloads + pad + payload, (i, t.state)
    assert content.endswith(payload)


def test_close_with_exact_bytes_per_state():
    t = ChunkTracker()
    t.feed(b"5\r\nhe")  # DATA, 3 owed
    assert t.close_with(b"X") == b"\n\nX\r\n0\r\n\r\n"
    t = ChunkTracker()
    t.feed(b"5\r\nhe")
    assert t.close_with(b"WXYZ") == b"WXY\r\n1\r\nZ\r\n0\r\n\r\n"
    t = ChunkTracker()
    t.feed(b"5\r\nhello")  # DATA_END
    assert t.close_with(b"P") == b"\r\n1\r\nP\r\n0\r\n\r\n"
    t = ChunkTracker()
    t.feed(b"5\r\nhello\r")  # DATA_END, lone CR held
    assert t.close_with(b"P") == b"\r\n1\r\nP\r\n0\r\n\r\n"
    t = ChunkTracker()
    t.feed(b"5\r\nhello\r\n1")  # SIZE, partial size line held
    assert t.close_with(b"P") == b"1\r\nP\r\n0\r\n\r\n"
    t = ChunkTracker()
    t.feed(b"5\r\nhello\r\n0\r\nX: 1\r\n")  # TRAILER held
    assert t.close_with(b"") == b"0\r\n\r\n"


def test_close_with_after_done_adds_nothing():
    t = ChunkTracker()
    fwd, _ = t.feed(b"2\r\nok\r\n0\r\n\r\n")
    assert t.done
    tail = t.close_with(b"data: [DONE]\n\n")
    assert valid_complete(fwd + tail) == b"ok"


def test_close_with_stall_frame_ends_half_sent_line():
    from relay.stream.terminal import stall_frame

    ev = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
    t = ChunkTracker()
    body = frame(ev) + frame(ev)
    fwd, _payloads = t.feed(body[: len(frame(ev)) + 20])  # inside the second chunk's data line
    sf = stall_frame(None, "chat", "m", "idle", 1.5, "llm", 1)
    content = valid_complete(fwd + t.close_with(sf))
    # SSE view: every event is whole; [DONE] is the last event and appears once
    events = [e for e in content.split(b"\n\n") if e.strip(b"\n")]
    assert events[-1] == b"data: [DONE]"
    assert content.count(b"data: [DONE]") == 1
    assert content.endswith(sf)
    assert events[0] == ev[:-2]

"""relay/stream/content_hold.py without sockets: what reaches the client before the first
content event."""

from __future__ import annotations

import pytest

from relay.errors import UpstreamErrorFields
from relay.http.chunked import frame
from relay.proxy.client_writer import ClientWriter
from relay.proxy.deadlines import Deadlines
from relay.proxy.reply import Reply
from relay.stream import content_hold as H
from relay.stream import dialect as D
from tests.support.fake_loop import FakeLoop


class Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass


class Driven:
    """The pure hold driven as the proxy drives it (relay.proxy.reply): each step's output
    written by a client connection's writer to a transport that keeps it, the heartbeat on
    a fake loop. What the hold holds is read from it directly."""

    def __init__(self, loop: FakeLoop, interval: float, http11: bool, extra) -> None:
        self.transport = Transport()
        self.writer = ClientWriter(loop, self.transport)
        self.hold = H.Hold(b"r1", extra, http11, http11)
        self.reply = Reply(loop, self.writer, self.hold, interval, Deadlines(loop))

    def __getattr__(self, name: str):
        return getattr(self.hold, name)

    def feed(self, payload: bytes, content: bool) -> bool:
        opened, out = self.hold.feed(payload, content)
        self.writer.write(out)
        return opened

    def take(self, piece: bytes, content: bool, error_first: bool, more: bool = False) -> H.Took:
        return self.reply.take(piece, content, error_first, more)

    def release(self) -> None:
        self.reply.release()

    def finish(self) -> None:
        self.reply.finish()

    def fail(self, message: str, type_: str, code: str | None, api=D.CHAT) -> bool:
        return self.reply.fail(message, type_, code, api)


HB = frame(H.HEARTBEAT)


def make(interval: float = 1.0, http11: bool = True, extra=()) -> tuple[Driven, FakeLoop, list]:
    loop = FakeLoop()
    hold = Driven(loop, interval, http11, extra)
    hold.reply.start()
    return hold, loop, hold.transport.out


def test_comment_prefix():
    assert H.comment_prefix(b"") == 0
    assert H.comment_prefix(b": ping\n\n") == 8
    assert H.comment_prefix(b": a\n: b\n\n: c\n\ndata: x\n\n") == 14
    assert H.comment_prefix(b"\n: ping\n\n") == 9
    assert H.comment_prefix(b": ping\n\ndata: {}\n\n: ping\n\n") == 8
    assert H.comment_prefix(b": ping\n") == 0  # unfinished
    assert H.comment_prefix(b": ping\r\n\r\n") == 0  # CR endings: held, not judged
    assert H.comment_prefix(b"event: x\n: c\n\n") == 0


def test_synthetic_head():
    assert H.synthetic_head(b"r", True, True, [(b"Access-Control-Allow-Origin", b"*")]) == (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Access-Control-Allow-Origin: *\r\nTransfer-Encoding: chunked\r\nX-Request-Id: r\r\n\r\n"
    )
    assert H.synthetic_head(b"r", False, False).endswith(
        b"X-Request-Id: r\r\nConnection: close\r\n\r\n"
    )


def test_waiting_keeps_and_releases_in_one_write():
    hold, _loop, out = make(interval=0)
    hold.hold_head(b"HEAD", False)
    assert not hold.keep(b"a") and not hold.keep(b"b")
    assert out == [] and not hold.sent
    hold.release()
    assert out == [b"HEADab"] and hold.open


def test_waiting_over_limit():
    hold, _loop, _out = make(interval=0)
    assert hold.keep(b"x" * (H.LIMIT + 1))


def test_heartbeat_commits_a_synthetic_head_then_repeats():
    hold, loop, out = make(interval=1.0)
    loop.run_until(0.99)
    assert out == []
    loop.run_until(1.0)
    assert out == [H.synthetic_head(b"r1", True, True) + HB] and hold.committed
    loop.run_until(2.5)
    assert out[1:] == [HB] and hold.beats == 2


def test_a_write_to_the_client_postpones_the_heartbeat():
    hold, loop, out = make(interval=1.0)
    loop.run_until(1.0)
    loop.now = 1.5
    assert not hold.feed(b": ping\n\n", False)
    assert out[-1] == frame(b": ping\n\n")
    loop.run_until(2.4)
    assert out[-1] == frame(b": ping\n\n")  # not at 2.0: the ping went out at 1.5
    loop.run_until(2.5)
    assert out[-1] == HB


def test_heartbeat_commits_with_the_exchanges_head():
    hold, loop, out = make(interval=1.0)
    hold.keep(b"held")

    class Exchange:
        def commit_early(self) -> None:
            hold.writer.write(hold.hold.commit(b"REFRAMED HEAD"))

    hold.reply.hold_head(b"UPSTREAM HEAD", False, Exchange())
    loop.run_until(1.0)
    assert out == [b"REFRAMED HEAD", HB]


def test_committed_holds_events_and_passes_leading_comments():
    hold, loop, out = make(interval=1.0)
    loop.run_until(1.0)
    del out[:]
    assert not hold.feed(b': a\n\ndata: {"choices":[]}\n\n: b\n\nda', False)
    assert out == [frame(b": a\n\n")]
    assert not hold.feed(b"ta: x\n\n", False)
    assert out == [frame(b": a\n\n")]  # an event is held: what follows waits behind it
    assert hold.feed(b'data: {"content":"hi"}\n\n', True)
    assert out[1] == frame(b'data: {"choices":[]}\n\n: b\n\ndata: x\n\ndata: {"content":"hi"}\n\n')
    assert hold.open
    loop.run_until(10)
    assert len(out) == 2  # no heartbeat once open


def test_committed_http10_is_not_framed():
    hold, loop, out = make(interval=1.0, http11=False)
    loop.run_until(1.0)
    assert out == [H.synthetic_head(b"r1", False, False) + H.HEARTBEAT]
    hold.feed(b": p\n\n", False)
    assert out[-1] == b": p\n\n"
    assert not hold.fail("m", "t", "c")  # no keep-alive: the body ends by closing
    assert out[-1] == b'data: {"error":{"message":"m","type":"t","code":"c"}}\n\ndata: [DONE]\n\n'


def test_fail_is_one_error_event_done_and_the_last_chunk():
    hold, loop, out = make(interval=1.0)
    loop.run_until(1.0)
    hold.feed(b"data: {}\n\n", False)
    del out[:]
    assert hold.fail("Loading model", "unavailable_error", "upstream_503")
    assert out == [
        frame(
            b'data: {"error":{"message":"Loading model","type":"unavailable_error",'
            b'"code":"upstream_503"}}\n\ndata: [DONE]\n\n'
        )
        + b"0\r\n\r\n",
    ]
    # Nothing more is held or sent; no content went out (`open` says content did).
    assert hold.over and not hold.open


def test_finish_while_committed_ends_the_body():
    hold, loop, out = make(interval=1.0)
    loop.run_until(1.0)
    hold.feed(b"data: {}\n\n", False)
    del out[:]
    hold.finish()
    assert out == [frame(b"data: {}\n\n") + b"0\r\n\r\n"]


def test_retry_drops_what_the_failed_candidate_left():
    hold, loop, out = make(interval=1.0)
    loop.run_until(1.0)
    hold.feed(b"data: role\n\ndata: par", False)
    hold.reply.retry()
    assert (hold.parts, hold.pending) == ([], b"")
    del out[:]
    hold.feed(b'data: {"content":"x"}\n\n', True)
    assert out == [frame(b'data: {"content":"x"}\n\n')]


def test_error_of_the_first_held_event():
    hold, loop, _out = make(interval=1.0)
    loop.run_until(1.0)
    hold.feed(b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n', False)
    # (the string fields only: a numeric code is not passed on as the error's code)
    assert hold.error() == UpstreamErrorFields("boom", "server_error", None)
    assert H.error_of(b'{"error":"plain"}') == UpstreamErrorFields("plain", None, None)
    assert H.error_of(b'{"error":{"message":"","code":"c"}}') == UpstreamErrorFields(
        None, None, "c"
    )
    assert H.error_of(b'{"error":""}') == UpstreamErrorFields(None, None, None)
    assert H.error_of(b"not json") is None and H.error_of(b"[1]") is None


def test_client_gone_stops_the_heartbeat():
    hold, loop, out = make(interval=1.0)
    hold.writer.closed()
    loop.run_until(5)
    assert out == [] and not hold.sent


def test_no_interval_no_timer():
    _hold, loop, _out = make(interval=0)
    assert loop.timers == []


def test_an_event_a_byte_at_a_time_is_held_in_linear_time():
    import time

    hold, loop, out = make(interval=1.0)
    loop.run_until(1.0)
    del out[:]
    event = b"data: " + b"x" * 60000 + b"\n\n"
    t0 = time.process_time()
    for i in range(len(event)):
        assert not hold.feed(event[i : i + 1], False)
    assert time.process_time() - t0 < 1.0
    assert out == [] and hold.parts == [event] and hold.pending == b""
    hold.feed(b": c\n\nda", False)
    assert hold.parts == [event, b": c\n\n"] and hold.pending == b"da"


def test_a_partial_event_alone_is_pending_not_judged():
    hold, loop, out = make(interval=1.0)
    loop.run_until(1.0)
    del out[:]
    assert not hold.feed(b": pi", False)
    assert (out, hold.parts, hold.pending) == ([], [], b": pi")
    assert not hold.feed(b"ng\n\n", False)
    assert out == [frame(b": ping\n\n")] and hold.parts == []


# ---- the hold's size bound: 64 KiB held stays held, one byte more releases -----------------
LIMIT = 65536  # the bound written out (not read from the module)


def test_the_limit_is_64_kib():
    assert H.LIMIT == LIMIT


def test_waiting_holds_exactly_the_limit_and_releases_one_byte_past_it():
    hold, _loop, out = make(interval=0)
    hold.hold_head(b"HEAD", False)
    assert hold.take(b"x" * (LIMIT - 1), False, False) == H.HELD
    assert hold.take(b"x", False, False) == H.HELD  # exactly LIMIT held: still held
    assert out == [] and not hold.sent
    assert hold.take(b"y", False, False) == H.WRITTEN  # LIMIT + 1
    assert out == [b"HEAD" + b"x" * LIMIT + b"y"] and hold.open


def test_waiting_keep_is_over_the_limit_only_past_it():
    hold, _loop, out = make(interval=0)
    assert not hold.keep(b"x" * LIMIT)
    assert hold.keep(b"x")
    hold, _loop, out = make(interval=0)
    assert not hold.keep(b"x" * (LIMIT - 2)) and not hold.keep(b"xx")
    assert hold.keep(b"x") and out == []  # (`keep` only says so: `take` releases)


def committed() -> tuple[H.Hold, list]:
    hold, loop, out = make(interval=1.0)
    loop.run_until(1.0)  # the heartbeat committed the synthetic head
    del out[:]
    return hold, out


def event(size: int) -> bytes:
    """A non-comment event of exactly `size` bytes."""
    return b"data: " + b"x" * (size - 8) + b"\n\n"


def test_committed_holds_whole_events_of_exactly_the_limit():
    hold, out = committed()
    held = event(LIMIT - 100) + event(100)
    assert not hold.feed(held[: LIMIT - 100], False)
    assert not hold.feed(held[LIMIT - 100 :], False)  # LIMIT bytes of whole events
    assert out == [] and hold.size == LIMIT and hold.committed
    assert hold.feed(b"d", False)  # one byte of the next event: LIMIT + 1
    assert out == [frame(held + b"d")] and hold.open


@pytest.mark.parametrize("last", [b"x", b"\n"])  # the event grows in place / ends
def test_committed_holds_whole_events_and_an_unfinished_one_up_to_the_limit(last):
    hold, out = committed()
    whole = event(1000)
    line = b"data: " + b"x" * (LIMIT - 1000 - 7) + b"\n"  # one line of an unfinished event
    assert not hold.feed(whole + line, False)
    assert out == [] and hold.size + len(hold.pending) == LIMIT
    assert hold.feed(last, False)
    assert out == [frame(whole + line + last)] and hold.open


def test_committed_unfinished_event_growing_in_place_up_to_the_limit():
    hold, out = committed()
    assert not hold.feed(event(LIMIT - 10), False)  # a whole event held
    assert not hold.feed(b"data: ", False)  # an unfinished one after it
    assert not hold.feed(b"yyy", False)  # grows in place: LIMIT - 1
    assert not hold.feed(b"y", False)  # exactly LIMIT
    assert out == [] and hold.committed
    assert hold.feed(b"y", False)  # LIMIT + 1
    assert out == [frame(event(LIMIT - 10) + b"data: yyyyy")] and hold.open


def test_committed_one_unfinished_event_of_the_limit_stays_held():
    hold, out = committed()
    assert not hold.feed(b"data: " + b"x" * (LIMIT - 7), False)  # LIMIT - 1, unfinished
    assert not hold.feed(b"x", False)  # grows in place to exactly LIMIT
    assert out == [] and hold.parts == [] and len(hold.pending) == LIMIT
    assert hold.feed(b"x", False)
    assert out == [frame(b"data: " + b"x" * (LIMIT - 5))] and hold.open

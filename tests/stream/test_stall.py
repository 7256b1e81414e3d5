"""relay/stream/stall.py: StallPolicy deadlines and the exact stall frame bytes (no sockets), then
the stall guard over real sockets: every reason, every shape, exact bytes at the end."""

from __future__ import annotations

import asyncio
import json
import random
import socket

import pytest

from relay.stream import dialect
from relay.stream.stall import StallPolicy
from relay.stream.terminal import DONE_EVENT, stall_notice
from relay.stream.terminal import stall_frame as _stall_frame
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import rows_of, wait_for
from tests.support.httpc import sim_text
from tests.support.sockets import slow_client


def stall_frame(path, *args):
    """The frame of a stream nothing was scanned of, in the shape of the path's API."""
    return _stall_frame(None, dialect.from_path(path), *args)


INF = float("inf")


# ---- StallPolicy.due: truth table (head_at, last_read, now) -> reason ------------------------
@pytest.mark.parametrize(
    "idle,total,read,head,last,now,want",
    [
        # idle only
        (10, 0, 300, 0, 100, 109.999, None),
        (10, 0, 300, 0, 100, 110, "idle"),  # exactly at the deadline
        (10, 0, 300, 0, 100, 500, "idle"),
        (10, 0, 300, 0, 0, 9.999, None),
        (10, 0, 5, 0, 100, 106, None),  # read_s ignored when a bound is on
        (10, 0, 300, 0, 999, 1000, None),  # a huge total time never trips "total" when off
        # total only
        (0, 60, 300, 0, 59.9, 59.999, None),
        (0, 60, 300, 0, 0, 60, "total"),  # exactly at the deadline
        (0, 60, 300, 10, 10, 69.999, None),  # long idle gap never trips "idle" when off
        (0, 60, 300, 10, 10, 70, "total"),
        # both
        (10, 60, 300, 0, 50, 60, "total"),  # both due: total wins
        (10, 60, 300, 0, 45, 55, "idle"),
        (10, 60, 300, 0, 55, 59.999, None),
        (10, 60, 300, 0, 55, 65, "total"),
        (10, 60, 300, 0, 0, 10, "idle"),
        # both zero -> read with read_s
        (0, 0, 30, 0, 100, 129.999, None),
        (0, 0, 30, 0, 100, 130, "read"),
        (0, 0, 30, 0, 100, 10_000, "read"),
        (0, 0, 30, 0, 1000, 1001, None),  # no total bound at all
    ],
)
def test_due(idle, total, read, head, last, now, want):
    assert StallPolicy(idle_s=idle, total_s=total, read_s=read).due(now, head, last) == want


@pytest.mark.parametrize(
    "idle,total,read,head,last,want",
    [
        (10, 0, 300, 0, 100, 110),
        (0, 60, 300, 0, 100, 60),
        (10, 60, 300, 0, 45, 55),
        (10, 60, 300, 0, 55, 60),
        (10, 60, 300, 0, 50, 60),
        (0, 0, 30, 0, 100, 130),
        (0, 0, 30, 7, 7, 37),
    ],
)
def test_next_check(idle, total, read, head, last, want):
    p = StallPolicy(idle_s=idle, total_s=total, read_s=read)
    assert p.next_check(head, last) == want
    assert p.due(want, head, last) is not None
    assert p.due(want - 0.001, head, last) is None


def test_next_check_is_the_earliest_due_moment_random():
    rnd = random.Random(7)
    for _ in range(2000):
        idle = rnd.choice([0, 1, 10, 300])
        total = rnd.choice([0, 5, 60, 900])
        p = StallPolicy(idle_s=idle, total_s=total, read_s=rnd.choice([30, 300]))
        head = rnd.randint(0, 1000)
        last = head + rnd.randint(0, 2000)
        at = p.next_check(head, last)
        assert at < INF
        assert p.due(at, head, last) is not None
        assert p.due(at - 0.5, head, last) is None


@pytest.mark.parametrize(
    "reason,now,head,last,want",
    [
        ("total", 100.0, 10.0, 95.0, 90.0),
        ("idle", 100.0, 10.0, 95.0, 5.0),
        ("read", 130.0, 0.0, 100.0, 30.0),
        ("idle", 100.12345, 0.0, 0.0, 100.123),
        ("total", 0.3, 0.1, 0.2, 0.2),
    ],
)
def test_elapsed(reason, now, head, last, want):
    assert StallPolicy(1, 1, 1).elapsed(reason, now, head, last) == want


# ---- stall_frame exact bytes ----------------------------------------------------------------
CHAT_EXPECTED = (
    b'\n\ndata: {"id":"relay-stall-guard","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"llm-7b","choices":[{"index":0,"delta":{"role":"assistant","content":'
    b'"\\n\\n[relay] stall guard: idle after 300.0s"},"finish_reason":"length"}],'
    b'"x_relay_stall":{"reason":"idle","elapsed_s":300.0,"upstream":"llm"}}\n\n'
    b"data: [DONE]\n\n"
)
LEGACY_EXPECTED = (
    b'\n\ndata: {"id":"relay-stall-guard","object":"text_completion","created":1700000000,'
    b'"model":"llm-7b","choices":[{"index":0,"text":'
    b'"\\n\\n[relay] stall guard: total after 12.345s","finish_reason":"length"}],'
    b'"x_relay_stall":{"reason":"total","elapsed_s":12.345,"upstream":"gpu-1"}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions", "/", "/v1/foo"])
def test_chat_shape_exact(path):
    assert stall_frame(path, "llm-7b", "idle", 300.0, "llm", 1700000000) == CHAT_EXPECTED


@pytest.mark.parametrize("path", ["/v1/completions", "/completions"])
def test_legacy_shape_exact(path):
    assert stall_frame(path, "llm-7b", "total", 12.345, "gpu-1", 1700000000) == LEGACY_EXPECTED


def _event(frame: bytes) -> dict:
    assert frame.startswith(b"\n\ndata: ")
    assert frame.endswith(b"\n\n" + DONE_EVENT)
    body = frame[len(b"\n\ndata: ") : -len(b"\n\n" + DONE_EVENT)]
    assert b"\n" not in body  # one compact line
    return json.loads(body)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/completions"])
@pytest.mark.parametrize("reason", ["total", "idle", "read"])
def test_frame_structure(path, reason):
    frame = stall_frame(path, 'm"\u00e9', reason, 1.5, "up", 42)
    assert frame.count(b"data: [DONE]") == 1 and frame.endswith(b"data: [DONE]\n\n")
    assert frame.count(b"\n\n") == 3  # leading blank line, end of event, end of [DONE]
    obj = _event(frame)
    assert list(obj) == ["id", "object", "created", "model", "choices", "x_relay_stall"]
    assert obj["id"] == "relay-stall-guard" and obj["created"] == 42
    assert obj["model"] == 'm"\u00e9'
    assert obj["x_relay_stall"] == {"reason": reason, "elapsed_s": 1.5, "upstream": "up"}
    [choice] = obj["choices"]
    notice = f"\n\n[relay] stall guard: {reason} after 1.5s"
    if path == "/v1/chat/completions":
        assert obj["object"] == "chat.completion.chunk"
        assert choice == {
            "index": 0,
            "delta": {"role": "assistant", "content": notice},
            "finish_reason": "length",
        }
        assert list(choice) == ["index", "delta", "finish_reason"]
    else:
        assert obj["object"] == "text_completion"
        assert choice == {"index": 0, "text": notice, "finish_reason": "length"}
        assert list(choice) == ["index", "text", "finish_reason"]


def test_stall_notice_and_done_event():
    assert stall_notice("read", 30.0) == "\n\n[relay] stall guard: read after 30.0s"
    assert DONE_EVENT == b"data: [DONE]\n\n"


def test_policy_is_immutable():
    p = StallPolicy(1, 2, 3)
    with pytest.raises(AttributeError):
        p.idle_s = 5


# ---- the stall guard over real sockets ----------------------------------------------------------
TAIL = b"data: [DONE]\n\n"


def synthetic(resp) -> dict:
    """The one synthetic event: the last event before [DONE]."""
    body = resp.body
    assert body.endswith((b"\n\n" + TAIL, TAIL))
    assert body.count(b"data: [DONE]") == 1
    events = resp.events()
    assert events[-1].strip(b"\n") == b"data: [DONE]"
    return json.loads(events[-2].strip(b"\n")[len(b"data: ") :])


async def test_idle_stall_ends_stream_with_chat_frame(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(50, model="tiny-model", stall_after=3)
    )
    assert resp.status == 200 and resp.complete  # ended cleanly: terminating chunk present
    frame = synthetic(resp)
    assert list(frame) == ["id", "object", "created", "model", "choices", "x_relay_stall"]
    assert frame["id"] == "relay-stall-guard" and frame["object"] == "chat.completion.chunk"
    assert frame["model"] == "tiny-model"
    stall = frame["x_relay_stall"]
    assert stall["reason"] == "idle" and stall["upstream"] == "llm"
    assert 0.2 <= stall["elapsed_s"] < 1.0
    choice = frame["choices"][0]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert choice["delta"] == {
        "role": "assistant",
        "content": f"\n\n[relay] stall guard: idle after {stall['elapsed_s']}s",
    }
    tokens = [
        e
        for e in resp.data_events()
        if isinstance(e, dict)
        and e["choices"]
        and e["choices"][0].get("delta", {}).get("content")
        and e["id"] != "relay-stall-guard"
    ]
    assert len(tokens) == 3
    # the guard closed the upstream connection, and logged the trip
    await asyncio.wait_for(sim.requests[-1].closed.wait(), 2)
    trip = app.log.of("stream_stall_guard_tripped")
    assert [(t["reason"], t["upstream"], t["request_id"]) for t in trip] == [
        ("idle", "llm", resp.header("x-request-id"))
    ]
    assert trip[0]["elapsed_s"] == stall["elapsed_s"]
    access = app.log.of("access")[-1]
    assert access["error_code"] == "stream_stall_idle" and access["completion_tokens"] == 3


async def test_total_stall_cuts_a_chatty_stream(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0, stream_total_timeout_s=0.3)
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(model="m", chatty=True, interval_ms=10)
    )
    frame = synthetic(resp)
    assert frame["x_relay_stall"]["reason"] == "total"
    assert 0.3 <= frame["x_relay_stall"]["elapsed_s"] < 1.5
    assert resp.complete
    await asyncio.wait_for(sim.requests[-1].closed.wait(), 2)
    assert sim.requests[-1].peer_closed_at is not None


async def test_read_reason_when_both_bounds_are_zero(make_relay, sim):
    app = await make_relay(
        stream_idle_timeout_s=0, stream_total_timeout_s=0, direct_read_timeout_s=0.25
    )
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(10, stall_after=2)
    )
    frame = synthetic(resp)
    assert frame["x_relay_stall"]["reason"] == "read"
    assert frame["x_relay_stall"]["elapsed_s"] >= 0.25


async def test_idle_beats_total_when_it_comes_first(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.15, stream_total_timeout_s=5)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(9, stall_after=1))
    assert synthetic(resp)["x_relay_stall"]["reason"] == "idle"


def parsed_events(body: bytes) -> list:
    """Every event's data as JSON ([DONE] as is): an SDK's view, failing as one would."""
    out = []
    for ev in body.split(b"\n\n"):
        for line in ev.split(b"\n"):
            if line.startswith(b"data: "):
                data = line[6:]
                out.append(data if data == b"[DONE]" else json.loads(data))
    return out


async def test_stall_in_the_middle_of_a_data_line(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(9, stall_after=2, stall_mid_line=True)
    )
    body = resp.body
    # the half line is finished so that it parses (the text as far as it came), then the
    # synthetic event: every event is JSON an SDK reads
    events = parsed_events(body)
    assert events[-1] == b"[DONE]" and events[-2]["x_relay_stall"]["reason"] == "idle"
    half = events[-3]
    assert half["choices"][0]["delta"]["content"] in sim_text(3)
    assert resp.complete


async def test_stall_in_the_middle_of_a_chunk(make_relay, sim):
    """The upstream announced a chunk and sent half of it: the owed bytes are filled."""
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(9, stall_after=2, stall_mid_chunk=True)
    )
    assert resp.complete  # strict de-chunking succeeded: the framing is valid
    frame = synthetic(resp)
    assert frame["x_relay_stall"]["reason"] == "idle"
    body = resp.body
    cut = body.index(b'data: {"id":"relay-stall-guard"')
    # the half event finished (it parses), then only newlines (the padding of the owed
    # chunk bytes) before the synthetic one
    head = body[:cut].rstrip(b"\n")
    assert head.endswith(b"}") and body[len(head) : cut].strip(b"\n") == b""
    assert body[len(head) : cut].count(b"\n") >= 2
    assert parsed_events(body)[-1] == b"[DONE]"


async def test_legacy_completions_shape(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    body = {
        "model": "legacy",
        "prompt": "How are you?",
        "max_tokens": 9,
        "stream": True,
        "sim": {"stall_after": 2},
    }
    resp = await httpc.fetch(app.port, "POST", "/v1/completions", body)
    frame = synthetic(resp)
    assert frame["object"] == "text_completion"
    choice = frame["choices"][0]
    assert "delta" not in choice
    assert (
        choice["text"]
        == f"\n\n[relay] stall guard: idle after {frame['x_relay_stall']['elapsed_s']}s"
    )
    assert choice["finish_reason"] == "length"


def test_native_shape_exact():
    # llama-server's native /completion ends with `"stop":true`, never `[DONE]`
    assert stall_frame("/completion", "m", "idle", 2.0, "llm", 1) == (
        b'\n\ndata: {"content":"\\n\\n[relay] stall guard: idle after 2.0s","stop":true,'
        b'"stop_type":"limit","x_relay_stall":{"reason":"idle","elapsed_s":2.0,"upstream":"llm"}}'
        b"\n\n"
    )


async def test_native_completion_never_gets_done(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    ok = await httpc.fetch(
        app.port, "POST", "/completion", {"prompt": "Say hi", "n_predict": 3, "stream": True}
    )
    assert b"[DONE]" not in ok.body and ok.complete
    stalled = await httpc.fetch(
        app.port,
        "POST",
        "/completion",
        {"prompt": "Say hi", "n_predict": 9, "stream": True, "sim": {"stall_after": 1}},
    )
    assert b"[DONE]" not in stalled.body and stalled.complete
    last = json.loads(stalled.body.rstrip(b"\n").rsplit(b"\n\n", 1)[1][len(b"data: ") :])
    assert last["stop"] is True and last["stop_type"] == "limit"
    assert last["x_relay_stall"]["reason"] == "idle"


async def test_non_sse_body_is_cut_with_nothing_injected(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(
        app.port,
        "POST",
        "/v1/chat/completions",
        {"sim": {"body_kind": "octet", "tokens": 9, "stall_after": 3}},
    )
    assert resp.status == 200
    assert resp.header("content-type") == "application/octet-stream"
    assert not resp.complete  # no terminating chunk: the client can tell it was cut
    direct = sim.requests[-1]
    await asyncio.wait_for(direct.closed.wait(), 2)
    assert b"relay" not in resp.body and b"[DONE]" not in resp.body
    assert app.log.of("stream_stall_guard_tripped")[0]["reason"] == "idle"
    assert app.log.of("access")[-1]["error_code"] == "stream_stall_idle"


async def test_stall_before_first_content_still_ends_cleanly(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(5, stall_after=0))
    assert resp.status == 200 and resp.complete
    events = resp.data_events()
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert events[1]["id"] == "relay-stall-guard" and events[2] == "[DONE]" and len(events) == 3


async def test_keep_alive_survives_a_stall(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.15, stream_total_timeout_s=0)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    first = await httpc.exchange(
        reader, writer, "POST", "/v1/chat/completions", httpc.chat(5, stall_after=1)
    )
    second = await httpc.exchange(reader, writer, "GET", "/health")
    writer.close()
    assert first.complete and synthetic(first)["x_relay_stall"]["reason"] == "idle"
    assert second.json() == {"status": "ok"}


# ---- a stall after the upstream's own [DONE] ------------------------------------------------
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def sends(body: bytes):
    """An upstream that sends `body` at once and then nothing more, keeping its connection
    open until the relay closes it (a body without its end stalls there)."""

    async def script(up, index, reader, writer):
        if await up.read_request(reader) is None:
            return
        writer.write(body)
        await writer.drain()
        await reader.read()  # until the relay closes its end

    return script


@pytest.mark.parametrize("framing", ["chunked", "close"])
async def test_a_stall_after_done_ends_the_body_with_nothing_more(make_relay, framing):
    """The upstream sends its `[DONE]` and then neither ends the body nor closes: the stall
    guard trips, and as the `[DONE]` already reached the client it adds no stall event and
    no second `[DONE]`, only what ends the body (the last chunk)."""
    if framing == "chunked":
        body = SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunk(CONTENT) + chunk(TAIL)
    else:  # no framing header: the body would end at the close
        body = SSE_HEAD + b"\r\n" + CONTENT + TAIL
    up = await Scripted(sends(body)).start()
    app = await make_relay(url=up.url, stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(5), timeout=5)
    assert resp.status == 200 and resp.complete  # the last chunk came: a clean end
    assert resp.header("transfer-encoding") == "chunked"
    assert resp.body.count(b"data: [DONE]") == 1 and b"relay-stall-guard" not in resp.body
    assert resp.body == CONTENT + TAIL
    if framing == "chunked":  # passed through as the upstream framed it, then the last chunk
        assert resp.raw_body == chunk(CONTENT) + chunk(TAIL) + b"0\r\n\r\n"
    else:  # the relay's own chunks (as the reads came), then the last chunk
        assert resp.raw_body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    [row] = await rows_of(app, 1)
    assert (row["status"], row["error_code"]) == (200, "stream_stall_idle")
    assert [t["reason"] for t in app.log.of("stream_stall_guard_tripped")] == ["idle"]
    await up.stop()


def token(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i


async def test_a_client_too_slow_to_read_is_not_a_stalled_upstream(make_relay):
    """Upstream reads pause while the client reads nothing (the relay's write buffer over its
    high-water mark): for longer than the idle bound, reads are not owed, and the stream ends
    whole once the client reads it all."""
    n = 20000  # about 1.2 MB: far more than the relay buffers for one client
    events = b"".join(token(i) for i in range(n)) + TAIL
    body = (
        SSE_HEAD
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + b"".join(chunk(events[i : i + 4096]) for i in range(0, len(events), 4096))
        + b"0\r\n\r\n"
    )
    up = await Scripted(sends(body)).start()
    idle = 0.2
    app = await make_relay(url=up.url, stream_idle_timeout_s=idle, stream_total_timeout_s=0)
    sock, conn, head = await slow_client(app, httpc.chat(5))
    assert head.status == 200
    await wait_for(lambda: conn.exchange is not None and conn.exchange.flow is not None)
    ex = conn.exchange
    assert ex.flow.paused and not ex.conn.transport.is_reading()
    await asyncio.sleep(3 * idle)  # the client reads nothing for three idle bounds
    assert ex.ending is None and ex.flow.paused  # not tripped: still waiting on the client
    assert app.log.of("stream_stall_guard_tripped") == []
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    reader, writer = await asyncio.open_connection(sock=sock)
    await asyncio.wait_for(httpc.read_body(reader, head), 10)
    writer.close()
    assert head.complete
    assert b"relay-stall-guard" not in head.body
    assert head.body == events
    [row] = await rows_of(app, 1)
    assert (row["status"], row["ok"], row["error_code"]) == (200, 1, None)
    assert row["completion_tokens"] == n
    assert app.log.of("stream_stall_guard_tripped") == []
    await up.stop()

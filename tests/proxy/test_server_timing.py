"""The relay's `Server-Timing` line on answers that went upstream (issue 35 item 4): its own time
before the upstream write (`relay`), the slot's queue wait (`queue`), the upstream's time to its
response head (`upstream`) and from there to the read that let the head go out (`hold`: an event
stream's first content event), so a benchmark client can take the relay out of what it measured.

Every bound is one the test measured itself: the client stamps just before its request is
written and just after the response head is read (perf_counter, the relay's clock, in this
process), so the three durations lie inside that window; a head the test's upstream wrote a
measured while after it read the request cannot have been read by the relay sooner after the
relay wrote it; a slot the test held from the moment it saw the second request queued to the
moment it let go was waited for at least that long; a head the test saw the relay read before
it let the upstream write the first content event was held at least that long.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from relay.config import UpstreamConfig
from relay.http.to_client import server_timing
from relay.sim import wire as W
from relay.sim.frames import StreamFrames
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import CHAT, closed_port, wait_for

# ms: the relay's durations are written to the microsecond (3 decimals), rounded.
ROUNDING = 0.0005
HEAD_DELAY_MS = 60.0
WHOLE = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}'


def test_the_line_is_w3c_server_timing_in_ms_to_the_microsecond():
    assert server_timing(0.2344, 0.0, 12.3456, 1500.0) == (
        b"Server-Timing: relay;dur=0.234, queue;dur=0.000, upstream;dur=12.346, hold;dur=1500.000"
    )


def timings(resp: httpc.Response) -> list[dict[str, float]]:
    """Every `Server-Timing` field line of a head, each as {metric: dur} (W3C Server Timing:
    metrics separated by commas, parameters by semicolons, `dur` in ms)."""
    out = []
    for name, value in resp.headers:
        if name.lower() != "server-timing":
            continue
        metrics: dict[str, float] = {}
        for metric in value.split(","):
            name_, *params = (p.strip() for p in metric.split(";"))
            durs = [float(p.split("=", 1)[1]) for p in params if p.startswith("dur=")]
            metrics[name_] = durs[0] if durs else float("nan")
        out.append(metrics)
    return out


def relays_line(resp: httpc.Response) -> dict[str, float]:
    """The relay's own line: the one naming its three metrics."""
    [mine] = [t for t in timings(resp) if set(t) == {"relay", "queue", "upstream", "hold"}]
    return mine


async def timed(port: int, body: dict) -> tuple[httpc.Response, float]:
    """The response (read whole) and the client's own time to its head in ms, from just
    before the request is written to just after the head is read, on an open connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        request = httpc.build_request("POST", CHAT, body)
        t0 = time.perf_counter()
        writer.write(request)
        resp = await asyncio.wait_for(httpc.read_head(reader), 10)
        to_head = (time.perf_counter() - t0) * 1000
        await asyncio.wait_for(httpc.read_body(reader, resp), 10)
        return resp, to_head
    finally:
        writer.close()


class Delayed:
    """An upstream that waits `HEAD_DELAY_MS` between reading a request and writing its head,
    and stamps both (perf_counter, this process): `waited`, the ms it measured between them."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.waited = 0.0

    async def script(self, up, index, reader, writer) -> None:
        while await up.read_request(reader) is not None:
            read_at = time.perf_counter()
            await asyncio.sleep(HEAD_DELAY_MS / 1000)
            if self.stream:
                frames = StreamFrames(W.Kind.CHAT, "tiny", 3)
                body = W.chunk((frames.role_event() or b"") + frames.event(0))
                out = W.SSE_HEAD + body + W.chunk(W.DONE_EVENT) + W.TERMINATOR
            else:
                out = (
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(WHOLE), WHOLE)
                )
            self.waited = (time.perf_counter() - read_at) * 1000
            writer.write(out)
            await writer.drain()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_relayed_answer_says_the_upstreams_time_to_head(make_relay, stream):
    delayed = Delayed(stream)
    up = await Scripted(delayed.script).start()
    app = await make_relay(upstreams=[UpstreamConfig(name="llm", url=up.url)])
    resp, to_head = await timed(app.port, httpc.chat(3, stream=stream))
    await up.stop()
    assert resp.status == 200 and resp.complete
    t = relays_line(resp)
    # The upstream read the request after the relay wrote it, and wrote its head after the
    # wait it measured; the relay read the head after that.
    # (uvloop's timers keep to the millisecond.)
    assert delayed.waited > HEAD_DELAY_MS - 2
    assert t["upstream"] >= delayed.waited - ROUNDING, (t, delayed.waited)
    # Nothing of it lies outside what the client waited for the head.
    assert sum(t.values()) <= to_head + 4 * ROUNDING, (t, to_head)
    assert t["queue"] >= 0 and t["relay"] >= 0
    # The head and the first content event came in one write, so in one read: no hold.
    assert t["hold"] == 0, t
    # One line for the relay: no upstream line here (this upstream sends none).
    assert len(timings(resp)) == 1


async def test_the_hold_is_the_wait_from_the_head_to_the_first_content_event(make_relay):
    gate = asyncio.Event()

    async def script(up, index, reader, writer) -> None:
        await up.read_request(reader)
        frames = StreamFrames(W.Kind.CHAT, "tiny", 3)
        # The head and the role event at once (as vLLM sends its head), content later.
        writer.write(W.SSE_HEAD + W.chunk(frames.role_event() or b""))
        await writer.drain()
        await asyncio.wait_for(gate.wait(), 10)
        writer.write(W.chunk(frames.event(0)) + W.chunk(W.DONE_EVENT) + W.TERMINATOR)
        await writer.drain()

    up = await Scripted(script).start()
    app = await make_relay(upstreams=[UpstreamConfig(name="llm", url=up.url)])
    asked = asyncio.create_task(timed(app.port, httpc.chat(1)))
    await wait_for(lambda: any(c.exchange is not None and c.exchange.head_at for c in app.clients))
    seen = time.perf_counter()
    # The first content event is kept back on purpose: the hold the answer must report.
    await asyncio.sleep(0.05)
    held_ms = (time.perf_counter() - seen) * 1000
    gate.set()
    resp, to_head = await asyncio.wait_for(asked, 10)
    await up.stop()
    assert resp.status == 200 and resp.complete
    t = relays_line(resp)
    assert t["hold"] >= held_ms - ROUNDING, (t, held_ms)
    assert sum(t.values()) <= to_head + 4 * ROUNDING, (t, to_head)


async def test_the_queue_wait_is_at_least_what_the_slot_was_held(make_relay, sim):
    app = await make_relay(parallel=1)
    up = app.upstreams["llm"]
    # The first stream stalls after one token: its slot stays taken until its client leaves.
    r1, w1 = await asyncio.open_connection("127.0.0.1", app.port)
    w1.write(httpc.build_request("POST", CHAT, httpc.chat(9, stall_after=1)))
    first = await asyncio.wait_for(httpc.read_head(r1), 10)
    assert first.status == 200 and relays_line(first)["queue"] < 1000
    second = asyncio.create_task(timed(app.port, httpc.chat(3)))
    await wait_for(lambda: up.slots.queued == 1)
    queued_seen = time.perf_counter()
    # The slot is held a while longer on purpose: the wait the second request must report.
    await asyncio.sleep(0.05)
    held_ms = (time.perf_counter() - queued_seen) * 1000
    w1.transport.abort()
    resp, to_head = await asyncio.wait_for(second, 10)
    assert resp.status == 200
    t = relays_line(resp)
    assert t["queue"] >= held_ms - ROUNDING, (t, held_ms)
    assert sum(t.values()) <= to_head + 4 * ROUNDING, (t, to_head)


async def test_an_upstreams_own_server_timing_crosses_beside_the_relays(make_relay):
    body = WHOLE

    async def script(up, index, reader, writer) -> None:
        while (head := await up.read_request(reader)) is not None:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b'Server-Timing: gpu;dur=12.5;desc="prefill", cache;desc=hit\r\n'
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            assert head

    up = await Scripted(script).start()
    app = await make_relay(upstreams=[UpstreamConfig(name="llm", url=up.url)])
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(1, stream=False))
    await up.stop()
    assert resp.status == 200 and resp.body == body
    lines = [v for k, v in resp.headers if k.lower() == "server-timing"]
    # The upstream's line as it sent it, and the relay's on a line of its own.
    assert lines[0] == 'gpu;dur=12.5;desc="prefill", cache;desc=hit'
    assert set(timings(resp)[1]) == {"relay", "queue", "upstream", "hold"}
    assert len(lines) == 2


async def test_a_head_committed_by_a_heartbeat_carries_the_line(make_relay):
    # The simulator sends its head at once and the first token 400 ms later: the heartbeat
    # (every 50 ms) commits the upstream's own head meanwhile.
    app = await make_relay(heartbeat_s=0.05)
    resp, to_head = await timed(app.port, httpc.chat(2, first_token_delay_ms=400))
    assert resp.status == 200 and resp.complete
    assert resp.body.startswith(b": relay heartbeat")
    t = relays_line(resp)
    assert sum(t.values()) <= to_head + 4 * ROUNDING, (t, to_head)


async def test_the_relays_own_answers_carry_none(make_relay, sim):
    # What never went upstream has no upstream time: the relay's endpoints, its refusals, and
    # its answer when the upstream could not be reached.
    ups = [
        UpstreamConfig(name="llm", url=sim.url, models=["tiny"]),
        UpstreamConfig(name="gone", url=f"http://127.0.0.1:{closed_port()}", models=["gone"]),
    ]
    app = await make_relay(upstreams=ups)
    for method, path, body, status in [
        ("GET", "/health", None, 200),
        ("GET", "/metrics", None, 200),
        ("POST", CHAT, httpc.chat(2, model="no-such-model"), 404),
        ("POST", CHAT, httpc.chat(2, model="gone"), 502),
    ]:
        resp = await httpc.fetch(app.port, method, path, body)
        assert resp.status == status, (path, resp.status)
        assert timings(resp) == [], (path, resp.headers)
    # A request the relay passes through does carry it.
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2, model="tiny"))
    assert resp.status == 200 and set(relays_line(resp)) == {"relay", "queue", "upstream", "hold"}

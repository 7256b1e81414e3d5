"""Metrics over real sockets: /api/slots/metrics and /metrics checked against what the
simulator (or a scripted upstream) actually sent."""

from __future__ import annotations

import asyncio
import json
import time
from itertools import pairwise

from prometheus_client.parser import text_string_to_metric_families

from relay.http.chunked import frame
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import LOOP_EARLY_MS, rows, wait_for

CHAT = "/v1/chat/completions"


async def snapshot(app, name: str = "llm") -> dict:
    resp = await httpc.fetch(app.port, "GET", "/api/slots/metrics")
    assert resp.status == 200 and resp.header("content-type") == "application/json"
    return resp.json()[name]


async def prometheus(app) -> dict[tuple, float]:
    """Every sample of /metrics as {(sample name, sorted labels): value}, via prometheus_client."""
    resp = await httpc.fetch(app.port, "GET", "/metrics")
    assert resp.status == 200
    assert resp.header("content-type").startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(resp.body.decode()):
        assert family.name.startswith("relay_")
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def up(**labels) -> tuple:
    return tuple(sorted({"upstream": "llm", **labels}.items()))


async def settled(app, n: int) -> list[dict]:
    """The rows once `n` requests are settled (their slots back)."""
    await wait_for(lambda: app.upstreams["llm"].slots.in_flight == 0)
    got = rows(app)
    assert len(got) == n
    return got


# ---- counts ----------------------------------------------------------------------------
async def test_request_and_token_counters_equal_what_the_simulator_sent(make_relay, sim):
    app = await make_relay()
    streams = [3, 7, 12, 1, 20]
    plain = [4, 9]
    for n in streams:
        resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(n))
        assert resp.status == 200 and resp.complete
    for n in plain:
        resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(n, stream=False))
        assert resp.status == 200
    resp = await httpc.fetch(
        app.port, "POST", CHAT, {**httpc.chat(6), "stream_options": {"include_usage": True}}
    )
    assert resp.data_events()[-2]["usage"]["completion_tokens"] == 6
    got = await settled(app, 8)
    expected = sum(streams) + sum(plain) + 6
    assert sim.tokens_sent_total == expected
    assert [(r["completion_tokens"], r["tokens_source"]) for r in got] == [
        (n, "exact") for n in streams + plain + [6]
    ]

    snap = await snapshot(app)
    assert snap["requests_total"] == 8 and snap["requests_failed"] == 0
    assert snap["tokens_total"] == expected
    assert snap["stall_trips"] == {"total": 0, "idle": 0, "read": 0}
    assert snap["failures_by_code"] == {}
    assert (snap["name"], snap["state"], snap["parallel"], snap["in_flight"], snap["queued"]) == (
        "llm",
        "ready",
        256,
        0,
        0,
    )
    assert snap["queue_wait_count"] == 8

    prom = await prometheus(app)
    assert prom[("relay_requests_total", up())] == 8
    assert prom[("relay_tokens_total", up())] == expected
    assert prom[("relay_slots_parallel", up())] == 256
    assert prom[("relay_slots_in_flight", up())] == 0
    assert prom[("relay_queue_waiting", up())] == 0
    assert prom[("relay_upstream_up", up())] == 1
    assert {
        s: prom[("relay_upstream_state", up(state=s))]
        for s in ("ready", "serving", "loading", "down", "unknown")
    } == {"ready": 1, "serving": 0, "loading": 0, "down": 0, "unknown": 0}
    assert prom[("relay_queue_wait_seconds_count", up())] == 8
    assert not [k for k in prom if k[0] == "relay_requests_failed_total"]


async def test_requests_that_generate_nothing_are_counted_apart(make_relay, sim):
    """GET /props, GET /v1/models (forwarded: no upstream lists its models) and POST /tokenize
    move `relay_other_requests_total`, never `relay_requests_total` or a latency histogram."""
    app = await make_relay()
    for method, path, body in (
        ("GET", "/props", None),
        ("GET", "/v1/models", None),
        ("GET", "/props", None),
        ("POST", "/tokenize", {"content": "hello"}),
    ):
        resp = await httpc.fetch(app.port, method, path, body)
        assert resp.status == 200, path
    assert {r.path for r in sim.requests} == {"/props", "/v1/models", "/tokenize"}  # forwarded
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))  # and one that generates
    assert resp.status == 200 and resp.complete
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2, stream=False))
    assert resp.status == 200
    got = await settled(app, 6)
    assert [r["path"] for r in got].count("/props") == 2
    prom = await prometheus(app)
    assert prom[("relay_requests_total", up())] == 2
    assert prom[("relay_other_requests_total", up())] == 4
    assert prom[("relay_time_to_first_token_seconds_count", up())] == 1  # the stream
    assert prom[("relay_e2e_request_latency_seconds_count", up())] == 2
    assert prom[("relay_time_per_output_token_seconds_count", up())] == 1
    snap = await snapshot(app)
    assert (snap["requests_total"], snap["other_requests_total"]) == (2, 4)
    # the page's state: the same split
    doc = (await httpc.fetch(app.port, "GET", "/api/ui/state")).json()
    [u] = doc["upstreams"]
    assert (u["requests_total"], u["other_requests_total"]) == (2, 4)
    assert [r["path"] for r in doc["recent"]] == [CHAT, CHAT]
    assert sorted(r["path"] for r in doc["recent_other"]) == [
        "/props",
        "/props",
        "/tokenize",
        "/v1/models",
    ]


async def test_stall_trips_by_reason_and_the_stall_event_is_no_token(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(30, stall_after=3))
    assert resp.complete and b"relay-stall-guard" in resp.body
    [row] = await settled(app, 1)
    assert (row["ok"], row["error_code"], row["completion_tokens"], row["tokens_source"]) == (
        0,
        "stream_stall_idle",
        3,
        "approx",
    )
    snap = await snapshot(app)
    assert snap["stall_trips"] == {"total": 0, "idle": 1, "read": 0}
    assert snap["requests_total"] == 1 and snap["requests_failed"] == 1
    assert snap["failures_by_code"] == {"stream_stall_idle": 1}
    assert snap["tokens_total"] == 3 == sim.tokens_sent_total
    prom = await prometheus(app)
    assert prom[("relay_stall_trips_total", up(reason="idle"))] == 1
    assert prom[("relay_stall_trips_total", up(reason="total"))] == 0
    assert prom[("relay_stall_trips_total", up(reason="read"))] == 0
    assert prom[("relay_requests_failed_total", up(code="stream_stall_idle"))] == 1
    assert prom[("relay_tokens_total", up())] == 3


async def test_stall_before_any_content_is_no_ttft_sample(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(5, stall_after=0))
    events = resp.data_events()
    assert events[1]["id"] == "relay-stall-guard" and events[1]["choices"][0]["delta"]["content"]
    [row] = await settled(app, 1)
    assert row["ttft_ms"] is None and row["completion_tokens"] == 0
    snap = await snapshot(app)
    assert snap["ttft_seconds"] is None and snap["ttft_avg_seconds"] is None
    assert snap["tokens_total"] == 0 and snap["stall_trips"]["idle"] == 1
    prom = await prometheus(app)
    assert ("relay_ttft_seconds", up()) not in prom


# ---- TTFT ------------------------------------------------------------------------------
async def test_ttft_is_taken_at_the_first_content_event(make_relay, sim):
    app = await make_relay()
    slow = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(4, first_token_delay_ms=150))
    first = slow.data_events()[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}  # role-only
    slow_row = (await settled(app, 1))[0]
    snap = await snapshot(app)
    assert slow_row["ttft_ms"] >= 150 - LOOP_EARLY_MS
    assert abs(snap["ttft_seconds"] * 1000 - slow_row["ttft_ms"]) < 0.001
    assert snap["ttft_avg_seconds"] == snap["ttft_seconds"]

    fast = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(4))
    assert fast.status == 200
    fast_row = (await settled(app, 2))[1]
    assert fast_row["ttft_ms"] < slow_row["ttft_ms"] - 100
    snap = await snapshot(app)
    assert abs(snap["ttft_seconds"] * 1000 - fast_row["ttft_ms"]) < 0.001
    mean_ms = (slow_row["ttft_ms"] + fast_row["ttft_ms"]) / 2
    assert abs(snap["ttft_avg_seconds"] * 1000 - mean_ms) < 0.001
    prom = await prometheus(app)
    assert prom[("relay_ttft_seconds", up())] == snap["ttft_seconds"]
    assert prom[("relay_ttft_avg_seconds", up())] == snap["ttft_avg_seconds"]


async def test_non_streamed_request_is_no_ttft_sample(make_relay, sim):
    app = await make_relay()
    assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(5, stream=False))).status == 200
    [row] = await settled(app, 1)
    assert row["ttft_ms"] is None and row["stream"] == 0
    snap = await snapshot(app)
    assert snap["ttft_seconds"] is None and snap["tokens_total"] == 5


# ---- the approximate count: markers split across chunks and reads ---------------------------
def split_marker_stream(n: int) -> tuple[list[bytes], bytes]:
    """(pieces to write, the chunked body): SSE without usage/timings, n content events, and
    every `"content":"` marker cut across two chunks and across two writes."""
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'
    events = [role]
    for i in range(n):
        events.append(b'data: {"choices":[{"index":0,"delta":{"content":"t%d "}}]}\n\n' % i)
    events.append(b'data: {"choices":[{"index":0,"delta":{"content":""}}]}\n\n')  # empty: no token
    events.append(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')
    events.append(b"data: [DONE]\n\n")
    payload = b"".join(events)
    # chunk boundaries inside each marker, 4 bytes into it
    cuts, pos = [], 0
    while (i := payload.find(b'"content":"', pos)) >= 0:
        cuts.append(i + 4)
        pos = i + 1
    bounds = [0, *cuts, len(payload)]
    chunks = [payload[a:b] for a, b in pairwise(bounds)]
    body = b"".join(frame(c) for c in chunks) + b"0\r\n\r\n"
    # write boundaries inside the markers too, at another offset (and inside size lines)
    wcuts, pos = [], 0
    while (i := body.find(b'"content', pos)) >= 0:
        wcuts.append(i + 7)
        pos = i + 1
    wbounds = [0, *wcuts, len(body)]
    return [body[a:b] for a, b in pairwise(wbounds)], body


async def test_split_markers_are_counted_once_each(make_relay):
    n = 17
    pieces, body = split_marker_stream(n)
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )

    async def script(upstream, index, reader, writer):
        await upstream.read_request(reader)
        writer.write(head)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.002)  # separate reads at the relay, most of the time

    upstream = await Scripted(script).start()
    try:
        app = await make_relay(url=upstream.url)
        resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(n))
        assert resp.status == 200 and resp.complete
        assert resp.raw_body == body  # passed through untouched
        [row] = await settled(app, 1)
        assert (row["ok"], row["completion_tokens"], row["tokens_source"]) == (1, n, "approx")
        assert row["ttft_ms"] is not None
        snap = await snapshot(app)
        assert snap["tokens_total"] == n
        assert (await prometheus(app))[("relay_tokens_total", up())] == n
    finally:
        await upstream.stop()


async def test_flm_usage_figures_are_exposed(make_relay):
    doc = {
        "id": "x",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": 11,
            "completion_tokens": 2,
            "total_tokens": 13,
            "decoding_speed_tps": 41.5,
            "kv_token_occupancy_rate_percentage": 12.25,
        },
    }
    raw = json.dumps(doc).encode()

    async def script(upstream, index, reader, writer):
        while await upstream.read_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw)
            )

    upstream = await Scripted(script).start()
    try:
        app = await make_relay(url=upstream.url)
        resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2, stream=False))
        assert resp.body == raw
        [row] = await settled(app, 1)
        assert (row["prompt_tokens"], row["completion_tokens"], row["tokens_source"]) == (
            11,
            2,
            "exact",
        )
        snap = await snapshot(app)
        assert snap["decoding_speed_tps"] == 41.5 and snap["kv_occupancy_pct"] == 12.25
        assert snap["tokens_total"] == 2
        prom = await prometheus(app)
        assert prom[("relay_decoding_speed_tps", up())] == 41.5
        assert prom[("relay_kv_occupancy_percent", up())] == 12.25
    finally:
        await upstream.stop()


async def test_metrics_keyed_by_each_upstream(make_relay, sim):
    from relay.config import UpstreamConfig
    from relay.sim.server import Simulator

    other = Simulator()
    await other.start()
    try:
        app = await make_relay(
            upstreams=[
                UpstreamConfig(name="a", url=sim.url, models=["alpha"], parallel=2),
                UpstreamConfig(name="b", url=other.url, models=["beta"], parallel=3),
            ]
        )
        for model, n in [("alpha", 4), ("beta", 6), ("beta", 2)]:
            resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(n, model=model))
            assert resp.status == 200
        await wait_for(lambda: all(u.slots.in_flight == 0 for u in app.upstreams.values()))
        body = (await httpc.fetch(app.port, "GET", "/api/slots/metrics")).json()
        assert sorted(body) == ["a", "b"]
        assert [
            (body[k]["parallel"], body[k]["requests_total"], body[k]["tokens_total"])
            for k in ("a", "b")
        ] == [(2, 1, 4), (3, 2, 8)]
        prom = await prometheus(app)
        assert prom[("relay_tokens_total", (("upstream", "a"),))] == 4 == sim.tokens_sent_total
        assert prom[("relay_tokens_total", (("upstream", "b"),))] == 8 == other.tokens_sent_total
    finally:
        await other.stop()


# ---- per key ---------------------------------------------------------------------------
async def test_a_keys_requests_are_counted_served_and_refused_apart(make_relay, sim):
    from tests.support.keys import bearer, key

    app = await make_relay(keys=[key(requests_per_day=2)])
    for _ in range(3):
        await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3, stream=False), headers=bearer())
    bad = await httpc.fetch(
        app.port,
        "POST",
        CHAT,
        b"{not json",
        headers={**bearer(), "Content-Type": "application/json"},
    )
    assert bad.status == 400
    await wait_for(lambda: len(rows(app)) == 4)
    got = rows(app)
    assert sorted(r["status"] for r in got) == [200, 200, 400, 429]
    served = sum(r["upstream_served"] is not None for r in got)
    prom = await prometheus(app)
    key_requests = {
        labels: v for (name, labels), v in prom.items() if name == "relay_key_requests_total"
    }
    # The served ones are what the key's budget counts; their sum is every keyed request.
    assert key_requests == {
        (("key", "alpha"), ("outcome", "served")): served,
        (("key", "alpha"), ("outcome", "refused")): len(got) - served,
    }
    assert app.budgets.usage("alpha", time.time())["daily"]["requests"] == served == 2
    # Tokens come from the served ones only.
    assert prom[("relay_key_tokens_total", (("key", "alpha"), ("kind", "completion")))] == sum(
        r["completion_tokens"] or 0 for r in got
    )

"""OpenTelemetry over real sockets: a relay with `[otel]` in front of the simulator, an OTLP/HTTP
receiver on 127.0.0.1 decoding what it gets with the official protobuf messages.

After streamed, non-streamed, stalled, fallen-back, client-gone and refused requests: exactly
one span per row, named and attributed from the row, parented on the client's `traceparent`;
the upstream got a `traceparent` of the same trace naming that span; the gen_ai metric points'
counts and sums are the rows'."""

from __future__ import annotations

import asyncio
import math

from relay.config import UpstreamConfig as Up
from tests.support import httpc
from tests.support.helpers import closed_port, rows, wait_for
from tests.support.otlp_receiver import attrs, flushed

CHAT = "/v1/chat/completions"
SPAN_KIND_SERVER = 2
STATUS_ERROR = 2


def traceparent(n: int) -> tuple[str, str, str]:
    tid, sid = f"{n:032x}".replace("0", "a", 4), f"{n:016x}".replace("0", "b", 2)
    return f"00-{tid}-{sid}-01", tid, sid


def header_of(sim_req, name: bytes) -> str | None:
    for k, v in sim_req.headers:
        if k.lower() == name:
            return v.decode()
    return None


def by_request_id(spans) -> dict:
    out: dict = {}
    for s in spans:
        rid = attrs(s.attributes)["relay.request_id"]
        assert rid not in out, f"two spans for request {rid}"
        out[rid] = s
    return out


async def test_one_span_per_request_parented_and_metric_points_equal_the_rows(
    otel_relay, receiver, sim
):
    dead = f"http://127.0.0.1:{closed_port()}"
    app = await otel_relay(
        receiver,
        [
            Up(name="llm", url=sim.url, parallel=64, models=["tiny"]),
            Up(name="dead", url=dead, models=["other"], fallback=["llm"]),
        ],
        stream_idle_timeout_s=0.2,
        stream_total_timeout_s=0,
    )
    cases = {}  # request id -> (client traceparent ids, what the upstream got)

    async def call(rid: str, n: int, body: dict) -> httpc.Response:
        tp, tid, sid = traceparent(n)
        headers = {"X-Request-Id": rid, "traceparent": tp, "tracestate": f"vendor=v{n}"}
        before = len(sim.requests)
        resp = await httpc.fetch(app.port, "POST", CHAT, body, headers)
        cases[rid] = (tid, sid, f"vendor=v{n}", sim.requests[before:])
        return resp

    resp = await call("streamed", 1, httpc.chat(5))
    assert resp.status == 200 and resp.complete
    resp = await call("plain", 2, httpc.chat(4, stream=False))
    assert resp.status == 200
    resp = await call("stalled", 3, httpc.chat(30, stall_after=2))
    assert b"relay-stall-guard" in resp.body
    resp = await call("fellback", 4, httpc.chat(3, model="other"))
    assert resp.status == 200 and resp.complete
    resp = await call("nomodel", 5, httpc.chat(3, model="nope"))
    assert resp.status == 404
    # the client goes away mid-stream
    tp, tid, sid = traceparent(6)
    before = len(sim.requests)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(
        httpc.build_request(
            "POST",
            CHAT,
            httpc.chat(200, interval_ms=5),
            {"X-Request-Id": "gone", "traceparent": tp, "tracestate": "vendor=v6"},
        )
    )
    await reader.readuntil(b'"content":" a"')
    writer.transport.abort()
    await wait_for(lambda: len(app.log.of("access")) == 6)
    cases["gone"] = (tid, sid, "vendor=v6", sim.requests[before:])

    await flushed(app)
    got = rows(app)
    assert len(got) == 6
    spans = by_request_id(receiver.spans())
    assert set(spans) == {r["request_id"] for r in got}  # exactly one span per row
    assert {"service.name": "relay"}.items() <= receiver.resources()[0].items()
    row_of = {r["request_id"]: r for r in got}
    for rid, (tid, sid, state, upstream_reqs) in cases.items():
        span, row = spans[rid], row_of[rid]
        a = attrs(span.attributes)
        assert span.trace_id.hex() == tid and span.parent_span_id.hex() == sid, rid
        assert span.trace_state == state and span.kind == SPAN_KIND_SERVER
        assert span.name == f"chat {row['model']}"
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "openai"
        assert a["gen_ai.request.model"] == row["model"]
        assert a["gen_ai.request.stream"] == bool(row["stream"])
        assert a["http.response.status_code"] == row["status"]
        assert a["relay.fallback.attempts"] == row["fallback_attempts"]
        assert a.get("relay.upstream.served") == row["upstream_served"]
        assert a.get("gen_ai.usage.input_tokens") == row["prompt_tokens"]
        assert a.get("gen_ai.usage.output_tokens") == row["completion_tokens"]
        assert a.get("error.type") == (None if row["ok"] else row["error_code"])
        assert (span.status.code == STATUS_ERROR) == (not row["ok"])
        duration_ms = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
        assert abs(duration_ms - row["total_ms"]) < 5, rid
        # every upstream request of it carried a traceparent of this trace, naming this span
        for req in upstream_reqs:
            assert header_of(req, b"traceparent") == f"00-{tid}-{span.span_id.hex()}-01"
            assert header_of(req, b"tracestate") == state
    s = attrs(spans["streamed"].attributes)
    # (the simulator stops at max_tokens: "length", as llama-server says)
    assert s["gen_ai.request.max_tokens"] == 5
    assert s["gen_ai.response.finish_reasons"] == ("length",)
    assert math.isclose(
        s["gen_ai.response.time_to_first_chunk"], row_of["streamed"]["ttft_ms"] / 1000
    )
    assert (s["server.address"], s["server.port"]) == ("127.0.0.1", sim.port)
    assert "gen_ai.response.time_to_first_chunk" not in attrs(spans["plain"].attributes)
    assert attrs(spans["plain"].attributes)["gen_ai.response.finish_reasons"] == ("length",)
    stalled = spans["stalled"]
    assert [e.name for e in stalled.events] == ["relay.stall"]
    assert attrs(stalled.events[0].attributes)["relay.stall.reason"] == "idle"
    assert attrs(stalled.attributes)["error.type"] == "stream_stall_idle"
    fell = spans["fellback"]
    assert [e.name for e in fell.events] == ["relay.fallback"]
    assert attrs(fell.events[0].attributes) == {
        "relay.upstream": "dead",
        "relay.fallback.next": "llm",
        "error.type": "upstream_unavailable",
    }
    assert len(cases["fellback"][3]) == 1  # (the dead one got nothing)
    assert attrs(spans["gone"].attributes)["error.type"] == "client_closed"
    assert "server.address" not in attrs(spans["nomodel"].attributes)

    # ---- metric points: counts and sums are the rows' -------------------------------------
    def points(name):
        return receiver.points(name)

    durations = points("gen_ai.server.request.duration")
    assert sum(p.count for _a, p in durations) == len(got)
    assert math.isclose(
        sum(p.sum for _a, p in durations), sum(r["total_ms"] for r in got) / 1000, rel_tol=1e-9
    )
    errors = {a.get("error.type"): p.count for a, p in durations if "error.type" in a}
    assert errors == {
        r["error_code"]: 1 for r in got if not r["ok"]
    }  # (one each: stall, 404, gone)
    m0 = receiver.metrics()["gen_ai.server.request.duration"][0][0]
    assert m0.unit == "s"
    assert list(durations[0][1].explicit_bounds) == [
        0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
    ]  # fmt: skip
    ok_ttft = [r["ttft_ms"] for r in got if r["ok"] and r["ttft_ms"] is not None]
    ttft = points("gen_ai.server.time_to_first_token")
    assert sum(p.count for _a, p in ttft) == len(ok_ttft) == 2
    assert math.isclose(sum(p.sum for _a, p in ttft), sum(ok_ttft) / 1000, rel_tol=1e-9)
    assert list(ttft[0][1].explicit_bounds)[:3] == [0.001, 0.005, 0.01]
    ok_tpot = [r["tpot_ms"] for r in got if r["ok"] and r["tpot_ms"] is not None]
    tpot = points("gen_ai.server.time_per_output_token")
    assert sum(p.count for _a, p in tpot) == len(ok_tpot)
    assert math.isclose(sum(p.sum for _a, p in tpot), sum(ok_tpot) / 1000, rel_tol=1e-9)
    tokens = points("gen_ai.client.token.usage")
    for kind, col in (("input", "prompt_tokens"), ("output", "completion_tokens")):
        mine = [p for a, p in tokens if a["gen_ai.token.type"] == kind]
        figures = [r[col] for r in got if r[col] is not None]
        assert sum(p.count for p in mine) == len(figures)
        assert sum(p.sum for p in mine) == sum(figures)
    served = [a for a, _p in durations if a.get("server.address") is not None]
    assert {(a["server.address"], a["server.port"]) for a in served} == {("127.0.0.1", sim.port)}
    assert {a.get("gen_ai.response.model") for a, _p in durations} >= {None}
    stalls = points("relay.stall.trips")
    assert [(a, p.as_int) for a, p in stalls] == [
        ({"relay.upstream.name": "llm", "relay.stall.reason": "idle"}, 1)
    ]
    slots = {a["relay.upstream.name"]: p.as_int for a, p in points("relay.slots.parallel")}
    assert slots == {"llm": 64, "dead": 1}
    assert [p.as_int for _a, p in points("relay.otel.spans_dropped")] == [0]
    queue = points("relay.queue.duration")
    assert sum(p.count for _a, p in queue) == len([r for r in got if r["queue_ms"] is not None])


async def test_off_the_client_trace_context_passes_unchanged(make_relay, sim):
    app = await make_relay()
    assert app.otel is None
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    resp = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(2), {"traceparent": tp, "tracestate": "a=1"}
    )
    assert resp.status == 200
    assert header_of(sim.requests[-1], b"traceparent") == tp
    assert header_of(sim.requests[-1], b"tracestate") == "a=1"


async def test_no_client_trace_context_starts_a_sampled_trace(otel_relay, receiver, sim):
    app = await otel_relay(receiver)
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), {"X-Request-Id": "root"})
    assert resp.status == 200
    upstream_tp = header_of(sim.requests[-1], b"traceparent")
    assert header_of(sim.requests[-1], b"tracestate") is None
    await wait_for(lambda: len(app.log.of("access")) == 1)
    await flushed(app)
    [span] = receiver.spans()
    assert span.parent_span_id == b""
    version, trace_id, parent, flags = upstream_tp.split("-")
    assert (version, trace_id, parent) == ("00", span.trace_id.hex(), span.span_id.hex())
    assert int(flags, 16) & 1  # sampled (the SDK also sets level 2's "random" bit: 03)


async def test_an_invalid_traceparent_starts_a_new_trace(otel_relay, receiver, sim):
    app = await otel_relay(receiver)
    bad = "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01"  # (upper case: invalid)
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), {"traceparent": bad})
    assert resp.status == 200
    await wait_for(lambda: len(app.log.of("access")) == 1)
    await flushed(app)
    [span] = receiver.spans()
    assert span.parent_span_id == b"" and span.trace_id.hex() != bad[3:35].lower()
    assert header_of(sim.requests[-1], b"traceparent").split("-")[1] == span.trace_id.hex()


async def test_a_request_refused_before_it_was_read_has_its_span(otel_relay, receiver, sim):
    app = await otel_relay(receiver)
    tp, tid, sid = traceparent(9)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\ntraceparent: {tp}\r\n"
        "Content-Length: 999999999999\r\n\r\n".encode()
    )
    resp = await httpc.read_head(reader)
    writer.close()
    assert resp.status == 413
    await wait_for(lambda: len(app.log.of("access")) == 1)
    await flushed(app)
    [span] = receiver.spans()
    assert (span.trace_id.hex(), span.parent_span_id.hex()) == (tid, sid)
    assert attrs(span.attributes)["error.type"] == "request_too_large"
    [(_a, p)] = receiver.points("gen_ai.server.request.duration")
    assert p.count == 1

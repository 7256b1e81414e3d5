"""Rules of the relay's OpenTelemetry, each pinned directly: a request with more than one
`traceparent` has no valid parent (W3C Trace Context: a new trace starts, its `tracestate` is
not kept), and `OTEL_TRACES_EXPORTER=none` / `OTEL_METRICS_EXPORTER=none` turn their signal
off, in the settings and in what reaches a collector."""

from __future__ import annotations

import pytest

from relay.config import OtelConfig
from relay.observe.log import quiet
from relay.observe.otel_env import settings
from relay.observe.otel_start import start
from relay.observe.record import Record
from tests.support import httpc
from tests.support.helpers import CHAT, closed_port

TID_A, SID_A = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TID_B, SID_B = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TP_A = f"00-{TID_A}-{SID_A}-01".encode()
TP_B = f"00-{TID_B}-{SID_B}-01".encode()
ON = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}


def record() -> Record:
    return Record(ts=1.0, request_id="r", path=CHAT, method="POST")


@pytest.fixture
def telemetry():
    """Traces only, exporting to a closed port; nothing here ends a span, so nothing is sent."""
    t = start(
        OtelConfig(endpoint=f"http://127.0.0.1:{closed_port()}", metrics=False), quiet(), list, {}
    )
    yield t
    t.shutdown(1.0)


def upstream_traceparent(trace) -> tuple[str, str, str, str]:
    [(name, value)] = trace.headers  # one traceparent, and no tracestate
    assert name == b"traceparent"
    version, tid, sid, flags = value.decode().split("-")
    return version, tid, sid, flags


def test_one_traceparent_is_the_parent_and_its_tracestate_kept(telemetry):
    headers = [(b"Traceparent", TP_A), (b"tracestate", b"vendor=a")]
    trace = telemetry.begin(headers, record())
    parent = trace.span.parent
    assert (f"{parent.trace_id:032x}", f"{parent.span_id:016x}") == (TID_A, SID_A)
    assert dict(trace.headers)[b"tracestate"] == b"vendor=a"


@pytest.mark.parametrize("second", [TP_B, TP_A], ids=["different", "the same twice"])
def test_two_traceparent_headers_have_no_valid_parent_a_new_trace_starts(telemetry, second):
    headers = [(b"traceparent", TP_A), (b"TraceParent", second), (b"tracestate", b"vendor=a")]
    trace = telemetry.begin(headers, record())
    assert trace.span.parent is None  # a root span
    ctx = trace.span.get_span_context()
    assert f"{ctx.trace_id:032x}" not in (TID_A, TID_B)
    # the upstream gets this span as its parent, in the new trace, sampled (the SDK may set
    # Level 2's random bit too); the tracestate of a parent not taken is not passed on
    version, tid, sid, flags = upstream_traceparent(trace)
    assert (version, tid, sid) == ("00", f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert int(flags, 16) & 0x01


async def test_two_traceparent_headers_the_upstream_gets_the_new_trace_only(
    otel_relay, receiver, sim
):
    app = await otel_relay(receiver)
    head = [("traceparent", TP_A.decode()), ("traceparent", TP_B.decode()), ("tracestate", "v=a")]
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), head)
    assert resp.status == 200
    up = [(k.lower(), v.decode()) for k, v in sim.requests[-1].headers]
    [tp] = [v for k, v in up if k == b"traceparent"]
    assert tp.split("-")[1] not in (TID_A, TID_B)
    assert [v for k, v in up if k == b"tracestate"] == []
    await app.stop(drain_timeout_s=0.5)
    [span] = receiver.spans()
    assert span.parent_span_id == b"" and span.trace_id.hex() == tp.split("-")[1]


# ---- OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER ---------------------------------------------
@pytest.mark.parametrize("value", ["none", "NONE", " none "])
def test_an_exporter_variable_none_turns_its_signal_off(value):
    s = settings(None, {**ON, "OTEL_METRICS_EXPORTER": value})
    assert s is not None and (s.traces, s.metrics) == (True, False)
    s = settings(None, {**ON, "OTEL_TRACES_EXPORTER": value})
    assert s is not None and (s.traces, s.metrics) == (False, True)
    # with [otel] in the file too (its traces/metrics left at their default)
    s = settings(OtelConfig(), {"OTEL_METRICS_EXPORTER": value})
    assert s is not None and (s.traces, s.metrics) == (True, False)
    both = {"OTEL_TRACES_EXPORTER": value, "OTEL_METRICS_EXPORTER": value}
    assert settings(None, {**ON, **both}) is None  # nothing left: off
    assert start(OtelConfig(), quiet(), list, both) is None
    s = settings(None, {**ON, "OTEL_METRICS_EXPORTER": "otlp", "OTEL_TRACES_EXPORTER": "otlp"})
    assert s is not None and (s.traces, s.metrics) == (True, True)


async def test_metrics_exporter_none_no_metric_reaches_the_collector(
    otel_relay, receiver, monkeypatch
):
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    app = await otel_relay(receiver)
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2))
    assert resp.status == 200
    await app.stop(drain_timeout_s=0.5)  # (every last export done)
    assert len(receiver.spans()) == 1
    assert receiver.metric_exports == []


async def test_traces_exporter_none_no_span_and_the_client_trace_passes_unchanged(
    otel_relay, receiver, sim, monkeypatch
):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    app = await otel_relay(receiver)
    head = {"traceparent": TP_A.decode(), "tracestate": "v=a"}
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), head)
    assert resp.status == 200
    up = [(k.lower(), v.decode()) for k, v in sim.requests[-1].headers]
    assert [v for k, v in up if k in (b"traceparent", b"tracestate")] == [TP_A.decode(), "v=a"]
    await app.stop(drain_timeout_s=0.5)
    assert receiver.traces == []
    [(_a, point)] = receiver.points("gen_ai.server.request.duration")
    assert point.count == 1

"""relay.observe.metrics: sliding windows driven by explicit `now`, counters, JSON and
Prometheus text."""

from __future__ import annotations

import math
import re

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relay.observe.metrics import KeyOutcome, Registry, UpstreamMetrics


def tokens_0_to_9(m: UpstreamMetrics) -> None:
    for t in range(10):
        m.add_tokens(10, float(t))


# -- tokens_per_sec -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("now", "expected"),
    [
        (10.0, 10.0),  # buckets 0..9 all completed and in the window
        (10.999, 10.0),  # still second 10: same window
        (15.0, 5.0),  # buckets 5..14: tokens from t=5..9
        (19.5, 1.0),  # buckets 9..18: only t=9
        (20.0, 0.0),  # buckets 10..19: nothing
        (25.0, 0.0),
    ],
)
def test_tokens_per_sec_window(now, expected):
    m = UpstreamMetrics("u", 1)
    tokens_0_to_9(m)
    assert m.snapshot(now)["tokens_per_sec"] == expected
    assert m.tokens_total == 100


def test_current_second_counts_only_once_completed():
    m = UpstreamMetrics("u", 1)
    m.add_tokens(30, 5.2)
    m.add_tokens(20, 5.9)  # same bucket 5
    assert m.tokens_per_sec(5.95) == 0.0  # bucket 5 still open
    assert m.tokens_per_sec(6.0) == 5.0  # 50 / 10
    assert m.tokens_per_sec(15.999) == 5.0  # window 5..14: bucket 5 is the oldest in it
    assert m.tokens_per_sec(16.0) == 0.0  # window 6..15


def test_tokens_per_sec_window_size_and_reads_do_not_lose_tokens():
    m = UpstreamMetrics("u", 1, tps_window_s=2.0)
    m.add_tokens(4, 0.5)
    assert m.tokens_per_sec(0.7) == 0.0
    m.add_tokens(6, 1.0)
    assert m.tokens_per_sec(2.0) == 5.0  # (4 + 6) / 2
    assert m.tokens_per_sec(3.0) == 3.0  # bucket 1 only
    assert m.tokens_per_sec(4.0) == 0.0


def test_negative_and_zero_tokens():
    m = UpstreamMetrics("u", 1)
    tokens_0_to_9(m)
    m.add_tokens(0, 9.5)
    m.add_tokens(-15, 9.6)  # exact count lower than the estimate
    assert m.tokens_total == 85
    assert m.snapshot(10.0)["tokens_per_sec"] == 10.0  # rate window untouched
    assert m.snapshot(10.0)["tokens_total"] == 85


def test_out_of_order_add_lands_in_its_bucket():
    m = UpstreamMetrics("u", 1, tps_window_s=3)
    m.add_tokens(3, 2.0)
    m.add_tokens(6, 1.0)  # clock misuse: earlier second inserted before bucket 2
    m.add_tokens(9, 2.5)
    assert m.tokens_per_sec(3.0) == 6.0  # (3 + 6 + 9) / 3
    assert m.tokens_per_sec(5.0) == 4.0  # buckets 2..4: 12 / 3


# -- TTFT -----------------------------------------------------------------------------------------
def test_ttft_last_and_average():
    m = UpstreamMetrics("u", 1)
    snap = m.snapshot(0.0)
    assert snap["ttft_seconds"] is None and snap["ttft_avg_seconds"] is None
    m.observe_ttft(0.5, 1.0)
    m.observe_ttft(0.25, 2.0)
    m.observe_ttft(1.5, 3.0)
    snap = m.snapshot(3.0)
    assert snap["ttft_seconds"] == 1.5
    assert snap["ttft_avg_seconds"] == 0.75


def test_ttft_keeps_last_128():
    m = UpstreamMetrics("u", 1)
    for i in range(200):
        m.observe_ttft(float(i), 10.0)
    snap = m.snapshot(10.0)
    assert snap["ttft_seconds"] == 199.0
    assert snap["ttft_avg_seconds"] == sum(range(72, 200)) / 128  # 135.5


def test_ttft_drops_samples_older_than_60s():
    m = UpstreamMetrics("u", 1)
    m.observe_ttft(4.0, 0.0)
    m.observe_ttft(2.0, 30.0)
    assert m.snapshot(60.0)["ttft_avg_seconds"] == 3.0  # age exactly 60 s is kept
    assert m.snapshot(60.5)["ttft_avg_seconds"] == 2.0  # 60.5 s old: dropped
    assert m.snapshot(60.5)["ttft_seconds"] == 2.0
    snap = m.snapshot(90.5)
    assert snap["ttft_seconds"] is None and snap["ttft_avg_seconds"] is None


def test_ttft_custom_window():
    m = UpstreamMetrics("u", 1, ttft_window=2, ttft_max_age_s=5.0)
    for i, s in enumerate((1.0, 2.0, 4.0)):
        m.observe_ttft(s, float(i))
    assert m.snapshot(2.0)["ttft_avg_seconds"] == 3.0
    m.observe_ttft(8.0, 7.5)  # the sample at t=2 is 5.5 s old by now
    assert m.snapshot(7.5)["ttft_avg_seconds"] == 8.0


# -- counters -------------------------------------------------------------------------------------
def test_requests_and_failures_by_code():
    m = UpstreamMetrics("u", 1)
    m.request_done(True, None)
    m.request_done(False, "upstream_timeout")
    m.request_done(False, "upstream_timeout")
    m.request_done(False, "bad_gateway")
    m.request_done(False, None)
    m.request_done(True, "ignored_when_ok")
    snap = m.snapshot(0.0)
    assert snap["requests_total"] == 6
    assert snap["requests_failed"] == 4
    assert snap["failures_by_code"] == {"upstream_timeout": 2, "bad_gateway": 1, "unknown": 1}
    assert snap["other_requests_total"] == 0
    m.other_request_done()  # one that generates nothing: counted apart, never failed
    snap = m.snapshot(0.0)
    assert (snap["requests_total"], snap["requests_failed"], snap["other_requests_total"]) == (
        6,
        4,
        1,
    )


def test_stall_reasons_and_queue_wait():
    m = UpstreamMetrics("u", 1)
    assert m.snapshot(0.0)["stall_trips"] == {"total": 0, "idle": 0, "read": 0}
    m.stall("idle")
    m.stall("idle")
    m.stall("read")
    assert m.snapshot(0.0)["stall_trips"] == {"total": 0, "idle": 2, "read": 1}
    m.observe_queue_wait(0.5)
    m.observe_queue_wait(0.25)
    snap = m.snapshot(0.0)
    assert snap["queue_wait_seconds_total"] == 0.75
    assert snap["queue_wait_count"] == 2


def test_flm_values_only_when_seen():
    m = UpstreamMetrics("u", 1)
    assert "decoding_speed_tps" not in m.snapshot(0.0)
    assert "kv_occupancy_pct" not in m.snapshot(0.0)
    m.set_flm(42.5, None)
    assert m.snapshot(0.0)["decoding_speed_tps"] == 42.5
    assert "kv_occupancy_pct" not in m.snapshot(0.0)
    m.set_flm(None, 12.0)
    m.set_flm(math.nan, None)
    snap = m.snapshot(0.0)
    assert snap["decoding_speed_tps"] == 42.5 and snap["kv_occupancy_pct"] == 12.0


# -- Registry: JSON and Prometheus ------------------------------------------------------------------
QUOTED = 'a"b\\c\nd'


def two_upstreams() -> Registry:
    reg = Registry()
    a = UpstreamMetrics("gpu0", 4)
    b = UpstreamMetrics(QUOTED, 1)
    reg.add(a)
    reg.add(b)
    a.state, a.in_flight, a.queued = "serving", 3, 2
    tokens_0_to_9(a)
    a.add_tokens(-5, 9.9)
    a.observe_ttft(0.5, 5.0)
    a.observe_ttft(0.25, 6.0)
    a.request_done(True, None)
    a.request_done(False, "upstream_timeout")
    a.other_request_done()  # a GET /health, say: apart
    a.other_request_done()
    a.stall("total")
    a.observe_queue_wait(1.5)
    a.set_flm(33.25, 40.0)
    b.state = "down"
    b.request_done(False, "connect_failed")
    reg.rows_dropped = 7
    reg.rejected(429)
    reg.rejected(429)
    reg.rejected("401")
    return reg


def test_registry_get_and_duplicates():
    reg = two_upstreams()
    assert reg.get("gpu0").parallel == 4
    with pytest.raises(ValueError):
        reg.add(UpstreamMetrics("gpu0", 1))
    with pytest.raises(KeyError):
        reg.get("nope")
    assert reg.requests_rejected == {"429": 2, "401": 1}


def test_json_shape():
    doc = msgspec.json.decode(two_upstreams().json(15.0))
    assert list(doc) == ["gpu0", QUOTED]
    assert doc["gpu0"] == {
        "name": "gpu0",
        "state": "serving",
        "parallel": 4,
        "in_flight": 3,
        "queued": 2,
        "tokens_per_sec": 5.0,
        "ttft_seconds": 0.25,
        "ttft_avg_seconds": 0.375,
        "requests_total": 2,
        "requests_failed": 1,
        "other_requests_total": 2,
        "tokens_total": 95,
        "stall_trips": {"total": 1, "idle": 0, "read": 0},
        "queue_wait_seconds_total": 1.5,
        "queue_wait_count": 1,
        "failures_by_code": {"upstream_timeout": 1},
        "decoding_speed_tps": 33.25,
        "kv_occupancy_pct": 40.0,
    }
    b = doc[QUOTED]
    assert b["name"] == QUOTED and b["state"] == "down"
    assert b["ttft_seconds"] is None and b["ttft_avg_seconds"] is None
    assert "decoding_speed_tps" not in b and "kv_occupancy_pct" not in b


def parse(reg: Registry, now: float) -> dict[str, tuple[str, dict]]:
    text = reg.prometheus(now).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in out
        out[fam.name] = (
            fam.type,
            {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples},
        )
    return out


def lab(**kw: str) -> tuple:
    return tuple(sorted(kw.items()))


def test_prometheus_families_and_values():
    fams = parse(two_upstreams(), 15.0)
    A, B = "gpu0", QUOTED

    def gauge(name, a, b=None):
        want = {(name, lab(upstream=A)): a}
        if b is not None:
            want[(name, lab(upstream=B))] = b
        assert fams[name] == ("gauge", want), name

    gauge("relay_upstream_up", 1, 0)
    gauge("relay_slots_parallel", 4, 1)
    gauge("relay_slots_in_flight", 3, 0)
    gauge("relay_queue_waiting", 2, 0)
    gauge("relay_tokens_per_second", 5.0, 0.0)
    gauge("relay_ttft_seconds", 0.25)  # b has no sample: omitted, not NaN
    gauge("relay_ttft_avg_seconds", 0.375)
    gauge("relay_decoding_speed_tps", 33.25)
    gauge("relay_kv_occupancy_percent", 40.0)

    states = fams["relay_upstream_state"]
    assert states[0] == "gauge"
    assert states[1] == {
        ("relay_upstream_state", lab(upstream=u, state=s)): int(s == cur)
        for u, cur in ((A, "serving"), (B, "down"))
        for s in ("ready", "serving", "loading", "down", "unknown")
    }
    for u in (A, B):
        ones = [v for (_, labels), v in states[1].items() if dict(labels)["upstream"] == u]
        assert sorted(ones) == [0, 0, 0, 0, 1]

    # counters: the parser names the family without `_total`, samples keep it
    assert fams["relay_requests"] == (
        "counter",
        {
            ("relay_requests_total", lab(upstream=A)): 2,
            ("relay_requests_total", lab(upstream=B)): 1,
        },
    )
    assert fams["relay_other_requests"] == (
        "counter",
        {
            ("relay_other_requests_total", lab(upstream=A)): 2,
            ("relay_other_requests_total", lab(upstream=B)): 0,
        },
    )
    assert fams["relay_requests_failed"] == (
        "counter",
        {
            ("relay_requests_failed_total", lab(upstream=A, code="upstream_timeout")): 1,
            ("relay_requests_failed_total", lab(upstream=B, code="connect_failed")): 1,
        },
    )
    assert fams["relay_tokens"] == (
        "counter",
        {
            ("relay_tokens_total", lab(upstream=A)): 95,
            ("relay_tokens_total", lab(upstream=B)): 0,
        },
    )
    assert fams["relay_stall_trips"] == (
        "counter",
        {
            ("relay_stall_trips_total", lab(upstream=u, reason=r)): int(u == A and r == "total")
            for u in (A, B)
            for r in ("total", "idle", "read")
        },
    )
    kind, qwait = fams["relay_queue_wait_seconds"]
    assert kind == "histogram"  # (a summary before issue 13: _sum and _count kept)
    assert {k: v for k, v in qwait.items() if not k[0].endswith("_bucket")} == {
        ("relay_queue_wait_seconds_sum", lab(upstream=A)): 1.5,
        ("relay_queue_wait_seconds_count", lab(upstream=A)): 1,
        ("relay_queue_wait_seconds_sum", lab(upstream=B)): 0.0,
        ("relay_queue_wait_seconds_count", lab(upstream=B)): 0,
    }
    a_buckets = {
        dict(k[1])["le"]: v
        for k, v in qwait.items()
        if k[0].endswith("_bucket") and dict(k[1])["upstream"] == A
    }
    assert a_buckets["1.0"] == 0 and a_buckets["2.5"] == 1 and a_buckets["+Inf"] == 1
    assert fams["relay_key_requests"] == ("counter", {})
    for name in (
        "relay_time_to_first_token_seconds",
        "relay_time_per_output_token_seconds",
        "relay_e2e_request_latency_seconds",
    ):
        kind, samples = fams[name]
        assert kind == "histogram" and samples[(name + "_count", lab(upstream=A))] == 0
    assert fams["relay_rows_dropped"] == ("counter", {("relay_rows_dropped_total", ()): 7})
    assert fams["relay_requests_rejected"] == (
        "counter",
        {
            ("relay_requests_rejected_total", lab(code="429")): 2,
            ("relay_requests_rejected_total", lab(code="401")): 1,
        },
    )
    assert len(fams) == 23


def test_prometheus_text_layout():
    text = two_upstreams().prometheus(15.0).decode()
    assert text.endswith("\n")
    assert "NaN" not in text and "None" not in text
    assert 'upstream="a\\"b\\\\c\\nd"' in text  # escaped: backslash, quote, newline
    helps, types, current = [], [], None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helps.append(line.split()[2])
        elif line.startswith("# TYPE "):
            current = line.split()[2]
            types.append(current)
            assert current == helps[-1]  # HELP directly before its TYPE
        else:  # every sample sits under its own family's TYPE line
            name = line.split("{")[0].split(" ")[0]
            assert name in (current, current + "_sum", current + "_count", current + "_bucket"), (
                line
            )
    assert len(helps) == len(set(helps)) == len(types) == len(set(types)) == 23
    assert 'relay_tokens_total{upstream="gpu0"} 95\n' in text  # ints as ints
    assert 'relay_tokens_per_second{upstream="gpu0"} 5.0\n' in text  # floats via repr
    for name in types:
        if name.endswith("_total"):
            assert f"# TYPE {name} counter" in text


def test_prometheus_unknown_state_and_nan_gauge():
    reg = Registry()
    m = UpstreamMetrics("x", 1)
    reg.add(m)
    m.state = "weird"
    m.decoding_speed_tps = math.nan  # set directly, bypassing set_flm's guard
    fams = parse(reg, 0.0)
    assert sum(fams["relay_upstream_state"][1].values()) == 1
    assert (
        fams["relay_upstream_state"][1][("relay_upstream_state", lab(upstream="x", state="weird"))]
        == 1
    )
    assert fams["relay_decoding_speed_tps"] == ("gauge", {})
    assert b"NaN" not in reg.prometheus(0.0)


# -- HELP texts -----------------------------------------------------------------------------------
# Words each family's HELP must hold: what its labels split by, where its figure comes from.
HELP_SAYS = {
    "relay_requests_failed": ("by error code",),
    "relay_requests_rejected": ("by error code",),
    "relay_key_requests": ("by outcome", "served", "refused"),
    "relay_key_tokens": ("by kind",),
    "relay_stall_trips": ("by reason",),
    "relay_tokens": ("Output tokens", "streamed or not"),
    "relay_tokens_per_second": ("Output tokens", "10"),
    "relay_ttft_avg_seconds": ("128", "60 s"),
    "relay_decoding_speed_tps": ("tokens/s", "decoding_speed_tps", "FastFlowLM"),
    "relay_kv_occupancy_percent": (
        "KV cache",
        "percent",
        "kv_token_occupancy_rate_percentage",
        "FastFlowLM",
    ),
}


def test_every_help_line_parses_and_names_what_it_splits_by():
    reg = two_upstreams()
    reg.rejected("budget_exceeded")
    reg.key_used("alpha", KeyOutcome.SERVED, 5, 7)
    reg.key_used("alpha", KeyOutcome.REFUSED, None, None)
    reg.rows_spilled = 0  # a shared store: its two gauges too
    text = reg.prometheus(15.0).decode()
    docs = {fam.name: fam.documentation for fam in text_string_to_metric_families(text)}
    assert len(docs) == 25 and all(docs.values())
    for name, words in HELP_SAYS.items():
        for word in words:
            assert word in docs[name], (name, word)
    for name, doc in docs.items():
        # A `code` label holds error codes, never HTTP statuses; "FLM" alone says nothing.
        assert "status" not in doc, name
        assert not re.search(r"\bFLM\b", doc), name

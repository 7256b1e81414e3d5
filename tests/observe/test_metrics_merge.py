"""The whole relay's figures added up from its workers' (observe.metrics_merge): every kind of
figure by its own rule, written out by hand."""

from __future__ import annotations

import pytest

from relay.observe.metrics import KeyOutcome, Registry, UpstreamMetrics
from relay.observe.metrics_merge import absorb, merged


def _worker(requests: int, failed: dict[str, int], tokens: list[tuple[float, int]]) -> Registry:
    reg = Registry()
    m = UpstreamMetrics("llm", 4)
    for _ in range(requests):
        m.request_done(True, None)
    for code, n in failed.items():
        for _ in range(n):
            m.request_done(False, code)
    for at, n in tokens:
        m.add_tokens(n, at)
    reg.add(m)
    return reg


def test_counters_codes_histograms_and_token_windows_add_up():
    a = _worker(3, {"upstream_502": 1}, [(100.2, 5), (101.5, 7)])
    b = _worker(2, {"upstream_502": 2, "stream_stall_idle": 1}, [(101.1, 3), (102.0, 1)])
    a.get("llm").observe_timings(0.05, 0.01, 1.0)
    b.get("llm").observe_timings(0.3, None, 2.0)
    b.get("llm").stall("idle")
    a.rejected("budget_exceeded")
    b.rejected("budget_exceeded")
    b.rejected("invalid_api_key")
    a.key_used("alpha", KeyOutcome.SERVED, 10, 20)
    b.key_used("alpha", KeyOutcome.SERVED, 1, 2)
    b.key_used("alpha", KeyOutcome.REFUSED, None, None)
    b.key_used("beta", KeyOutcome.SERVED, 5, 0)
    out = merged([a, b], {"llm": 8})
    m = out.get("llm")
    assert (m.requests_total, m.requests_failed) == (9, 4)
    assert m.failures_by_code == {"upstream_502": 3, "stream_stall_idle": 1}
    assert m.stall_trips == {"total": 0, "idle": 1, "read": 0}
    assert m.tokens_total == 16
    assert [list(x) for x in m._buckets] == [[100, 5], [101, 10], [102, 1]]
    assert m.ttft_hist.count == 2 and m.ttft_hist.sum == pytest.approx(0.35)
    assert m.tpot_hist.count == 1 and m.e2e_hist.count == 2 and m.e2e_hist.sum == 3.0
    assert m.parallel == 8  # the parent's (the configured), not a sum
    assert out.requests_rejected == {"budget_exceeded": 2, "invalid_api_key": 1}
    # [served, refused, prompt tokens, completion tokens]
    assert out.keys == {"alpha": [2, 1, 11, 22], "beta": [1, 0, 5, 0]}
    # the parts are left as they were
    assert a.get("llm").requests_total == 4 and a.keys == {"alpha": [1, 0, 10, 20]}


def test_recent_ttft_pooled_in_time_order_and_bounded():
    a, b = UpstreamMetrics("llm", 1, ttft_window=3), UpstreamMetrics("llm", 1, ttft_window=3)
    into = UpstreamMetrics("llm", 1, ttft_window=3)
    for at, s in ((10.0, 0.1), (12.0, 0.3)):
        a.observe_ttft(s, at)
    for at, s in ((11.0, 0.2), (13.0, 0.4)):
        b.observe_ttft(s, at)
    absorb(into, a)
    absorb(into, b)
    assert list(into._ttft) == [(11.0, 0.2), (12.0, 0.3), (13.0, 0.4)]  # newest 3
    assert into.ttft(13.0) == (0.4, pytest.approx(0.3))


def test_live_gauges_are_not_added_and_last_seen_figures_kept():
    a, b = UpstreamMetrics("llm", 2), UpstreamMetrics("llm", 2)
    a.in_flight, b.in_flight, a.queued, a.state = 2, 1, 5, "down"
    a.set_flm(30.0, None)
    b.set_flm(None, 55.0)
    into = UpstreamMetrics("llm", 2)
    absorb(into, a)
    absorb(into, b)
    assert (into.in_flight, into.queued, into.state) == (0, 0, "unknown")  # its own
    assert (into.decoding_speed_tps, into.kv_occupancy_pct) == (30.0, 55.0)


def test_a_figure_without_a_rule_is_refused_not_dropped():
    part, into = UpstreamMetrics("llm", 1), UpstreamMetrics("llm", 1)
    part.new_kind_of_figure = into.new_kind_of_figure = "text"  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="new_kind_of_figure"):
        absorb(into, part)


def test_an_upstream_no_longer_configured_is_left_out():
    a = _worker(1, {}, [])
    out = merged([a], {"other": 2})
    assert [m.name for m in out] == ["other"] and out.get("other").requests_total == 0

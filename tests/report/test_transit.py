"""bench/transit.py (issue 23 item 4): the stamp parsing, nearest-rank quantiles, the added
(target − direct) figures and the tables, by hand; and one short run over sockets (upstream,
relay and client processes) in which every stamped event arrives, once, with a transit >= 0."""

from __future__ import annotations

import json
import shutil

import pytest

from bench import procs, transit

EV = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" a"}}],'
    b'"created":1,"id":"x","model":"m","object":"chat.completion.chunk","t_ns":1234567}\n\n'
)


def test_the_send_stamp_is_read_from_each_event():
    assert transit.stamp_of(EV) == 1234567
    assert transit.stamp_of(b"data: [DONE]\n\n") is None
    assert transit.stamp_of(b'data: {"t_ns":}\n\n') is None
    two = EV + EV.replace(b"1234567", b"89")
    assert transit.stamps_in(two) == [1234567, 89]
    assert transit.stamps_in(two, len(EV)) == [89]
    assert transit.stamps_in(two, 0, len(EV)) == [1234567]


def test_the_upstream_writes_llama_server_chunks_with_the_stamp_last():
    f = transit.Frames(b'"m"', 1796019884, b"chatcmpl-1")
    ev = f.content(1, 42)
    assert ev.startswith(b"data: ") and ev.endswith(b"}\n\n")
    obj = json.loads(ev[6:])
    assert obj["choices"] == [{"finish_reason": None, "index": 0, "delta": {"content": " from"}}]
    assert list(obj)[-2:] == ["object", "t_ns"] and obj["t_ns"] == 42
    assert transit._chunk(b"abc") == b"3\r\nabc\r\n"
    tail = f.final(7)
    assert tail.endswith(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
    assert b'"finish_reason":"length"' in tail and b'"completion_tokens":7' in tail
    role = json.loads(f.role[6:])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": None}


def test_nearest_rank_quantiles():
    assert transit.pct([], 50) is None
    assert transit.pct([7], 99.9) == 7
    ten = list(range(1, 11))
    assert [transit.pct(ten, p) for p in (50, 99, 99.9)] == [5, 10, 10]
    thousand = list(range(1, 1001))
    assert [transit.pct(thousand, p) for p in (50, 99, 99.9)] == [500, 990, 999]
    assert transit.quantiles([3, 1, 2]) == {"p50": 2, "p99": 3, "p99.9": 3, "n": 3}


def _row(target, rep, load=64, t=(100.0, 500.0, 900.0), f=(0.5, 2.0)):
    return {
        "target": target,
        "load": load,
        "repeat": rep,
        "transit_us": {"p50": t[0], "p99": t[1], "p99.9": t[2], "n": 10},
        "ttft_ms": {"p50": f[0], "p99": f[1], "n": 3},
        "content_events": 10,
        "requests": 3,
        "errors": 0,
        "mismatch": 0,
        "cpu_pct": {"upstream": 10.0, "proxy": 20.0, "clients": 30.0, "other": 1.0},
        "lag_p99_ms": 1.0,
    }


ROWS = [
    _row("direct", 0),
    _row("relay", 0, t=(150.0, 800.0, 1500.0), f=(0.75, 3.0)),
    _row("nginx", 0, t=(110.0, 520.0, 950.0), f=(0.55, 2.25)),
    _row("direct", 1, t=(200.0, 600.0, 1000.0), f=(1.0, 2.0)),
    _row("relay", 1, t=(300.0, 1000.0, 1600.0), f=(1.5, 4.0)),
    _row("nginx", 1, t=(230.0, 650.0, 1020.0), f=(1.0, 2.5)),
    _row("direct", 2, t=(100.0, 500.0, 900.0), f=(0.5, 2.0)),
    _row("relay", 2, t=(160.0, 600.0, 1000.0), f=(0.5, 2.5)),
    {"target": "nginx", "load": 64, "repeat": 2, "skipped": "nginx: not found"},
]


def test_added_is_the_target_quantile_minus_direct_in_the_same_repeat():
    assert transit.added(ROWS, ROWS[1], "transit_us", "p99") == 300.0
    assert transit.added(ROWS, ROWS[4], "ttft_ms", "p50") == 0.5
    other_load = _row("relay", 0, load=256)
    assert transit.added(ROWS, other_load, "transit_us", "p50") is None
    tab = {a["target"]: a for a in transit.added_table(ROWS, 64, ["direct", "relay", "nginx"])}
    assert tab["relay"]["transit_us:p50"] == {"per": [50.0, 100.0, 60.0], "median": 60.0}
    assert tab["relay"]["transit_us:p99.9"] == {"per": [600.0, 600.0, 100.0], "median": 600.0}
    assert tab["relay"]["ttft_ms:p99"] == {"per": [1.0, 2.0, 0.5], "median": 1.0}
    # two repeats only (the third was skipped): the median is their mean
    assert tab["nginx"]["transit_us:p50"] == {"per": [10.0, 30.0], "median": 20.0}
    assert tab["nginx"]["ttft_ms:p50"] == {
        "per": [pytest.approx(0.05), 0.0],
        "median": pytest.approx(0.025),
    }


def test_the_tables():
    lines = transit.render_load(ROWS, 64, ["direct", "relay", "nginx"], 50)
    assert lines[0] == "### 64 streams × 50 events/s (3,200 events/s)"
    assert (
        "| relay | 2 | 10 | 300 | 1000 | 1600 | 1.50 | 4.00 | 3 | 0 / 0 | 10 | 20 | 30 | 1 | 1.0 |"
        in lines
    )
    assert (
        "| direct | 1 | 10 | 100 | 500 | 900 | 0.50 | 2.00 | 3 | 0 / 0 | 10 | – | 30 | 1 | 1.0 |"
        in lines
    )
    assert "| nginx | 3 | nginx: not found |" + " |" * 12 in lines
    assert (
        "| relay − direct | **+60** (+50, +100, +60) | **+300** (+300, +400, +100)"
        " | **+600** (+600, +600, +100) | **+0.25** (+0.25, +0.50, +0.00)"
        " | **+1.00** (+1.00, +2.00, +0.50) |"
    ) in lines
    assert (
        "| nginx − direct | **+20** (+10, +30) | **+35** (+20, +50) | **+35** (+50, +20)"
        " | **+0.03** (+0.05, +0.00) | **+0.38** (+0.25, +0.50) |"
    ) in lines
    summary = transit.summary_table(ROWS, [64], ["direct", "relay", "nginx"])
    assert summary[2] == "| 64 | relay − direct | +60 | +300 | +600 | +0.25 | +1.00 |"
    assert summary[3] == "| 64 | nginx − direct | +20 | +35 | +35 | +0.03 | +0.38 |"


def test_cpu_per_event_is_the_proxy_cpu_of_the_run_over_its_events_held_to_its_nginx():
    def run(target, rep, pct, events=1000):
        r = _row(target, rep)
        r["cpu_pct"]["proxy"], r["content_events"], r["wall_s"] = pct, events, 2.0
        return r

    rows = [
        run("direct", 0, 0.0),
        run("relay", 0, 30.0),  # 0.6 s of CPU for 1,000 events: 600 µs an event
        run("nginx", 0, 15.0),
        run("relay", 1, 45.0, events=1500),
        run("nginx", 1, 10.0),
        run("relay_w2", 0, 40.0),
        run("nginx_w2", 0, 16.0),
    ]
    assert transit.cpu_per_event(rows[1]) == pytest.approx(600.0)
    assert transit.cpu_per_event(rows[0]) is None
    tab = {c["target"]: c for c in transit.cpu_table(rows, 64, transit.TARGETS)}
    assert "direct" not in tab
    assert tab["relay"]["per"] == pytest.approx([600.0, 600.0])
    assert tab["relay"]["vs"] == "nginx" and tab["relay"]["ratios"] == pytest.approx([2.0, 3.0])
    assert tab["relay"]["ratio"] == pytest.approx(2.5)
    assert tab["relay_w2"]["vs"] == "nginx_w2" and tab["relay_w2"]["ratio"] == pytest.approx(2.5)
    assert tab["nginx"]["ratio"] is None
    lines = transit.render_cpu(rows, 64, transit.TARGETS)
    assert "| relay | **600.00** (600.00, 600.00) | **2.50×** (2.00, 3.00) ÷ nginx |" in lines


def test_a_short_run_over_sockets_delivers_every_stamped_event(tmp_path):
    targets = ["direct", "relay"] + (["nginx"] if shutil.which("nginx") else [])
    a = transit.parse_args(
        ["--loads", "4", "--tokens", "5", "--duration-s", "0.4", "--ramp-s", "0.1"]
        + ["--warmup-s", "0", "--client-start-s", "0.3", "--quiet-wait-s", "0", "--timeout", "10"]
    )
    up = transit.Upstream(a, tmp_path)
    try:
        rows = [transit.run_one(t, 4, 0, up, tmp_path, a) for t in targets]
    finally:
        up.stop()
        procs.stop_all()
    for r in rows:
        assert r["errors"] == 0 and r["mismatch"] == 0, (r["target"], r["error_samples"])
        assert r["requests"] >= 4
        assert r["content_events"] == r["expected_events"] > 0
        assert r["transit_us"]["n"] == r["content_events"]  # no warm-up: every event counts
        assert r["min_transit_ns"] >= 0
        assert r["ttft_ms"]["p50"] > 0


def test_a_burst_opens_every_stream_of_each_wave_and_times_every_request(tmp_path):
    a = transit.parse_args(
        ["--loads", "6", "--burst", "2", "--tokens", "3", "--rate", "50", "--burst-gap-s", "0.1"]
        + ["--warmup-s", "0", "--client-start-s", "0.3", "--quiet-wait-s", "0", "--timeout", "10"]
    )
    # A wave lasts a stream (3 events at 50 a second), then the gap; the run is the waves.
    assert transit.burst_period(a) == pytest.approx(0.16)
    assert a.duration_s == pytest.approx(0.32)
    up = transit.Upstream(a, tmp_path)
    try:
        row = transit.run_one("direct", 6, 0, up, tmp_path, a)
    finally:
        up.stop()
        procs.stop_all()
    assert row["errors"] == 0 and row["mismatch"] == 0, row["error_samples"]
    # Every stream of both waves, each carrying the whole stream, each one's TTFT counted.
    assert row["requests"] == 12
    assert row["content_events"] == row["expected_events"] == 36
    assert row["ttft_ms"]["n"] == 12
    assert not row["ttft_first_wave_only"]

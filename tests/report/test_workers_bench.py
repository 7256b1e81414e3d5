"""bench.workers' pure parts: CPU per event and per request, the capacity ladder, the table."""

from bench import workers as W


def _row(target, load, rep, p99_us, cpu_pct=50.0, events=1000, requests=10, phase="events"):
    return {
        "target": target,
        "load": load,
        "repeat": rep,
        "phase": phase,
        "transit_us": {"p50": p99_us / 2, "p99": p99_us, "p99.9": p99_us},
        "ttft_ms": {"p50": 1.0, "p99": 2.0},
        "cpu_pct": {"proxy": cpu_pct, "upstream": 10.0, "clients": 20.0},
        "wall_s": 2.0,
        "content_events": events,
        "requests": requests,
    }


def test_cpu_per_event_and_per_request():
    r = _row("relay", 128, 0, 1000, cpu_pct=50.0, events=40000, requests=100)
    assert W.per_event_us(r) == 25.0  # 0.5 of a core for 2 s = 1e6 µs over 40000 events
    assert W.per_request_us(r) == 10000.0
    assert W.per_event_us({**r, "cpu_pct": {"proxy": None}}) is None


def test_capacity_is_the_last_load_under_the_budget_with_every_lower_one():
    rows = []
    for rep in (0, 1):
        for load, direct, relay in ((128, 300, 2300), (256, 400, 5300), (384, 500, 3000)):
            rows += [_row("direct", load, rep, direct), _row("relay", load, rep, relay)]
    # added p99: 2.0 ms at 128, 4.9 ms at 256, 2.5 ms at 384 (a lower load fails first: stop)
    assert W.capacity(rows, "relay", [128, 256, 384], 5.0) == 384
    assert W.capacity(rows, "relay", [128, 256, 384], 4.0) == 128
    assert W.capacity(rows, "relay", [128, 256, 384], 1.0) is None
    rows = [r for r in rows if not (r["target"] == "relay" and r["load"] == 256)]
    assert W.capacity(rows, "relay", [128, 256, 384], 5.0) == 128  # no figure: the ladder ends

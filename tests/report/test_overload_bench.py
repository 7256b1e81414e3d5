"""bench.overload's pure parts: the offered load, the arrival schedule, goodput and its ratio,
the goal's words, the relay's config per target, and where the report goes in RESULTS.md."""

from __future__ import annotations

import hashlib
import itertools
import statistics
from pathlib import Path

import pytest

from bench import overload as O
from relay.config import load_config, parse_config


def test_the_offered_load_is_the_factor_times_what_the_slots_serve():
    assert O.capacity(2, 0.5) == 4.0  # two slots, half a second a request
    assert O.interactive_rate(8, 0.5, 7.5) == 1.0  # 8 users, one request each per 8 s
    assert O.batch_rate(4.0, 2.0, 1.0) == 7.0  # 2 x 4 requests/s, 1 of them interactive
    assert O.batch_rate(4.0, 0.1, 1.0) == 0.0  # never negative


def test_poisson_arrivals_are_seeded_ordered_and_at_their_rate():
    a = O.poisson_arrivals(7.0, 2000.0, seed=3)
    assert a == O.poisson_arrivals(7.0, 2000.0, seed=3)
    assert a != O.poisson_arrivals(7.0, 2000.0, seed=4)
    assert a == sorted(a) and a[0] > 0 and a[-1] < 2000.0
    # 14000 expected; a Poisson count's standard deviation is its root, 118: within 3 of it
    assert abs(len(a) - 14000) < 360
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert abs(statistics.mean(gaps) - 1 / 7) < 0.03 / 7
    assert O.poisson_arrivals(0.0, 10.0, seed=1) == []


def test_think_times_fill_the_horizon_and_repeat_with_the_seed():
    t = O.think_times(7.5, 45.0, seed=5)
    assert t == O.think_times(7.5, 45.0, seed=5)
    assert sum(t) >= 45.0 > sum(t[:-1])
    long = O.think_times(2.0, 20000.0, seed=1)
    assert abs(statistics.mean(long) - 2.0) < 0.1
    assert O.think_times(0.0, 45.0, seed=5) == []


def test_a_plan_offers_twice_the_capacity_with_the_same_arrivals_for_every_target():
    a = O.parse_args(["--duration-s", "2000"])
    loaded = O.plan(a, 7, with_batch=True, shared_key=False)
    fifo = O.plan(a, 7, with_batch=True, shared_key=True)
    alone = O.plan(a, 7, with_batch=False, shared_key=False)
    service = a.tokens * a.interval_ms / 1000
    cap = a.parallel / service
    inter = a.users / (service + a.think_s)
    # the batch key brings the offered load to 2 C (within 2 % over 2000 s)
    assert abs((inter + len(loaded["batch"]) / 2000) / cap - 2.0) < 0.04
    assert loaded["batch"] == fifo["batch"] and loaded["users"] == alone["users"]
    assert alone["batch"] == []
    assert loaded["secrets"] == O.SECRETS
    assert fifo["secrets"] == {"interactive": O.SHARED, "batch": O.SHARED}
    assert [u["offset"] for u in loaded["users"]] == [
        (service + a.think_s) * u / a.users for u in range(a.users)
    ]


def _r(kind, sent, first=None, done=None, error=None, cut=None):
    return {"kind": kind, "sent": sent, "first": first, "done": done, "error": error, "cut": cut}


def test_goodput_counts_first_tokens_within_the_bound_in_the_window():
    records = [
        _r("interactive", 4.0, 4.1, 4.6),  # sent before the window: not counted
        _r("interactive", 5.0, 5.2, 5.7),  # 0.2 s
        _r("interactive", 10.0, 12.0, 12.5),  # exactly 2 s: within
        _r("interactive", 11.0, 13.5, 14.0),  # 2.5 s: missed
        _r("interactive", 12.0, error="HTTP 503"),  # failed: missed, an error
        _r("interactive", 20.0, cut=31.0),  # no first token at the cut: missed, waited >= 11 s
        _r("interactive", 25.0, 25.1, 25.6),  # sent at the window's end: not counted
        _r("batch", 1.0, 1.1, 5.5),  # done in the window
        _r("batch", 2.0, 2.1, 24.9),  # done in the window
        _r("batch", 3.0, 5.0, 25.0),  # done at its end: not counted
        _r("batch", 6.0, cut=31.0),
        _r("batch", 7.0, error="incomplete"),
    ]
    s = O.summarise(records, 5.0, 25.0, 2.0)
    assert s["interactive"] == 5
    assert s["good"] == 2
    assert s["goodput_rps"] == 2 / 20
    assert s["good_share"] == 2 / 5
    assert (s["cut"], s["errors"], s["batch_errors"]) == (1, 1, 1)
    # the waits: 0.2, 2.0, 2.5 and the cut one's 11 (a lower bound); nearest rank
    assert s["ttft_s"] == {"p50": 2.0, "p99": 11.0}
    assert s["ttft_floor"] == {"p50": False, "p99": True}
    assert s["batch_sent"] == 2
    assert s["batch_rps"] == 2 / 20
    assert s["served_rps"] == 5 / 20  # batch 2 + interactive 3 done in [5, 25)


def test_no_interactive_request_in_the_window_has_no_share():
    s = O.summarise([_r("batch", 6.0, 6.1, 7.0)], 5.0, 25.0, 2.0)
    assert (s["interactive"], s["good"], s["good_share"]) == (0, 0, None)
    assert s["ttft_s"] == {"p50": None, "p99": None}


def test_the_ratio_is_against_the_unloaded_run_of_the_same_repeat():
    rows = [
        {"target": "unloaded", "repeat": 0, "goodput_rps": 1.0},
        {"target": "unloaded", "repeat": 1, "goodput_rps": 2.0},
        {"target": "relay_prio", "repeat": 0, "goodput_rps": 0.95},
        {"target": "relay_prio", "repeat": 1, "goodput_rps": 1.0},
        {"target": "nginx", "repeat": 1, "skipped": "nginx: not found"},
    ]
    got = {(r["target"], r["repeat"]): r.get("ratio") for r in O.with_ratios(rows)}
    assert got == {
        ("unloaded", 0): 1.0,
        ("unloaded", 1): 1.0,
        ("relay_prio", 0): 0.95,
        ("relay_prio", 1): 0.5,
        ("nginx", 1): None,
    }
    assert O.ratio(1.0, None) is None and O.ratio(None, 1.0) is None and O.ratio(1.0, 0.0) is None


def test_the_goal_is_printed_met_or_not():
    def rows(prio, fifo):
        return [{"target": "relay_prio", "repeat": i, "ratio": x} for i, x in enumerate(prio)] + [
            {"target": "direct", "repeat": i, "ratio": x} for i, x in enumerate(fifo)
        ]

    met = O.verdict(rows([0.95, 0.9, 0.97], [0.0, 0.1, 0.0]), ["relay_prio", "direct"])
    assert "keeps 95 %" in met[0] and "met (>= 90 %)" in met[0] and "NOT" not in met[0]
    assert "direct 0 % (collapses)" in met[1]
    missed = O.verdict(rows([0.3, 0.35, 0.2], [0.6, 0.6, 0.7]), ["relay_prio", "direct"])
    assert "keeps 30 %" in missed[0] and "NOT met" in missed[0]
    assert "direct 60 % (does NOT collapse)" in missed[1]


def test_each_relay_target_gets_its_keys_classes_and_aging(tmp_path: Path):
    a = O.parse_args([])

    def cfg(target):
        return parse_config(
            load_config(str(O.relay_config(a, "http://127.0.0.1:9", tmp_path, target)))
        )

    def sha(secret):
        return hashlib.sha256(secret.encode()).hexdigest()

    fifo = cfg("relay_fifo")
    assert [(k.id, k.sha256) for k in fifo.key] == [("shared", sha(O.SHARED))]
    up = fifo.upstream[0]
    assert (up.parallel, up.queue, fifo.dispatcher.pool_timeout_s) == (a.parallel, 100000, 3600)
    fair, prio, noage = cfg("relay_fair"), cfg("relay_prio"), cfg("relay_prio_noage")
    assert [(k.id, k.sha256, k.rank) for k in fair.key] == [
        ("interactive", sha(O.SECRETS["interactive"]), 0),
        ("batch", sha(O.SECRETS["batch"]), 0),
    ]
    assert [k.rank for k in prio.key] == [1, 0]
    assert [k.rank for k in noage.key] == [1, 0]
    assert prio.balance.aging_s == 5.0 and noage.balance.aging_s == 3600.0
    assert cfg("relay_fair_noage").balance.aging_s == 3600.0
    a.aging_s = 30.0
    assert cfg("relay_prio").balance.aging_s == 30.0


def test_the_report_replaces_its_section_or_goes_on_top():
    section = f"{O.BEGIN}\n# new\n{O.END}\n"
    assert O.place(section, "# older\n") == section + "\n# older\n"
    old = f"# newest\n\n{O.BEGIN}\n# overload before\n{O.END}\n\n# older\n"
    assert O.place(section, old) == f"# newest\n\n{section}\n# older\n"


def test_the_report_names_no_path_the_run_wrote_to():
    argv = ["--repeat", "3", "--json", "/tmp/x.json", "--output=/tmp/r.md", "--keep-logs"]
    assert O.settings_of(argv + ["--seed", "2"]) == ["--repeat", "3", "--seed", "2"]


def test_python_m_bench_overload_is_the_same_entry():
    from bench.__main__ import main

    with pytest.raises(SystemExit, match=r"unknown target: \['relay_lifo'\]"):
        main(["overload", "--targets", "unloaded,relay_lifo"])

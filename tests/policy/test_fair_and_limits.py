"""relay/policy/fair.py and relay/policy/limits.py without sockets: which key's request is
served next, and the limits that act now."""

from __future__ import annotations

import pytest

from relay.policy.fair import Line, activated, charged, pick_line
from relay.policy.limits import WINDOW_S, KeyLimits


# ---- fair turns -------------------------------------------------------------------------
def test_the_highest_class_is_served_first():
    lines = [Line(0, 0.0, 1.0), Line(1, 5.0, 2.0), Line(-1, 0.0, 0.0)]
    assert pick_line(lines, now=2.5, aging_s=10.0) == 1


def test_within_a_class_the_lowest_virtual_start_then_the_oldest():
    assert pick_line([Line(0, 3.0, 1.0), Line(0, 2.0, 5.0)], now=6.0, aging_s=60.0) == 1
    assert pick_line([Line(0, 2.0, 5.0), Line(0, 2.0, 1.0)], now=6.0, aging_s=60.0) == 1
    assert pick_line([], now=0.0, aging_s=1.0) is None


def test_a_line_waiting_past_the_aging_bound_competes_with_the_highest_class():
    low, high = Line(-1, 1.0, 10.0), Line(1, 50.0, 14.0)
    assert pick_line([low, high], now=14.9, aging_s=5.0) == 1
    assert pick_line([low, high], now=15.0, aging_s=5.0) == 0


def test_an_aged_line_takes_turns_with_the_highest_class_never_above_it():
    # A flood's own line always has an old request: aged, it still waits for its turn behind
    # a fresh line of the highest class with a lower virtual start, and of its own class too.
    flood, person = Line(0, 10.0, 0.0), Line(1, 5.0, 5.9)
    assert pick_line([flood, person], now=6.0, aging_s=5.0) == 1
    same = Line(0, 5.0, 5.9)
    assert pick_line([flood, same], now=6.0, aging_s=5.0) == 1


def test_aging_counts_from_the_lines_last_turn():
    # Queued at 0 but served at 9: a backlog being served is not starved, so not aged.
    backlog, high = Line(-1, 0.0, 0.0, since=9.0), Line(1, 5.0, 9.5)
    assert pick_line([backlog, high], now=13.9, aging_s=5.0) == 1
    assert pick_line([backlog, high], now=14.0, aging_s=5.0) == 0


def _serve(order: list[str], queues: dict[str, int], weights: dict[str, int], n: int) -> None:
    """n turns of the start-time fair queue over keys with `queues[key]` requests waiting."""
    vtime = 0.0
    start = {k: activated(0.0, vtime) for k in queues}
    for _ in range(n):
        live = [k for k in queues if queues[k]]
        i = pick_line([Line(0, start[k], 0.0) for k in live], now=0.0, aging_s=1e9)
        assert i is not None
        k = live[i]
        order.append(k)
        queues[k] -= 1
        vtime = max(vtime, start[k])
        start[k] = charged(start[k], weights[k])


def test_two_keys_of_one_weight_alternate_however_many_each_queued():
    order: list[str] = []
    _serve(order, {"batch": 200, "person": 5}, {"batch": 1, "person": 1}, 10)
    assert order == ["batch", "person"] * 5


def test_weights_share_turns_in_proportion():
    order: list[str] = []
    _serve(order, {"a": 100, "b": 100}, {"a": 2, "b": 1}, 30)
    assert (order.count("a"), order.count("b")) == (20, 10)


def test_an_idle_key_banks_no_turns():
    # A line idle while the virtual time moved on starts at the virtual time, not before.
    assert activated(finish=1.0, vtime=40.0) == 40.0
    assert activated(finish=41.0, vtime=40.0) == 41.0


# ---- limits that act now ------------------------------------------------------------------
def test_max_concurrent_counts_admitted_until_settled():
    k = KeyLimits(max_concurrent=2)
    a, b = k.admit(10, 0.0), k.admit(10, 0.0)
    refusal = k.check(10, 1.0)
    assert refusal is not None and (refusal.limit, refusal.used, refusal.limit_value) == (
        "concurrent_requests",
        2,
        2,
    )
    k.settle(a, 1, 10, 2.0)
    k.settle(a, 1, 10, 2.0)  # once
    assert k.check(10, 2.0) is None and k.live == 1
    k.settle(b, 0, 0, 2.0)
    assert k.live == 0


def test_requests_per_minute_is_a_sliding_window():
    k = KeyLimits(rpm=3)
    for t in (0.0, 10.0, 20.0):
        assert k.check(0, t) is None
        k.admit(0, t)
    refusal = k.check(0, 30.0)
    # Room when the first of the three leaves the window.
    assert refusal is not None and refusal.limit == "minute_requests"
    assert refusal.resets_at == pytest.approx(0.0 + WINDOW_S)
    assert k.check(0, 59.999) is not None
    assert k.check(0, 60.0) is None


def test_a_request_no_upstream_served_leaves_the_minute_window():
    k = KeyLimits(rpm=1)
    e = k.admit(0, 0.0)
    assert k.check(0, 1.0) is not None
    k.settle(e, 0, 0, 1.0)
    assert k.check(0, 1.0) is None


def test_tokens_per_minute_reserve_then_settle_to_what_was_charged():
    k = KeyLimits(tpm=100)
    e = k.admit(80, 0.0)
    refusal = k.check(30, 1.0)
    assert refusal is not None and (refusal.limit, refusal.used, refusal.requested) == (
        "minute_tokens",
        80,
        30,
    )
    k.settle(e, 1, 50, 2.0)  # it used 50 of its 80
    assert k.check(30, 2.0) is None
    k.admit(30, 2.0)
    refusal = k.check(40, 3.0)
    assert refusal is not None
    # 50 + 30 + 40 > 100: room once the 50 leave (at 60 s), then 30 + 40 fit.
    assert refusal.resets_at == pytest.approx(WINDOW_S)


def test_a_request_larger_than_the_minute_never_fits():
    k = KeyLimits(tpm=100)
    refusal = k.check(101, 5.0)
    assert refusal is not None and refusal.resets_at == pytest.approx(5.0 + WINDOW_S)


def test_new_limits_keep_what_is_held():
    k = KeyLimits(max_concurrent=1)
    k.admit(0, 0.0)
    k.set(2, 0, 0)
    assert k.check(0, 0.0) is None and k.live == 1

"""The parent's rules for its workers' lives (relay.workers.liveness), on a clock the tests
hold: the silence of a worker counts from its first unanswered ask and never over a stall of
the parent's own loop; restarts back off 1 s doubling to 30 s, reset by 30 s of service; a
relay gives up only after the bound with no worker serving."""

from __future__ import annotations

import pytest

from relay.config import ConfigError, parse_config
from relay.workers.liveness import Awake, Hearing, Restarts, Vacancy, stall_slack


def test_silence_counts_from_the_first_unanswered_ask():
    h = Hearing(now=100.0)
    assert h.silent_s(now=130.0, awake_since=0.0) == 0.0  # (never asked: nothing missed)
    h.asked(110.0)
    h.asked(111.0)  # a second ask does not move the count
    assert h.silent_s(now=114.0, awake_since=0.0) == 4.0
    h.heard(114.5)  # any frame is an answer
    assert h.silent_s(now=200.0, awake_since=0.0) == 0.0
    h.asked(201.0)
    assert h.silent_s(now=203.0, awake_since=0.0) == 2.0


def test_a_stall_of_the_parent_starts_every_count_again():
    awake = Awake(now=0.0)
    h = Hearing(now=0.0)
    h.asked(0.5)
    assert not awake.tick(now=0.25, period=0.25, slack=stall_slack(5.0))
    assert not awake.tick(now=0.6, period=0.25, slack=stall_slack(5.0))  # 0.1 s late: runs
    # The parent's loop did not run for 10 s: the worker's answer may be waiting unread.
    assert awake.tick(now=10.6, period=0.25, slack=stall_slack(5.0))
    assert awake.since == 10.6
    assert h.silent_s(now=10.6, awake_since=awake.since) == 0.0
    assert h.silent_s(now=15.6, awake_since=awake.since) == 5.0
    assert not awake.tick(now=10.85, period=0.25, slack=stall_slack(5.0))
    assert awake.since == 10.6


def test_restarts_back_off_doubling_to_the_cap():
    r = Restarts()
    # A worker that served a while and is lost: replaced at once.
    assert r.lost(lived_s=12.0, served=True) == 0.0
    # Its replacements die at their start: 1, 2, 4, 8, 16, then 30 s for ever.
    waits = [r.lost(lived_s=0.2, served=False) for _ in range(8)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert all(r.lost(lived_s=0.2, served=False) == 30.0 for _ in range(2000))


def test_a_worker_that_dies_at_its_start_waits_a_second_first():
    assert Restarts().lost(lived_s=0.3, served=True) == 1.0
    assert Restarts().lost(lived_s=5.0, served=False) == 1.0


def test_thirty_seconds_of_service_reset_the_backoff():
    r = Restarts()
    for _ in range(4):
        r.lost(lived_s=0.1, served=False)
    assert r.lost(lived_s=29.0, served=True) == 16.0  # (not long enough)
    assert r.lost(lived_s=30.0, served=True) == 0.0
    assert r.lost(lived_s=0.1, served=False) == 1.0


def test_a_failed_spawn_backs_off_as_a_quick_death():
    r = Restarts()
    assert [r.failed(), r.failed(), r.failed()] == [1.0, 2.0, 4.0]


def test_the_relay_is_empty_only_while_no_worker_serves():
    v = Vacancy()
    v.seen(serving=True, now=0.0)
    assert v.empty_s(now=100.0, awake_since=0.0) == 0.0
    v.seen(serving=False, now=10.0)
    v.seen(serving=False, now=20.0)
    assert v.empty_s(now=70.0, awake_since=0.0) == 60.0
    # Not over a stall of the parent's own loop.
    assert v.empty_s(now=70.0, awake_since=65.0) == 5.0
    v.seen(serving=True, now=71.0)
    assert v.empty_s(now=200.0, awake_since=0.0) == 0.0


@pytest.mark.parametrize(
    ("key", "value"),
    [("worker_timeout_s", 0.5), ("worker_timeout_s", 7200), ("no_workers_exit_s", 0)],
)
def test_the_bounds_out_of_range_are_refused_naming_the_key(key, value):
    data = {"server": {key: value}, "upstream": [{"name": "u", "url": "http://127.0.0.1:9"}]}
    with pytest.raises(ConfigError, match=f"server.{key}"):
        parse_config(data)


def test_the_bounds_default_to_five_and_sixty_seconds():
    cfg = parse_config({"upstream": [{"name": "u", "url": "http://127.0.0.1:9"}]})
    assert (cfg.server.worker_timeout_s, cfg.server.no_workers_exit_s) == (5.0, 60.0)

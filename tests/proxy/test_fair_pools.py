"""Fair turns between keys in a pool of two upstreams (issue 33 item 6, docs/fleet.md): one relay
in this process in front of two simulators serving one model, one slot each. The pool's queue
keeps one line per key whichever member frees a slot, so what tests/proxy/test_fair_share.py
shows of one upstream holds across the members:

- a key flooding 200 requests does not hold back another key's requests sent one by one: each
  waits at most one service time of the flood's, and takes a slot of either member;
- two keys with requests waiting take turns 1:1 over the two members (the order the two
  simulators, on this process's one clock, saw the requests start).
"""

from __future__ import annotations

import asyncio

import pytest

from relay.config import BalanceConfig, UpstreamConfig
from relay.sim.server import Simulator
from tests.proxy.test_fair_share import (
    SERVICE,
    WAIT_S,
    Holders,
    ask,
    cancel,
    keyed,
    prefixes,
    rows_of,
    service_ms,
)
from tests.support.helpers import wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
async def pair(sim):
    """The `sim` fixture's simulator and one more, both serving `tiny`."""
    other = Simulator()
    await other.start()
    yield sim, other
    await other.stop()


def members(pair) -> list[UpstreamConfig]:
    return [
        UpstreamConfig(name=name, url=s.url, models=["tiny"], parallel=1, queue=400)
        for name, s in zip(("one", "two"), pair)
    ]


def started(pair) -> list[str]:
    """Whose each chat request was, in the order the two simulators saw them start."""
    seen = [
        (r.started_at, r.json["messages"][0]["content"].removeprefix("from "))
        for s in pair
        for r in s.requests
        if r.path == "/v1/chat/completions" and r.json is not None
    ]
    return [who for _, who in sorted(seen)]


async def flood_then_one_by_one(app, pair) -> tuple[list[int], list[dict], list[dict]]:
    """A floods 200 requests, then B sends 10 one by one: for each of B's, how many requests
    started before it once it was sent; B's rows; A's rows answered 200."""
    holders = Holders()
    await holders.hold(app.port, "z", 1)
    await wait_for(lambda: app.board.held_by_key.get("z") == 1, WAIT_S)
    tasks = [asyncio.create_task(ask(app.port, "a", f"a{i}")) for i in range(200)]
    between = []
    try:
        await wait_for(
            lambda: app.board.waiting_by_key().get("a", 0) + started(pair).count("a") >= 200,
            WAIT_S,
        )

        # Z hangs up once A's first request is half-way: the members' turns come half a
        # service apart (test_fair_share.staggered says why).
        def half_way() -> bool:
            return any(
                not r.finished and r.tokens_sent >= SERVICE["tokens"] // 2
                for s in pair
                for r in s.requests
                if r.json is not None and r.json["messages"][0]["content"] == "from a"
            )

        await wait_for(half_way, WAIT_S, step=0.002)
        holders.hang_up()
        for i in range(10):
            before = len(started(pair))
            await ask(app.port, "b", f"b{i}")
            between.append(started(pair)[before:].index("b"))
        b_rows = rows_of(app, "b")
        a_rows = [r for r in rows_of(app, "a") if r["status"] == 200]
    finally:
        holders.hang_up()
        await cancel(tasks)
    return between, b_rows, a_rows


async def test_a_flood_does_not_hold_back_another_key_in_a_pool(make_relay, pair):
    # Every request of B is one prompt, whose member would hold it for up to
    # `affinity_wait_s` (the next test): with no hold, the first member to free a slot
    # gives it to B.
    app = await make_relay(
        upstreams=members(pair),
        keys=keyed("a", "b", "z"),
        pool_timeout_s=300,
        balance=BalanceConfig(affinity_wait_s=0),
    )
    between, b_rows, a_rows = await flood_then_one_by_one(app, pair)
    assert max(between) <= 2, between
    one_service = max(service_ms(r) for r in a_rows)
    for r in b_rows:
        assert r["queue_position"] == 1, r
        assert 0 < r["queue_ms"] <= one_service, (r["request_id"], r["queue_ms"], one_service)
    # Whichever member freed a slot first gave it to B.
    assert {r["upstream_served"] for r in b_rows} == {"one", "two"}
    assert {r["pool"] for r in b_rows} == {"tiny"}


async def test_with_the_default_hold_a_flood_still_holds_back_another_key_one_service_at_most(
    make_relay, pair
):
    # With the default `affinity_wait_s`, B's request holds for the member its prompt lives
    # on while the other member's freed slot may go to A's flood; its member frees within one
    # service time of A's, and its slot is B's turn: B still waits one service time at most.
    app = await make_relay(upstreams=members(pair), keys=keyed("a", "b", "z"), pool_timeout_s=300)
    _between, b_rows, a_rows = await flood_then_one_by_one(app, pair)
    one_service = max(service_ms(r) for r in a_rows)
    assert len(b_rows) == 10
    for r in b_rows:
        assert r["status"] == 200 and r["queue_position"] == 1, r
        assert 0 < r["queue_ms"] <= one_service, (r["request_id"], r["queue_ms"], one_service)


async def test_two_keys_take_turns_across_a_pool(make_relay, pair):
    app = await make_relay(upstreams=members(pair), keys=keyed("x", "y", "z"), pool_timeout_s=300)
    holders = Holders()
    await holders.hold(app.port, "z", 2)
    await wait_for(lambda: app.board.held_by_key.get("z") == 2, WAIT_S)
    tasks = [asyncio.create_task(ask(app.port, "x", f"x{i}")) for i in range(20)]
    await wait_for(lambda: app.board.waiting_by_key().get("x") == 20, WAIT_S)
    tasks += [asyncio.create_task(ask(app.port, "y", f"y{i}")) for i in range(20)]
    await wait_for(lambda: app.board.waiting_by_key().get("y") == 20, WAIT_S)
    holders.hang_up()
    await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    order = [who for who in started(pair) if who != "z"]
    assert sorted(order) == ["x"] * 20 + ["y"] * 20
    drift = prefixes(order, "x", "y", 1)
    assert max(abs(d) for d in drift) <= 2, (order, drift)
    served = {r["upstream_served"] for r in rows_of(app, "x") + rows_of(app, "y")}
    assert served == {"one", "two"}

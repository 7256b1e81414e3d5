"""relay_reserve on a real PostgreSQL (relay/store/pg_sql.py, relay/store/pg_budget.py): concurrent
reservations of several relays admit exactly the limit; leases expire into charged rows
unless renewed; a settled row replaces its lease."""

import asyncio
import time

import pytest

from relay.config import KeyConfig, pg_connect_kwargs
from relay.observe.record import Record
from relay.policy.budget import Budgets
from relay.store import pg_sql
from relay.store.pg_budget import SharedBudget, Unavailable
from tests.support.pg_server import PASSWORD_ENV


@pytest.fixture
def db(pg_server):
    import psycopg

    name = pg_server.create_db()
    with psycopg.connect(pg_server.admin_url(name), autocommit=True) as conn:
        for stmt in pg_sql.SETUP:
            conn.execute(stmt)
    return name


def _shared(pg_server, db: str, relay_id: str, ttl: float = 30.0) -> SharedBudget:
    return SharedBudget(pg_connect_kwargs(pg_server.url(db), PASSWORD_ENV), relay_id, ttl)


def _ask(shared: SharedBudget, budgets: Budgets, lease: str, tokens: int = 10):
    now = time.time()
    res = budgets.reserve("k", tokens, now)
    rec = Record(ts=now, request_id=lease, path="/v1/chat/completions", key_id="k")
    return shared.reserve(lease, res, rec, 4, tokens - 4, now)


def _budgets(**limits) -> Budgets:
    # the local view is kept wide open: only the database decides here
    return Budgets([KeyConfig(id="k", sha256="0" * 64, **limits)])


async def test_sixty_concurrent_reservations_from_three_relays_admit_exactly_seven(pg_server, db):
    relays = [_shared(pg_server, db, f"relay{i}") for i in range(3)]
    for r in relays:
        r.pool_size = 20  # 60 transactions at once: the per-key lock is what serialises them
    answers = await asyncio.gather(
        *(_ask(relays[i % 3], _budgets(requests_per_day=7), f"relay{i % 3}-{i}") for i in range(60))
    )
    assert sum(a is None for a in answers) == 7
    refused = [a for a in answers if a is not None]
    assert {(e.limit, e.used, e.requested, e.limit_value) for e in refused} == {
        ("daily_requests", 7, 1, 7)
    }
    assert pg_server.query(db, "SELECT count(*) FROM reservation") == [(7,)]
    for r in relays:
        await r.close()


async def test_a_token_window_counts_settled_tokens_and_live_leases(pg_server, db):
    shared = _shared(pg_server, db, "relay-t")
    assert await _ask(shared, _budgets(tokens_per_day=100), "a", 60) is None
    exc = await _ask(shared, _budgets(tokens_per_day=100), "b", 60)
    assert (exc.limit, exc.used, exc.requested) == ("daily_tokens", 60, 60)
    # the settlement: the row in, the lease out, one transaction (as store.postgres)
    pg_server.query(
        db,
        "WITH gone AS (DELETE FROM reservation WHERE id = 'a' RETURNING ts)"
        " INSERT INTO request (ts, key_id, upstream_served, prompt_tokens,"
        " completion_tokens, row_id) SELECT ts, 'k', 'llm', 5, 15, 'a' FROM gone"
        " RETURNING 1",
    )
    assert await _ask(shared, _budgets(tokens_per_day=100), "c", 80) is None  # 20 + 80
    exc = await _ask(shared, _budgets(tokens_per_day=100), "d", 1)
    assert (exc.limit, exc.used, exc.requested) == ("daily_tokens", 100, 1)
    await shared.close()


async def test_a_lease_not_renewed_expires_into_a_relay_crashed_row_once(pg_server, db):
    dead = _shared(pg_server, db, "dead", ttl=0.2)
    live = _shared(pg_server, db, "live", ttl=0.2)
    assert await _ask(dead, _budgets(requests_per_day=2), "dead-1") is None
    assert await _ask(live, _budgets(requests_per_day=2), "live-1") is None
    for _ in range(4):  # the live relay renews; the dead one does not
        await asyncio.sleep(0.1)
        await live.renew()
    await live.expire()
    await live.expire()  # twice: still one row
    assert pg_server.query(db, "SELECT id FROM reservation") == [("live-1",)]
    assert pg_server.query(
        db,
        "SELECT row_id, error_code, tokens_source, prompt_tokens, completion_tokens FROM request",
    ) == [("dead-1", "relay_crashed", "reserved", 4, 6)]
    # charged: the key's two requests are spent
    exc = await _ask(live, _budgets(requests_per_day=2), "live-2")
    assert (exc.limit, exc.used) == ("daily_requests", 2)
    assert await live.usage("k", 0.0) == (1, 10)
    await dead.close()
    await live.close()


async def test_an_unreachable_server_fails_fast_then_is_tried_again(pg_server, db):
    shared = SharedBudget(
        {"conninfo": "postgresql://relay@127.0.0.1:1/x"}, "r", 30.0, timeout_s=1.0, retry_s=0.3
    )
    t0 = time.monotonic()
    with pytest.raises(Unavailable):
        await _ask(shared, _budgets(requests_per_day=2), "x1")
    with pytest.raises(Unavailable, match="retrying shortly"):  # no new attempt yet
        await _ask(shared, _budgets(requests_per_day=2), "x2")
    assert time.monotonic() - t0 < 1.0 and shared.unavailable == 2
    shared.kw = pg_connect_kwargs(pg_server.url(db), PASSWORD_ENV)
    shared._down_until = 0.0
    assert await _ask(shared, _budgets(requests_per_day=2), "x3") is None
    await shared.close()


async def test_a_row_replaces_its_expired_leases_placeholder_and_is_never_doubled(pg_server, db):
    import psycopg

    from relay.store.schema import COLUMNS

    late = _shared(pg_server, db, "late", ttl=0.05)
    assert await _ask(late, _budgets(requests_per_day=5), "late-1") is None
    await asyncio.sleep(0.1)
    await late.expire()  # the relay was cut off longer than the ttl: a placeholder
    row = dict.fromkeys(COLUMNS)
    row.update(
        ts=time.time(),
        request_id="late-1",
        key_id="k",
        upstream_served="llm",
        ok=1,
        status=200,
        prompt_tokens=4,
        completion_tokens=2,
        tokens_source="exact",
    )
    values = tuple(row[c] for c in COLUMNS) + ("late-1",)
    with psycopg.connect(pg_server.admin_url(db), autocommit=True) as conn:
        for _ in range(2):  # the spill replayed twice
            conn.execute(pg_sql.INSERT, values)
        other = dict(row, status=500, ok=0)  # a different row under the same id: kept out
        conn.execute(pg_sql.INSERT, tuple(other[c] for c in COLUMNS) + ("late-1",))
    assert pg_server.query(
        db, "SELECT row_id, error_code, status, tokens_source, completion_tokens FROM request"
    ) == [("late-1", None, 200, "exact", 2)]
    assert await late.usage("k", 0.0) == (1, 6)
    await late.close()


async def test_a_server_that_accepts_but_never_answers_costs_one_timeout_not_a_queue(pg_server):
    held = []

    async def silent(reader, writer):  # a hung server: the connection opens, nothing comes
        held.append(writer)
        await reader.read()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    shared = SharedBudget(
        {"conninfo": f"postgresql://relay@127.0.0.1:{port}/x"},
        "r",
        30.0,
        timeout_s=0.3,
        retry_s=5.0,
    )
    try:
        t0 = time.monotonic()
        outcomes = await asyncio.gather(
            *(_ask(shared, _budgets(requests_per_day=9), f"h{i}") for i in range(40)),
            return_exceptions=True,
        )
        took = time.monotonic() - t0
        assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
        # the first few wait out one timeout each, in parallel; the rest never ask: they
        # fail once those did, or when their own bound ends while all connections wait
        assert took < 1.5, took
        asked = [o for o in outcomes if "retrying shortly" not in str(o)]
        asked = [o for o in asked if "no connection free" not in str(o)]
        assert len(asked) <= shared.pool_size, asked
    finally:
        for w in held:
            w.close()
        server.close()
        await shared.close()

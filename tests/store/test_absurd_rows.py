"""Rows already stored with absurd token figures (issue 31: an older relay stored the upstream's
figures unchecked) never fail a start nor the budget rebuild, on SQLite and PostgreSQL.

A stored figure is clamped to a plausible count, 0 to 10^9 (docs/budgets.md): a negative one
counts 0, a larger one 10^9. The expected usage is written out by hand from the rows below."""

from __future__ import annotations

import sqlite3
import time

import pytest

from relay.config import StoreConfig
from relay.observe.log import Log
from relay.policy.budget import window_bounds
from relay.store import pg_sql
from relay.store.schema import COLUMNS
from relay.store.sqlite import Store
from tests.support.keys import key
from tests.support.pg_server import PASSWORD_ENV

HUGE = 9223372036854775000
# (prompt_tokens, completion_tokens) of each served row of key alpha, and what it counts
ROWS = [
    (HUGE, 3),  # 1000000003
    (HUGE, 3),  # 1000000003: two of them overflowed SQLite's SUM
    (-1000000, 5),  # 5: the key was given a million tokens back
    (10, 20),  # 30
    (1000000000, 1),  # 1000000001
    (1000000001, 2),  # 1000000002
]
# 1000000003 + 1000000003 + 5 + 30 + 1000000001 + 1000000002
TOKENS = 4000000044
# what SQLite alone can hold besides: a REAL beyond any count, a string (which SQLite orders
# above every number): 1000000007 + 1000000011
SQLITE_ONLY = [(1e300, 7), ("abc", 11)]
SQLITE_TOKENS = TOKENS + 2000000018
LIMITS = dict(
    requests_per_day=100, tokens_per_day=10**10, requests_per_month=100, tokens_per_month=10**10
)


def _row(i: int, prompt, completion, now: float) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(
        ts=now,
        request_id=f"r{i}",
        key_id="alpha",
        path="/v1/messages",
        upstream_requested="llm",
        upstream_served="llm",
        status=200,
        ok=1,
        prompt_tokens=prompt,
        completion_tokens=completion,
        tokens_source="exact",
    )
    return row


def _sqlite_file(path: str, rows: list[tuple]) -> None:
    """A store file with the relay's schema, the rows written into it directly."""
    store = Store(path)
    store.start()
    store.close()
    now = time.time()
    conn = sqlite3.connect(path)
    with conn:
        for i, (prompt, completion) in enumerate(rows):
            row = _row(i, prompt, completion, now)
            conn.execute(
                f"INSERT INTO request ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                [row[c] for c in COLUMNS],
            )
    conn.close()


def test_sqlite_usage_clamps_each_figure(tmp_path):
    db = str(tmp_path / "relay.db")
    _sqlite_file(db, ROWS + SQLITE_ONLY)
    store = Store(db)
    store.start()
    try:
        assert store.usage_since("alpha", 0.0, served_only=True) == (8, SQLITE_TOKENS)
        assert store.usage_since("alpha", 0.0) == (8, SQLITE_TOKENS)
        day = window_bounds("daily", time.time())[0]
        assert store.usage_read([("alpha", day)]).result(timeout=30) == [(8, SQLITE_TOKENS)]
    finally:
        store.close()


async def test_a_relay_starts_on_a_file_holding_absurd_rows(make_relay, tmp_path):
    db = str(tmp_path / "relay.db")
    _sqlite_file(db, ROWS + SQLITE_ONLY)
    app = await make_relay(keys=[key(**LIMITS)], store=db)
    used = {"requests": 8, "tokens": SQLITE_TOKENS, "reserved_requests": 0, "reserved_tokens": 0}
    assert app.budgets.usage("alpha", time.time()) == {"daily": used, "monthly": used}


# ---- PostgreSQL ----------------------------------------------------------------------------------
@pytest.fixture
def pg_db(pg_server):
    import psycopg

    name = pg_server.create_db()
    with psycopg.connect(pg_server.admin_url(name), autocommit=True) as c, c.transaction():
        for stmt in pg_sql.SETUP:
            c.execute(stmt)
    return name


def _pg_rows(rows: list[tuple]) -> list[tuple]:
    now = time.time()
    out = []
    for i, (prompt, completion) in enumerate(rows):
        row = _row(i, prompt, completion, now) | {"row_id": f"row-{i}"}
        out.append(tuple(row[c] for c in pg_sql.ROW_COLUMNS))
    return out


def _pg_store(pg_server, db: str, tmp_path):
    from relay.store.postgres import PgStore

    cfg = StoreConfig(
        url=pg_server.url(db), password_env=PASSWORD_ENV, spill_path=str(tmp_path / "spill")
    )
    return PgStore.configured(cfg, Log())


def test_postgres_takes_absurd_rows_and_clamps_each_figure(pg_server, pg_db, tmp_path):
    import psycopg

    url = pg_server.admin_url(pg_db)
    with psycopg.connect(url, autocommit=True) as conn, conn.transaction(), conn.cursor() as cur:
        cur.executemany(pg_sql.INSERT, _pg_rows(ROWS))
    store = _pg_store(pg_server, pg_db, tmp_path)
    store.start()
    try:
        day = window_bounds("daily", time.time())[0]
        assert store.usage_since("alpha", day, served_only=True) == (6, TOKENS)
        assert store.usage_since("alpha", day) == (6, TOKENS)
    finally:
        store.close()


def test_postgres_rebuilds_usage_day_kept_under_the_unchecked_rule(pg_server, pg_db, tmp_path):
    """A database whose usage_day an older relay kept, summing the figures unchecked: the
    next start rebuilds it from the rows once."""
    import psycopg

    day = window_bounds("daily", time.time())[0]
    with psycopg.connect(pg_server.admin_url(pg_db), autocommit=True) as conn, conn.transaction():
        conn.execute("ALTER TABLE request DISABLE TRIGGER relay_usage_day")
        conn.cursor().executemany(pg_sql.INSERT, _pg_rows([(-1000000, 5), (10, 20)]))
        conn.execute("ALTER TABLE request ENABLE TRIGGER relay_usage_day")
        # what the unchecked sum kept: -1000000 + 5 + 10 + 20, and no mark of the rule
        conn.execute(
            "INSERT INTO usage_day (key_id, day, n, t) VALUES ('alpha', %s, 2, -999965)", (day,)
        )
        conn.execute("COMMENT ON TABLE usage_day IS NULL")
    store = _pg_store(pg_server, pg_db, tmp_path)
    store.start()
    try:
        # 5 + 10 + 20
        assert store.usage_since("alpha", day, served_only=True) == (2, 35)
    finally:
        store.close()

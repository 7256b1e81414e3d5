"""The fleet's two columns (issue 32, item 6): `pool` and `cached_tokens` travel from the request's
Record into the row in SQLite and PostgreSQL; a database an older relay made gains them at start,
its rows reading NULL there; a spill file an older relay left replays, its rows short of them."""

from __future__ import annotations

import sqlite3
import time

import pytest

from relay.config import StoreConfig
from relay.observe.log import Log
from relay.observe.record import EXACT, Record
from relay.store import pg_sql, spill
from relay.store.schema import COLUMN_TYPES, COLUMNS
from relay.store.sqlite import Store
from tests.support.pg_server import PASSWORD_ENV

NEW = ("pool", "cached_tokens")
# The table as the relay before these columns made it: every column before the two, in order.
OLD_TYPES = COLUMN_TYPES[: COLUMNS.index("pool")]
OLD_COLUMNS = tuple(c for c, _ in OLD_TYPES)


def record(rid: str, pool: str | None, cached: int | None) -> Record:
    rec = Record(ts=time.time(), request_id=rid, path="/v1/chat/completions", model="qwen")
    rec.upstream_served, rec.pool = "box-2", pool
    rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens = 1200, cached, 8
    rec.tokens_source, rec.ok, rec.status = EXACT, True, 200
    return rec


def test_the_columns_follow_the_tables_order_and_types():
    assert dict(COLUMN_TYPES)["pool"] == "TEXT"
    assert dict(COLUMN_TYPES)["cached_tokens"] == "INTEGER"
    # added after every column an older relay has (and before any added since)
    at = COLUMNS.index("pool")
    assert COLUMNS[at : at + 2] == NEW and "queue_position" in COLUMNS[at + 2 :]


# ---- SQLite -------------------------------------------------------------------------------------
def _old_sqlite(path: str) -> None:
    conn = sqlite3.connect(path)
    conn.execute(f"CREATE TABLE request ({', '.join(f'{c} {t}' for c, t in OLD_TYPES)})")
    conn.execute(
        "INSERT INTO request (ts, request_id, upstream_served, prompt_tokens, ok)"
        " VALUES (?, 'old-1', 'box-1', 700, 1)",
        (time.time() - 60,),
    )
    conn.commit()
    conn.close()


def test_an_old_sqlite_database_gains_the_columns_and_takes_them(tmp_path):
    path = str(tmp_path / "old.db")
    _old_sqlite(path)
    store = Store(path)
    store.start()
    try:
        store.put_record(record("new-1", "qwen", 1100))
        store.put_record(record("new-2", None, None))
        store.flush()
        got = store.query("SELECT * FROM request ORDER BY rowid")
        assert list(got[0]) == list(COLUMNS)
        assert [
            (r["request_id"], r["pool"], r["prompt_tokens"], r["cached_tokens"]) for r in got
        ] == [
            ("old-1", None, 700, None),
            ("new-1", "qwen", 1200, 1100),
            ("new-2", None, 1200, None),
        ]
        kinds = store.query(
            "SELECT typeof(pool) AS p, typeof(cached_tokens) AS c FROM request"
            " WHERE request_id = 'new-1'"
        )
        assert kinds == [{"p": "text", "c": "integer"}]
    finally:
        store.close()
    store = Store(path)  # a second start finds nothing to add
    store.start()
    store.close()
    cols = [r[1] for r in sqlite3.connect(path).execute("PRAGMA table_info(request)")]
    assert cols == list(COLUMNS)


# ---- PostgreSQL ---------------------------------------------------------------------------------
_PG = {"REAL": "DOUBLE PRECISION", "INTEGER": "BIGINT", "TEXT": "TEXT"}


@pytest.fixture
def old_pg_db(pg_server):
    """A database whose request table an older relay made: no pool, no cached_tokens."""
    import psycopg

    name = pg_server.create_db()
    old_table = (
        "CREATE TABLE request ("
        + ", ".join(f"{c} {_PG[t]}" for c, t in OLD_TYPES)
        + ", row_id TEXT)"
    )
    with psycopg.connect(pg_server.admin_url(name), autocommit=True) as c:
        c.execute(old_table)
        c.execute("CREATE UNIQUE INDEX request_row_id ON request (row_id)")
        c.execute(
            "INSERT INTO request (ts, request_id, prompt_tokens, ok, row_id)"
            " VALUES (%s, 'old-1', 700, 1, 'old-row-1')",
            (time.time() - 60,),
        )
    return name


def _pg_store(pg_server, db: str, spill_path: str):
    from relay.store.postgres import PgStore

    cfg = StoreConfig(url=pg_server.url(db), password_env=PASSWORD_ENV, spill_path=spill_path)
    return PgStore.configured(cfg, Log())


def _old_spilled_row(rid: str) -> tuple:
    """A row as an older relay spilled it: its columns then its row id."""
    values = dict.fromkeys(OLD_COLUMNS) | {
        "ts": time.time() - 30,
        "request_id": rid,
        "prompt_tokens": 900,
        "ok": 1,
    }
    return (*(values[c] for c in OLD_COLUMNS), f"spilled-{rid}")


def test_an_old_postgres_table_gains_the_columns_and_an_old_spill_replays(
    pg_server, old_pg_db, tmp_path
):
    spill_path = tmp_path / "spill.jsonl"
    spill_path.write_bytes(spill.encode([_old_spilled_row("sp-1"), _old_spilled_row("sp-2")]))
    store = _pg_store(pg_server, old_pg_db, str(spill_path))
    store.start()
    try:
        store.put_record(record("new-1", "qwen", 1100))
        store.put_record(record("new-2", None, None))
        store.flush()
        assert store.rows_replayed == 2 and spill_path.stat().st_size == 0
        got = store.query(
            "SELECT request_id, pool, prompt_tokens, cached_tokens FROM request ORDER BY request_id"
        )
    finally:
        store.close()
    assert [tuple(r.values()) for r in got] == [
        ("new-1", "qwen", 1200, 1100),
        ("new-2", None, 1200, None),
        ("old-1", None, 700, None),
        ("sp-1", None, 900, None),
        ("sp-2", None, 900, None),
    ]
    types = pg_server.query(
        old_pg_db,
        "SELECT column_name, data_type FROM information_schema.columns"
        " WHERE table_name = 'request' AND column_name IN ('pool', 'cached_tokens')"
        " ORDER BY column_name",
    )
    assert types == [("cached_tokens", "bigint"), ("pool", "text")]
    assert pg_sql.ROW_COLUMNS[-4:] == (*NEW, "queue_position", "row_id")

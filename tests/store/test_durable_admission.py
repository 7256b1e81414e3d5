"""The durable admission with a database another connection holds locked (a backup, an
operator's shell): a keyed request waits a bounded time for its admission record (taken
before it queues for a slot), is served without one (`admission_not_durable`) rather than
held or refused, and the writer serves admissions while a row batch backs off."""

import asyncio
import sqlite3
import time

from relay.observe.record import Record
from relay.proxy.dispatch import ADMIT_WAIT_S
from relay.store.sqlite import Store
from tests.support import httpc
from tests.support.helpers import wait_for
from tests.support.keys import bearer, key

CHAT = "/v1/chat/completions"


def _lock(db: str) -> sqlite3.Connection:
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN EXCLUSIVE")
    return other


async def test_a_locked_database_delays_keyed_requests_by_the_admission_bound_only(
    make_relay, tmp_path
):
    db = str(tmp_path / "relay.db")
    app = await make_relay(
        store=db, keys=[key(tokens_per_day=100000)], parallel=1, pool_timeout_s=1.0
    )
    assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), bearer())).status == 200
    other = _lock(db)
    loop = asyncio.get_running_loop()

    async def one(i: int):
        t0 = loop.time()
        resp = await httpc.fetch(
            app.port, "POST", CHAT, httpc.chat(2), {**bearer(), "X-Request-Id": f"locked{i}"}
        )
        return resp.status, loop.time() - t0

    try:
        got = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), 20)
    finally:
        other.execute("ROLLBACK")
        other.close()
    # served, none refused for the slot their neighbours held while waiting on the database
    assert [status for status, _ in got] == [200] * 3
    # each waited for its admission at most the bound (before: the 5 s busy wait, per request)
    assert max(elapsed for _, elapsed in got) < ADMIT_WAIT_S + 1.0, got
    lines = app.log.of("admission_not_durable")
    assert sorted(line["request_id"] for line in lines) == ["locked0", "locked1", "locked2"]
    app.store.flush()
    rows = app.store.query("SELECT request_id, status, key_id FROM request ORDER BY ts")
    assert sorted((r["request_id"], r["status"]) for r in rows[1:]) == [
        (f"locked{i}", 200) for i in range(3)
    ]
    assert len(rows) == 4 and {r["key_id"] for r in rows} == {"alpha"}
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT COUNT(*) FROM admission").fetchone() == (0,)
    conn.close()


async def test_the_writer_serves_admissions_while_a_row_batch_backs_off(tmp_path):
    db = str(tmp_path / "relay.db")
    store = Store(db, flush_interval_s=0.05)
    store.retry_max_s = 2.0
    store.start()
    other = _lock(db)
    try:
        store.put({"ts": 1e9, "request_id": "row"})
        store._wake.set()
        await wait_for(lambda: store.write_errors >= 1)  # the batch is retrying, rows kept
        rec = Record(
            ts=time.time(), request_id="adm", path=CHAT, key_id="k", upstream_requested="llm"
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await asyncio.wait_for(store.admit(store.next_admission_id(), rec, 1, 10), 10)
            raise AssertionError("an admission committed into a locked database")
        except RuntimeError as exc:
            assert "database is locked" in str(exc)
        # told promptly (its own short busy wait), not after the batch's busy wait and backoff
        assert loop.time() - t0 < 1.0
    finally:
        other.execute("ROLLBACK")
        other.close()
    aid = store.next_admission_id()
    await asyncio.wait_for(store.admit(aid, rec, 1, 10), 5)
    store.flush()
    assert store.rows_written == 1 and store.rows_dropped == 0
    store.close()
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT id, request_id FROM admission").fetchall() == [(aid, "adm")]
    assert conn.execute("SELECT request_id FROM request").fetchall() == [("row",)]
    conn.close()

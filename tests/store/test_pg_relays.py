"""Three relay processes on one real PostgreSQL (tests/support/pg_server.py): the budget is exact
across them, a dead relay's lease expires into a charged row, rows are written once."""

import asyncio
import collections
import json
import signal

from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.helpers import wait_for
from tests.support.pg_relays import CHAT, Relay, chat, config, headers
from tests.support.pg_server import PASSWORD
from tests.support.processes import start

LIMIT = 10


async def _rows(pg, db: str, timeout: float = 15.0, want: int | None = None) -> list[tuple]:
    """(request_id, status, error_code, upstream_served) of every row, once `want` are in."""
    got: list = []

    def enough() -> bool:
        got[:] = pg.query(
            db, "SELECT request_id, status, error_code, upstream_served, row_id FROM request"
        )
        return want is None or len(got) >= want

    await wait_for(enough, timeout, step=0.05)
    return got


async def _relays(tmp_path, pg, sim, n: int, **kw) -> tuple[str, list[Relay]]:
    db = pg.create_db()
    relays = [Relay(config(tmp_path, f"r{i}", sim.port, pg.url(db), **kw)) for i in range(n)]
    await asyncio.gather(*(r.start() for r in relays))  # they create the schema together
    return db, relays


async def _stop_all(relays) -> None:
    for r in relays:
        if r.proc is not None and r.proc.returncode is None:
            await r.stop()


async def test_three_relays_admit_exactly_the_limit_of_300_and_write_300_rows(tmp_path, pg_server):
    sim = Simulator()
    await sim.start()
    db, relays = await _relays(tmp_path, pg_server, sim, 3, limit=LIMIT)
    try:
        statuses = await asyncio.gather(
            *(chat(relays[i % 3].port, f"burst{i}") for i in range(300))
        )
        count = collections.Counter(statuses)
        assert count == {200: LIMIT, 429: 300 - LIMIT}, count
        rows = await _rows(pg_server, db, want=300)
        assert len(rows) == 300 and len({r[0] for r in rows}) == 300
        assert sum(1 for r in rows if r[3] is not None) == LIMIT
        assert sum(1 for r in rows if r[2] == "budget_exceeded") == 300 - LIMIT
        assert pg_server.query(db, "SELECT count(*) FROM reservation") == [(0,)]
        # relay report reads the shared table (the password from libpq's PGPASSWORD)
        proc = await start(
            "report",
            "--db",
            pg_server.url(db),
            "--since",
            "all",
            "--json",
            env={"PGPASSWORD": PASSWORD},
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err
        total = json.loads(out)["total"]
        assert (total["requests"], total["ok"]) == (300, LIMIT), total
        proc = await start(
            "report",
            "--db",
            pg_server.url(db),
            "--bench",
            "--by",
            "key",
            "--since",
            "1h",
            "--json",
            env={"PGPASSWORD": PASSWORD},
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err
        [group] = json.loads(out)["groups"]
        assert (group["group"], group["requests"]) == ("alpha", 300), group
        # each relay answered its hundred: the limit held across them, not inside each
        admitted = [sum(e["status"] == 200 for e in r.events("access")) for r in relays]
        assert [len(r.events("access")) for r in relays] == [100] * 3 and sum(admitted) == LIMIT
        print("admitted per relay", admitted)
    finally:
        await _stop_all(relays)
        await sim.stop()
    assert not any(r.password_leaked() for r in relays)


async def test_kill_9_mid_stream_its_lease_expires_into_a_charged_row_budget_exact(
    tmp_path, pg_server
):
    sim = Simulator()
    await sim.start()
    db, relays = await _relays(tmp_path, pg_server, sim, 3, limit=LIMIT, ttl=0.6)
    a, b, c = relays
    reader, writer = await asyncio.open_connection("127.0.0.1", a.port)
    try:
        writer.write(
            httpc.build_request("POST", CHAT, httpc.chat(100000, interval_ms=50), headers("killed"))
        )
        assert (await asyncio.wait_for(httpc.read_head(reader), 10)).status == 200
        [(lease, relay_id)] = pg_server.query(db, "SELECT id, relay_id FROM reservation")
        await a.stop(signal.SIGKILL)  # mid-stream: no settlement, no row, no renewal
        # while the lease is live it holds its request: the others admit LIMIT - 1
        statuses = await asyncio.gather(*(chat((b, c)[i % 2].port, f"after{i}") for i in range(20)))
        assert collections.Counter(statuses) == {200: LIMIT - 1, 429: 20 - LIMIT + 1}
        # a live relay's lease is renewed, a dead one's expires: into a relay_crashed row
        await wait_for(
            lambda: pg_server.query(db, "SELECT count(*) FROM reservation") == [(0,)], 10, step=0.05
        )
        crashed = pg_server.query(
            db,
            "SELECT request_id, row_id, tokens_source FROM request"
            " WHERE error_code = 'relay_crashed'",
        )
        assert crashed == [("killed", lease, "reserved")] and lease.startswith(relay_id)
        # the budget is exact: the cut request is charged, nothing more is admitted
        statuses = await asyncio.gather(*(chat((b, c)[i % 2].port, f"late{i}") for i in range(5)))
        assert statuses == [429] * 5
        rows = await _rows(pg_server, db, want=26)
        charged = [r for r in rows if r[3] is not None or r[2] == "relay_crashed"]
        assert len(rows) == 26 and len(charged) == LIMIT
    finally:
        writer.close()
        await _stop_all(relays)
        await sim.stop()


async def test_a_long_stream_keeps_its_lease_past_the_ttl(tmp_path, pg_server):
    sim = Simulator()
    await sim.start()
    db, relays = await _relays(tmp_path, pg_server, sim, 2, limit=2, ttl=0.3)
    a, b = relays
    try:
        # 40 tokens 50 ms apart: a stream of 2 s, several lease times
        stream = asyncio.create_task(
            httpc.fetch(a.port, "POST", CHAT, httpc.chat(40, interval_ms=50), headers("long"))
        )
        await wait_for(
            lambda: pg_server.query(db, "SELECT count(*) FROM reservation") == [(1,)], 10, step=0.02
        )
        checks = 0
        while not stream.done():  # an expired lease would show as a relay_crashed row
            assert pg_server.query(
                db, "SELECT count(*) FROM request WHERE error_code = 'relay_crashed'"
            ) == [(0,)]
            checks += 1
            await asyncio.sleep(0.05)
        resp = stream.result()
        assert resp.status == 200 and resp.complete and checks > 10
        assert [await chat(b.port, "second"), await chat(b.port, "third")] == [200, 429]
        rows = await _rows(pg_server, db, want=3)
        assert sorted(r[0] for r in rows) == ["long", "second", "third"]
    finally:
        await _stop_all(relays)
        await sim.stop()

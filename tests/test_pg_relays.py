"""Three relay processes on one real PostgreSQL (tests/pg_server.py): the budget is exact
across them, a dead relay's lease expires into a charged row, rows are written once."""

import asyncio
import collections
import signal

from relay.sim import Simulator
from tests import httpc
from tests.conftest import wait_for
from tests.pg_relays import CHAT, Relay, chat, config, headers

LIMIT = 10


async def _rows(pg, db: str, timeout: float = 15.0, want: int | None = None) -> list[tuple]:
    """(request_id, status, error_code, upstream_served) of every row, once `want` are in."""
    got: list = []

    def enough() -> bool:
        got[:] = pg.query(db, "SELECT request_id, status, error_code, upstream_served,"
                              " row_id FROM request")
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


async def test_three_relays_admit_exactly_the_limit_of_300_and_write_300_rows(tmp_path,
                                                                               pg_server):
    sim = Simulator()
    await sim.start()
    db, relays = await _relays(tmp_path, pg_server, sim, 3, limit=LIMIT)
    try:
        statuses = await asyncio.gather(*(
            chat(relays[i % 3].port, f"burst{i}") for i in range(300)))
        count = collections.Counter(statuses)
        assert count == {200: LIMIT, 429: 300 - LIMIT}, count
        rows = await _rows(pg_server, db, want=300)
        assert len(rows) == 300 and len({r[0] for r in rows}) == 300
        assert sum(1 for r in rows if r[3] is not None) == LIMIT
        assert sum(1 for r in rows if r[2] == "budget_exceeded") == 300 - LIMIT
        assert pg_server.query(db, "SELECT count(*) FROM reservation") == [(0,)]
        # every relay answered some: the limit held across them, not inside one
        assert all(any(e.get("status") == 200 or e.get("status") == 429
                       for e in r.events("access")) for r in relays)
    finally:
        await _stop_all(relays)
        await sim.stop()
    assert not any(r.password_leaked() for r in relays)

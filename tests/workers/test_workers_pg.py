"""Two relays of two workers each on one real PostgreSQL: the budget is exact across the four
processes that serve, rows are written once, by each relay's parent."""

import asyncio
import collections
from pathlib import Path

from relay.sim.server import Simulator
from tests.support.helpers import wait_for
from tests.support.pg_relays import Relay, chat, config

LIMIT = 10


async def test_two_relays_of_two_workers_admit_exactly_the_limit(tmp_path, pg_server):
    sim = Simulator()
    await sim.start()
    db = pg_server.create_db()
    relays = []
    for i in range(2):
        path = Path(config(tmp_path, f"r{i}", sim.port, pg_server.url(db), limit=LIMIT))
        path.write_text(path.read_text().replace("port = 0\n", "port = 0\nworkers = 2\n", 1))
        relays.append(Relay(str(path)))
    try:
        await asyncio.gather(*(r.start() for r in relays))
        statuses = await asyncio.gather(
            *(chat(relays[i % 2].port, f"burst{i}") for i in range(200))
        )
        assert collections.Counter(statuses) == {200: LIMIT, 429: 200 - LIMIT}
        rows: list = []

        def all_in() -> bool:
            rows[:] = pg_server.query(db, "SELECT request_id, status FROM request")
            return len(rows) >= 200

        await wait_for(all_in, 15, step=0.05)
        assert len(rows) == 200 and len({r[0] for r in rows}) == 200
        assert sum(1 for r in rows if r[1] == 200) == LIMIT
        assert pg_server.query(db, "SELECT count(*) FROM reservation") == [(0,)]
        assert [await r.stop() for r in relays] == [0, 0]
    finally:
        for r in relays:
            if r.proc is not None and r.proc.returncode is None:
                await r.stop()
        await sim.stop()

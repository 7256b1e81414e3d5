"""PostgreSQL goes away under load: relays keep relaying (keyed requests on their local
budget view), rows wait in the spill file and land once when the server is back; a relay
stopped with a non-empty spill replays it at its next start, once."""

import asyncio
import collections
import json
import os
import shutil
from pathlib import Path

from relay.sim.server import Simulator
from tests.support.helpers import wait_for
from tests.support.pg_relays import Relay, chat, config
from tests.support.pg_server import PASSWORD, PASSWORD_ENV
from tests.support.processes import start

OUTAGE_S = 5.0


async def _load(ports: list[int], stop: asyncio.Event, workers: int = 8) -> list[tuple]:
    """Keyed requests back to back from `workers` clients until `stop`: (rid, status)."""
    out: list[tuple] = []

    async def worker(w: int) -> None:
        i = 0
        while not stop.is_set():
            rid = f"w{w}-{i}"
            out.append((rid, await chat(ports[(w + i) % len(ports)], rid)))
            i += 1

    await asyncio.gather(*(worker(w) for w in range(workers)))
    return out


def _ids(pg, db: str) -> collections.Counter:
    return collections.Counter(r[0] for r in pg.query(db, "SELECT request_id FROM request"))


async def test_postgres_stopped_5s_under_load_fails_no_request_and_loses_no_row(
    tmp_path, pg_server
):
    sim = Simulator()
    await sim.start()
    db = pg_server.create_db()
    relays = [
        Relay(config(tmp_path, f"r{i}", sim.port, pg_server.url(db), limit=10**9, ttl=1.0))
        for i in range(2)
    ]
    await asyncio.gather(*(r.start() for r in relays))
    stop = asyncio.Event()
    load = asyncio.create_task(_load([r.port for r in relays], stop))
    try:
        await asyncio.sleep(1.0)
        await asyncio.to_thread(pg_server.stop)
        loop = asyncio.get_running_loop()
        back_at = loop.time() + OUTAGE_S
        # while it is down: rows pile up in the spill files, shown in /metrics
        spilled: dict = {}

        async def all_spilled() -> bool:
            for r in relays:
                spilled[r.port] = await r.metric("relay_rows_spilled")
            return all(spilled.values())

        while not await all_spilled():
            assert loop.time() < back_at, spilled
            await asyncio.sleep(0.05)
        assert all(os.path.getsize(r.cfg.replace(".toml", "-spill.jsonl")) for r in relays)
        await asyncio.sleep(back_at - loop.time())
        await asyncio.to_thread(pg_server.start)
        await asyncio.sleep(1.5)
        stop.set()
        results = await asyncio.wait_for(load, 30)
        statuses = collections.Counter(s for _, s in results)
        assert statuses == {200: len(results)}, statuses  # none failed because of it
        want = {rid for rid, _ in results}
        await wait_for(lambda: sum(_ids(pg_server, db).values()) >= len(want), 15, step=0.1)
        ids = _ids(pg_server, db)
        assert set(ids) == want and set(ids.values()) == {1}  # every row, once
        for r in relays:  # the spill was replayed and emptied
            await wait_for(
                lambda r=r: os.path.getsize(r.cfg.replace(".toml", "-spill.jsonl")) == 0,
                5,
                step=0.05,
            )
            assert r.events("spill_replayed")
            assert await r.metric("relay_rows_spilled") == 0
    finally:
        stop.set()
        if not load.done():
            await asyncio.wait_for(load, 30)
        for r in relays:
            await r.stop()
        await sim.stop()


async def test_a_relay_stopped_with_a_spill_replays_it_once_at_its_next_start(tmp_path, pg_server):
    sim = Simulator()
    await sim.start()
    db = pg_server.create_db()
    cfg = config(tmp_path, "r", sim.port, pg_server.url(db), limit=3)
    spill = cfg.replace(".toml", "-spill.jsonl")
    relay = await Relay(cfg).start()
    try:
        await asyncio.to_thread(pg_server.stop)
        # down at once: keyed requests run on the local view (limit 3 still holds)
        assert [await chat(relay.port, f"down{i}") for i in range(5)] == [200] * 3 + [429] * 2
        assert await relay.stop() == 0  # SIGTERM: what is queued goes to the spill
        assert len(Path(spill).read_bytes().splitlines()) == 5
        shutil.copy(spill, spill + ".copy")
    finally:
        await asyncio.to_thread(pg_server.start)
    try:
        relay = await Relay(cfg).start()  # replays before it serves
        assert relay.events("spill_replayed")[0]["rows"] == 5 and os.path.getsize(spill) == 0
        ids = _ids(pg_server, db)
        assert ids == {f"down{i}": 1 for i in range(5)}
        # the budget counts what was served meanwhile: the key is spent
        assert await chat(relay.port, "after") == 429
        await relay.stop()
        # a crash between the commit and emptying the spill: the same rows again, still once
        shutil.copy(spill + ".copy", spill)
        relay = await Relay(cfg).start()
        assert relay.events("spill_replayed")[0]["rows"] == 5
        await relay.stop()
        ids = _ids(pg_server, db)
        assert ids == {**{f"down{i}": 1 for i in range(5)}, "after": 1}
    finally:
        if relay.proc.returncode is None:
            await relay.stop()
        await sim.stop()


async def test_a_relay_does_not_start_without_its_server_and_says_why(tmp_path, pg_server):
    db = pg_server.create_db()
    with open(config(tmp_path, "w", 9, pg_server.url(db))) as fh:
        text = fh.read()
    wrong = tmp_path / "wrong.toml"  # the right server, the wrong password
    wrong.write_text(text.replace(PASSWORD_ENV, "RELAY_TEST_WRONG_PW"))
    closed = config(tmp_path, "c", 9, "postgresql://relay@127.0.0.1:1/x")  # nothing there
    for cfg, env, why in (
        (str(wrong), {"RELAY_TEST_WRONG_PW": "not-it"}, "password"),
        (closed, {}, "127.0.0.1"),
    ):
        proc = await start("serve", "--config", cfg, env=env)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 2
        [line] = [json.loads(x) for x in err.splitlines() if b'"relay_start_failed"' in x]
        assert line["error"].startswith("store.url: ") and why in line["error"], line
        assert PASSWORD.encode() not in err and b"not-it" not in err

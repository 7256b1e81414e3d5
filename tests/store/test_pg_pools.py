"""Two relay processes on one real PostgreSQL (tests/support/pg_server.py) in front of the
same pool of two simulators (issue 32): they share rows, never their prefix tables, and still
send each new conversation to one member, by rendezvous hashing of its first messages, so a
turn sent to the relay that never saw the conversation lands where the others did."""

from __future__ import annotations

import asyncio

import pytest

from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.helpers import wait_for
from tests.support.pg_relays import Relay
from tests.support.pg_server import PASSWORD_ENV
from tests.support.pools import MODEL, Conversation, landed

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path, name: str, ports: list[int], url: str) -> str:
    cfg = tmp_path / f"{name}.toml"
    text = (
        f"[server]\nport = 0\n"
        f'[store]\nurl = "{url}"\npassword_env = "{PASSWORD_ENV}"\n'
        f'spill_path = "{tmp_path / (name + "-spill.jsonl")}"\n'
    )
    for i, port in enumerate(ports):
        text += (
            f'[[upstream]]\nname = "m{i}"\nurl = "http://127.0.0.1:{port}"\n'
            f'models = ["{MODEL}"]\nparallel = 4\n'
        )
    cfg.write_text(text)
    return str(cfg)


async def test_two_relays_send_each_new_conversation_to_one_member(tmp_path, pg_server):
    sims = {f"m{i}": Simulator() for i in range(2)}
    for s in sims.values():
        await s.start()
    db = pg_server.create_db()
    ports = [s.port for s in sims.values()]
    relays = [Relay(_config(tmp_path, f"r{i}", ports, pg_server.url(db))) for i in range(2)]
    try:
        await asyncio.gather(*(r.start() for r in relays))
        # Sent one at a time: the pool is idle for each turn. Each conversation's turns go to
        # both relays in turn, its first to either.
        names = [f"pg-{i}" for i in range(10)]
        home: dict[str, str] = {}
        sent: list[tuple[str, str]] = []
        for i, name in enumerate(names):
            conv = Conversation("chat", name)
            for turn in range(3):
                relay = relays[(i + turn) % 2]
                rid = f"{name}-{turn}"
                resp = await httpc.fetch(
                    relay.port, "POST", conv.path, conv.body(tokens=2), {"X-Request-Id": rid}
                )
                assert resp.status == 200 and resp.complete
                [member] = landed(sims, rid)
                assert home.setdefault(name, member) == member, (name, turn)
                sent.append((rid, member))
                conv.follow(httpc.sim_text(2))
        # New conversations spread over the pool (a shared system prompt pulls none anywhere).
        assert set(home.values()) == {"m0", "m1"}
        # The shared rows say the same: each from its pool, served where the simulator saw it.
        rows: list = []

        def all_in() -> bool:
            rows[:] = pg_server.query(db, "SELECT request_id, upstream_served, pool FROM request")
            return len(rows) >= len(sent)

        await wait_for(all_in, 30, step=0.05)
        assert sorted(rows) == sorted((rid, member, MODEL) for rid, member in sent)
        # Both relays served some of them.
        assert [len(r.events("access")) for r in relays] == [15, 15]
        assert [await r.stop() for r in relays] == [0, 0]
    finally:
        for r in relays:
            if r.proc is not None and r.proc.returncode is None:
                await r.stop()
        for s in sims.values():
            await s.stop()

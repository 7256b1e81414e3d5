"""Two relay processes on one real PostgreSQL (issue 33 item 1): the limits that act now are
each relay's own, the day's budget stays shared and exact.

`max_concurrent` and the per-minute limits are counted in the memory of the process that admits
(the relay, or with workers its parent): each relay admits up to the limit, so two relays
admit twice `max_concurrent` at once in all (docs/fairness.md says so). The day and month
windows are the database's: two relays admit exactly `requests_per_day` in all.
"""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.helpers import wait_for
from tests.support.keys import sha
from tests.support.pg_relays import CHAT, Relay, config

CONC, DAY = 3, 10
SECRETS = {"conc": "sk-conc-0123456789-secret", "day": "sk-day-0123456789-secret"}
WAIT_S = 60.0
# Admitted requests stay in the upstream (no first token for a minute) until the test hangs up.
HELD = {"tokens": 4, "first_token_delay_ms": 60_000}


def body(sim: dict | None = None, stream: bool = True) -> dict:
    out = {
        "model": "tiny",
        "stream": stream,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi there"}],
    }
    if sim:
        out["sim"] = sim
    return out


async def ask(port: int, kid: str, rid: str, payload: dict):
    headers = {"Authorization": f"Bearer {SECRETS[kid]}", "X-Request-Id": rid}
    return await httpc.fetch(port, "POST", CHAT, payload, headers, timeout=WAIT_S)


def chats(sim) -> int:
    return len([r for r in sim.requests if r.path == CHAT])


async def test_limits_that_act_now_are_each_relays_and_the_day_is_shared(tmp_path, pg_server):
    sim = Simulator()
    await sim.start()
    db = pg_server.create_db()
    relays = []
    for i in range(2):
        cfg = tmp_path / f"r{i}.toml"
        # Key alpha of the shared config without limits, and the two of this test.
        text = Path(config(tmp_path, f"r{i}", sim.port, pg_server.url(db), limit=0)).read_text()
        text += (
            f'[[key]]\nid = "conc"\nsha256 = "{sha(SECRETS["conc"])}"\nmax_concurrent = {CONC}\n'
            f'[[key]]\nid = "day"\nsha256 = "{sha(SECRETS["day"])}"\nrequests_per_day = {DAY}\n'
        )
        cfg.write_text(text)
        relays.append(Relay(str(cfg)))
    held: list[asyncio.Task] = []
    try:
        await asyncio.gather(*(r.start() for r in relays))
        # 40 at once on each relay, the admitted ones held upstream: each admits CONC.
        held = [
            asyncio.create_task(ask(relays[i % 2].port, "conc", f"conc{i}", body(HELD)))
            for i in range(80)
        ]

        def decided() -> bool:
            return sum(t.done() for t in held) + chats(sim) >= 80

        await wait_for(decided, WAIT_S, step=0.02)
        refused = [t.result() for t in held if t.done()]
        assert {(r.status, r.json()["error"]["code"]) for r in refused} == {
            (429, "concurrency_exceeded")
        }
        assert len(refused) == 80 - 2 * CONC and chats(sim) == 2 * CONC
        # CONC admitted by each relay (request i went to relay i % 2): its own count.
        admitted = collections.Counter(i % 2 for i, t in enumerate(held) if not t.done())
        assert admitted == {0: CONC, 1: CONC}
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        # The day's budget across both relays: exactly DAY of 100.
        plain = body({"tokens": 2}, stream=False)
        answers = await asyncio.gather(
            *(ask(relays[i % 2].port, "day", f"day{i}", plain) for i in range(100))
        )
        assert collections.Counter(r.status for r in answers) == {200: DAY, 429: 100 - DAY}
        rows: list = []

        def all_in() -> bool:
            rows[:] = pg_server.query(db, "SELECT key_id, error_code FROM request")
            return len(rows) >= 180

        await wait_for(all_in, WAIT_S, step=0.05)
        assert [await r.stop() for r in relays] == [0, 0]
    finally:
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        for r in relays:
            if r.proc is not None and r.proc.returncode is None:
                await r.stop()
        await sim.stop()
    by = collections.Counter(rows)
    assert by[("conc", "concurrency_exceeded")] == 80 - 2 * CONC
    assert sum(n for (k, code), n in by.items() if k == "conc") == 80
    assert sum(1 for r in rows if r[0] == "day" and r[1] == "budget_exceeded") == 100 - DAY

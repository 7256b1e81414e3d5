"""The 429 of a budget PostgreSQL refuses, over sockets (tests/support/pg_server.py): it says
what the window used and what the request would have reserved, as the local refusal does."""

import json

from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.helpers import wait_for
from tests.support.pg_relays import CHAT, Relay, config, headers

LIMIT = 100


async def test_the_shared_refusal_names_the_used_and_the_requested_tokens(tmp_path, pg_server):
    sim = Simulator()
    await sim.start()
    db = pg_server.create_db()
    # The local views are seeded from the shared usage at start, then every third of the
    # lease time: 3000 s here, so the second relay's view never learns of the first's row and
    # only PostgreSQL can refuse.
    relays = [
        await Relay(
            config(tmp_path, f"r{i}", sim.port, pg_server.url(db), limit=0, tokens=LIMIT, ttl=3000)
        ).start()
        for i in range(2)
    ]
    try:
        first = await httpc.fetch(
            relays[0].port, "POST", CHAT, httpc.chat(2, stream=False), headers("first")
        )
        assert first.status == 200

        def charged() -> list:
            return pg_server.query(
                db, "SELECT prompt_tokens + completion_tokens FROM request WHERE key_id = 'alpha'"
            )

        await wait_for(charged, 15, step=0.05)
        [(used,)] = charged()
        # A request whose estimate (body bytes / 4 + its max_tokens) fits an empty window, and
        # so the second relay's own view, but not beside what the first one used.
        completion = LIMIT
        for _ in range(3):
            body = httpc.chat(completion, stream=False)
            completion = LIMIT - len(json.dumps(body).encode()) // 4
        body = httpc.chat(completion, stream=False)
        requested = len(json.dumps(body).encode()) // 4 + completion
        assert requested <= LIMIT < used + requested
        late = await httpc.fetch(relays[1].port, "POST", CHAT, body, headers("late"))
        assert late.status == 429
        err = late.json()["error"]
        assert err["code"] == "budget_exceeded"
        assert err["message"] == (
            f"daily_tokens budget exceeded: {used} used + {requested} requested > {LIMIT}"
        )
        details = {k: v for k, v in err["details"].items() if k != "resets_at"}
        assert details == {
            "limit": "daily_tokens",
            "used": used,
            "requested": requested,
            "limit_value": LIMIT,
        }
        assert len([r for r in sim.requests if r.path == CHAT]) == 1
    finally:
        for r in relays:
            await r.stop()
        await sim.stop()

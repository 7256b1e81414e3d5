"""`GET /health` and the readiness view with `relay serve --workers 2`: every worker answers
the health check from what its parent told it of each upstream (no key, never charged), and
the parent answers `/api/upstreams` for the whole relay, as it answers the other views."""

from __future__ import annotations

import asyncio
import functools

import pytest

from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.keys import SECRET
from tests.support.processes import kill
from tests.workers.test_workers import CHAT, _figure, _serve, _until

pytestmark = pytest.mark.timeout(120)
OK = b'{"status":"ok"}'
# Enough requests, each on its own connection, for both workers to answer some.
TRIES = 16


async def _healths(port: int, headers=None) -> list:
    return await asyncio.gather(
        *(httpc.fetch(port, "GET", "/health", headers=headers) for _ in range(TRIES))
    )


async def _answers(port: int) -> set[tuple[int, bytes]]:
    return {(r.status, r.body) for r in await _healths(port)}


async def test_every_worker_answers_health_and_the_parent_the_readiness_view(tmp_path):
    sim = Simulator()
    await sim.start()
    proc, port, _, _, _, _ = await _serve(tmp_path, 2, sim.port, key_limit=3)
    bearer = {"Authorization": f"Bearer {SECRET}"}
    try:
        # every worker told of the first probe (the parent tells them as it takes it)
        await _until(lambda: _answers(port), lambda got: got == {(200, OK)}, "ready")
        # the readiness view: the parent's slots, whichever worker is asked
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(httpc.build_request("POST", CHAT, httpc.chat(400, interval_ms=20), bearer))
        try:
            assert (await asyncio.wait_for(httpc.read_head(reader), 30)).status == 200
            views = await asyncio.gather(
                *(httpc.fetch(port, "GET", "/api/upstreams") for _ in range(TRIES))
            )
        finally:
            writer.close()
        assert {v.status for v in views} == {200}  # a loopback peer: keys, no admin key
        docs = [v.json() for v in views]
        assert {(d["ready"], d["reason"], d["probing"]) for d in docs} == {(True, "ok", True)}
        assert {
            (u["name"], u["url"], u["state"], u["parallel"], u["in_flight"])
            for d in docs
            for u in d["upstreams"]
        } == {("llm", sim.url, "serving", 8, 1)}
        far = await httpc.fetch(port, "GET", "/api/upstreams", headers={"Host": "evil.example"})
        assert far.status == 403  # the admin rule: a Host not naming the relay
        # a key with limits (3 a day, 1 used): the probes charge it nothing
        assert {(r.status, r.body) for r in await _healths(port, bearer)} == {(200, OK)}
        for status in (200, 200, 429):
            assert (await httpc.fetch(port, "POST", CHAT, httpc.chat(2), bearer)).status == status
        assert {(r.status, r.body) for r in await _healths(port, bearer)} == {(200, OK)}
        # the upstream goes away: every worker is told, and says so
        await sim.stop()
        down = functools.partial(_figure, port, "relay_upstream_up", upstream="llm")
        await _until(down, lambda n: n == 0, "relay_upstream_up")
        unavailable = b'{"error":{"message":"no upstream is reachable","type":"unavailable_error","code":503}}'
        await _until(lambda: _answers(port), lambda got: got == {(503, unavailable)}, "down")
    finally:
        await kill(proc)
        await sim.stop()

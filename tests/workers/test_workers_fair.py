"""Per-key limits and fair turns with `relay serve --workers 2` (issue 33 items 1, 6, 7), real
processes over real sockets: the parent admits every keyed request and holds the one queue, so
what one process does the two workers do together.

- Exactness under 300 concurrent requests, whatever worker each lands on: `max_concurrent`
  k admits k (the admitted ones held in the upstream until all 300 were answered),
  `requests_per_minute` k admits k, `tokens_per_minute` T admits as many as T holds of their
  reservations (docs/budgets.md: body bytes / 4 + the completion limit); every other one is
  a 429 with its code and a row. The counts come from what the test sent and got.
- Fair turns: a key flooding 200 requests does not hold back another key's requests sent one
  by one: each waits at most one service time of the flood's (as tests/proxy/
  test_fair_share.py shows in one process); `relay_key_queued` and `relay_key_in_flight`,
  and the operator page's key table, are the parent's figures.
"""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import sqlite3
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from relay.sim.server import Simulator
from tests.app.test_signals import Tail
from tests.support import httpc
from tests.support.keys import sha
from tests.support.processes import kill, start, wait_listening

CHAT = "/v1/chat/completions"
pytestmark = pytest.mark.timeout(300)
WAIT_S = 120.0
SECRETS = {n: f"sk-{n}-0123456789-secret" for n in ("conc", "rpm", "tpm", "a", "b", "z")}
# A stream of 8 tokens 25 ms apart: about 200 ms a slot is held.
SERVICE = {"tokens": 8, "interval_ms": 25}
# Admitted requests that stay in the upstream (no first token for a minute) until the test
# hangs up on them: nothing settles while the others are decided.
HELD = {"tokens": 4, "first_token_delay_ms": 60_000}
ENDLESS = {"tokens": 4000, "interval_ms": 50}


async def until(read, ok, what: str, timeout: float = WAIT_S):
    """`await read()` once `ok` holds of it (else fail, naming `what` and the last value)."""
    deadline = time.monotonic() + timeout
    while not ok(value := await read()):
        assert time.monotonic() < deadline, f"{what}: {value!r} after {timeout} s"
        await asyncio.sleep(0.02)
    return value


def config(
    path, db: str, sim_port: int, parallel: int, keys: dict[str, str], wait_s: float = 300
) -> None:
    """A relay with an upstream of `parallel` slots, a slot wait of `wait_s` at most, and the
    keys given (id -> TOML lines)."""
    text = (
        f'[server]\nport = 0\ndrain_timeout_s = 5\n[store]\npath = "{db}"\n'
        f"[dispatcher]\npool_timeout_s = {wait_s}\nhealth_interval_s = 0\n"
        f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{sim_port}"\n'
        f"parallel = {parallel}\nqueue = 1000\n"
    )
    for kid, lines in keys.items():
        text += f'[[key]]\nid = "{kid}"\nsha256 = "{sha(SECRETS[kid])}"\n{lines}\n'
    path.write_text(text)


class Workers:
    """`relay serve --workers 2` on a config, its log read as it comes."""

    def __init__(
        self, tmp_path, sim_port: int, parallel: int, keys: dict[str, str], wait_s: float = 300
    ) -> None:
        self.db = str(tmp_path / "relay.db")
        self.path = tmp_path / "relay.toml"
        config(self.path, self.db, sim_port, parallel, keys, wait_s)
        self.proc = None
        self.port = 0

    async def __aenter__(self) -> Workers:
        self.proc = await start("serve", "--config", str(self.path), "--workers", "2")
        self.port, seen = await wait_listening(self.proc)
        assert len(next(r["pids"] for r in seen if r["event"] == "workers_serving")) == 2
        self.tail = Tail(self.proc)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 60)
            finally:
                await kill(self.proc)

    def rows(self, where: str = "", params=()) -> list[dict]:
        conn = sqlite3.connect(self.db)
        conn.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in conn.execute(f"SELECT * FROM request {where}", params)]
        finally:
            conn.close()

    async def rows_in(self, n: int, where: str = "", params=()) -> list[dict]:
        """The rows once `n` of them are written (the parent writes in batches)."""

        async def read() -> list[dict]:
            return self.rows(where, params)

        return await until(read, lambda r: len(r) >= n, f"{n} rows")

    async def gauges(self) -> dict[tuple[str, str], float]:
        resp = await httpc.fetch(self.port, "GET", "/metrics")
        assert resp.status == 200
        out = {}
        for fam in text_string_to_metric_families(resp.body.decode()):
            for s in fam.samples:
                if s.name in ("relay_key_in_flight", "relay_key_queued"):
                    out[(s.name, s.labels["key"])] = s.value
                elif s.name == "relay_queue_waiting":
                    out[(s.name, s.labels["upstream"])] = s.value
        return out


def body(who: str, sim: dict, max_tokens: int | None = None, stream: bool = True) -> dict:
    return {
        "model": "tiny",
        "stream": stream,
        "max_tokens": max_tokens or sim["tokens"],
        "messages": [{"role": "user", "content": f"from {who}"}],
        "sim": sim,
    }


def headers(kid: str, rid: str) -> dict:
    return {"Authorization": f"Bearer {SECRETS[kid]}", "X-Request-Id": rid}


def started(sim) -> list[str]:
    return [
        r.json["messages"][0]["content"].removeprefix("from ")
        for r in sim.requests
        if r.path == CHAT and r.json is not None
    ]


async def cancel(tasks) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ---- exact under 300 concurrent requests ----------------------------------------------------
async def burst(relay: Workers, sim, kid: str, payload: dict, held: bool):
    """300 requests of `kid` at once. Returns the answers received and the tasks still
    waiting (requests admitted and held upstream, when `held`), once every one was answered
    or reached the simulator."""
    before = started(sim).count(kid)
    tasks = [
        asyncio.create_task(
            httpc.fetch(
                relay.port, "POST", CHAT, payload, headers(kid, f"{kid}{i}"), timeout=WAIT_S
            )
        )
        for i in range(300)
    ]

    async def decided():
        return sum(t.done() for t in tasks) + (started(sim).count(kid) - before if held else 0)

    await until(decided, lambda n: n >= 300, f"{kid}: answered or upstream")
    done = [t.result() for t in tasks if t.done()]
    return done, [t for t in tasks if not t.done()]


def codes(answers) -> collections.Counter:
    return collections.Counter(
        (r.status, r.json()["error"]["code"] if r.status != 200 else None) for r in answers
    )


async def test_limits_that_act_now_admit_exactly_k_of_300_across_workers(tmp_path):
    sim = Simulator()
    await sim.start()
    conc, rpm, tpm = 7, 23, 1000
    held_body = body("tpm", HELD, max_tokens=100)
    # Each admitted request holds its reservation until it settles: as many as fit.
    reserve = len(json.dumps(held_body).encode()) // 4 + 100
    fit = tpm // reserve
    keys = {
        "conc": f"max_concurrent = {conc}",
        "rpm": f"requests_per_minute = {rpm}",
        "tpm": f"tokens_per_minute = {tpm}",
    }
    try:
        async with Workers(tmp_path, sim.port, 64, keys) as relay:
            done, waiting = await burst(relay, sim, "conc", body("conc", HELD), held=True)
            assert codes(done) == {(429, "concurrency_exceeded"): 300 - conc}
            assert len(waiting) == conc and started(sim).count("conc") == conc
            await cancel(waiting)
            plain = body("rpm", {"tokens": 2}, stream=False)
            done, waiting = await burst(relay, sim, "rpm", plain, held=False)
            assert codes(done) == {(200, None): rpm, (429, "rate_limit_exceeded"): 300 - rpm}
            assert not waiting and started(sim).count("rpm") == rpm
            done, waiting = await burst(relay, sim, "tpm", held_body, held=True)
            assert codes(done) == {(429, "rate_limit_exceeded"): 300 - fit}
            assert len(waiting) == fit and started(sim).count("tpm") == fit
            for r in done:
                d = r.json()["error"]["details"]
                assert (d["limit"], d["used"], d["requested"]) == (
                    "minute_tokens",
                    fit * reserve,
                    reserve,
                )
            await cancel(waiting)
            rows = await relay.rows_in(900)
    finally:
        await sim.stop()
    by = collections.Counter((r["key_id"], r["error_code"]) for r in rows)
    assert by[("conc", "concurrency_exceeded")] == 300 - conc
    assert by[("rpm", "rate_limit_exceeded")] == 300 - rpm
    assert by[("rpm", None)] == rpm
    assert by[("tpm", "rate_limit_exceeded")] == 300 - fit
    # The refused reached no upstream and took no slot.
    for r in rows:
        if r["status"] == 429:
            assert (r["upstream_served"], r["queue_ms"]) == (None, None), r


# ---- fair turns, the parent's queue ---------------------------------------------------------
async def test_a_flood_does_not_hold_back_another_key_across_workers(tmp_path):
    sim = Simulator()
    await sim.start()
    writers = []
    tasks: list[asyncio.Task] = []
    try:
        async with Workers(tmp_path, sim.port, 2, {"a": "", "b": "", "z": ""}) as relay:

            async def ask(who: str, rid: str):
                resp = await httpc.fetch(
                    relay.port, "POST", CHAT, body(who, SERVICE), headers(who, rid), timeout=WAIT_S
                )
                assert resp.status == 200 and resp.complete, (rid, resp.status)
                return resp

            # One slot held by Z until A's first request is half-way through its stream: the
            # slots' turns then come half a service apart (tests/proxy/test_fair_share.py).
            _r, w = await asyncio.open_connection("127.0.0.1", relay.port)
            w.write(httpc.build_request("POST", CHAT, body("z", ENDLESS), headers("z", "z0")))
            writers.append(w)

            async def z_in():
                return started(sim).count("z")

            await until(z_in, lambda n: n == 1, "z's request upstream")
            tasks = [asyncio.create_task(ask("a", f"a{i}")) for i in range(200)]

            async def arrived():
                waiting = (await relay.gauges())[("relay_queue_waiting", "llm")]
                return waiting + started(sim).count("a")

            await until(arrived, lambda n: n >= 200, "A's flood in")

            async def half_way():
                return any(
                    not r.finished and r.tokens_sent >= SERVICE["tokens"] // 2
                    for r in sim.requests
                    if r.json is not None and r.json["messages"][0]["content"] == "from a"
                )

            await until(half_way, bool, "A's first half-way")
            w.close()
            for i in range(5):
                await ask("b", f"b{i}")
            gauges = await relay.gauges()
            page = (await httpc.fetch(relay.port, "GET", "/api/ui/state")).json()
            b_rows = await relay.rows_in(5, "WHERE key_id = 'b'")
            a_rows = [r for r in relay.rows("WHERE key_id = 'a'") if r["status"] == 200]
            await cancel(tasks)
    finally:
        for w in writers:
            w.close()
        await cancel(tasks)
        await sim.stop()
    assert len(a_rows) >= 5
    one_service = max(r["total_ms"] - r["queue_ms"] for r in a_rows)
    for r in b_rows:
        assert r["queue_position"] == 1, r
        assert 0 < r["queue_ms"] <= one_service, (r["request_id"], r["queue_ms"], one_service)
    assert started(sim).count("b") == 5 and started(sim).count("a") < 200
    # The parent's figures of each key: most of A's flood still waiting, B's all served.
    assert gauges[("relay_key_queued", "a")] >= 150, gauges
    assert 1 <= gauges[("relay_key_in_flight", "a")] <= 2, gauges
    assert gauges[("relay_key_queued", "b")] == gauges[("relay_key_in_flight", "b")] == 0
    # The operator page's key table, from the parent too.
    live = {k["key"]: (k["in_flight"], k["queued"]) for k in page["budgets"]}
    assert live["a"][1] >= 150 and 1 <= live["a"][0] <= 2 and live["b"] == (0, 0), live


async def test_a_request_that_waited_in_vain_has_its_place_in_its_row_across_workers(tmp_path):
    """The parent's 503 after a wait says where the request waited: its row's
    `queue_position`, as in one process."""
    sim = Simulator()
    await sim.start()
    writers = []
    try:
        async with Workers(tmp_path, sim.port, 1, {"a": "", "z": ""}, wait_s=0.5) as relay:
            _r, w = await asyncio.open_connection("127.0.0.1", relay.port)
            w.write(httpc.build_request("POST", CHAT, body("z", ENDLESS), headers("z", "z0")))
            writers.append(w)

            async def z_in():
                return started(sim).count("z")

            await until(z_in, lambda n: n == 1, "z's request upstream")
            resp = await httpc.fetch(
                relay.port, "POST", CHAT, body("a", SERVICE), headers("a", "late"), timeout=WAIT_S
            )
            assert resp.status == 503 and resp.json()["error"]["code"] == "upstream_busy"
            (row,) = await relay.rows_in(1, "WHERE request_id = 'late'")
            w.close()
    finally:
        for w in writers:
            w.close()
        await sim.stop()
    assert (row["status"], row["queue_position"]) == (503, 1), row
    assert started(sim) == ["z"]

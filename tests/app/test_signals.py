"""Signals on a real relay process: SIGHUP reloads the configuration file (keys, limits,
upstreams) while streams in flight finish on what they started with; a bad file is refused
and the running configuration stays; a second SIGTERM ends a drain at once, rows flushed."""

import asyncio
import json
import signal
import sqlite3

from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.keys import OTHER_SECRET, SECRET, sha
from tests.support.processes import kill, start, wait_listening

CHAT = "/v1/chat/completions"


class Tail:
    """Reads the relay's JSON log lines as they come (the pipe never fills)."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.lines: list[dict] = []
        self.changed = asyncio.Event()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while line := await self.proc.stderr.readline():
            if line.startswith(b"{"):
                self.lines.append(json.loads(line))
                self.changed.set()

    async def wait(self, event: str, after: int = 0, timeout: float = 10.0) -> dict:
        async def find():
            while True:
                for rec in self.lines[after:]:
                    if rec["event"] == event:
                        return rec
                self.changed.clear()
                await self.changed.wait()

        return await asyncio.wait_for(find(), timeout)


def _toml(
    path, store: str, upstream_port: int, keys: list[tuple[str, str, int]], extra: str = ""
) -> None:
    text = (
        f'[server]\nport = 0\ndrain_timeout_s = 30\n[store]\npath = "{store}"\n{extra}'
        f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{upstream_port}"\n'
        "parallel = 8\n"
    )
    for kid, secret, per_day in keys:
        text += f'[[key]]\nid = "{kid}"\nsha256 = "{sha(secret)}"\nrequests_per_day = {per_day}\n'
    path.write_text(text)


def chats(sim) -> list:
    return [r for r in sim.requests if r.path == CHAT]


def _auth(secret: str, rid: str | None = None) -> dict:
    h = {"Authorization": f"Bearer {secret}"}
    if rid:
        h["X-Request-Id"] = rid
    return h


def _rows(db: str) -> list[dict]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM request")]
    finally:
        conn.close()


async def test_sighup_reloads_keys_limits_and_upstreams(tmp_path):
    sim_a, sim_b = Simulator(), Simulator()
    await sim_a.start()
    await sim_b.start()
    cfg, db = tmp_path / "relay.toml", str(tmp_path / "relay.db")
    _toml(cfg, db, sim_a.port, [("alpha", SECRET, 100)])
    proc = await start("serve", "--config", str(cfg))
    try:
        port, _ = await wait_listening(proc)
        log = Tail(proc)
        assert (await httpc.fetch(port, "POST", CHAT, httpc.chat(2), _auth(SECRET))).status == 200
        assert (
            await httpc.fetch(port, "POST", CHAT, httpc.chat(2), _auth(OTHER_SECRET))
        ).status == 401
        # a stream in flight on upstream A when the file changes
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            httpc.build_request("POST", CHAT, httpc.chat(40, interval_ms=20), _auth(SECRET))
        )
        head = await asyncio.wait_for(httpc.read_head(reader), 10)
        reading = asyncio.create_task(httpc.read_body(reader, head))
        # new key beta, alpha down to 3 a day, the upstream moved to B
        _toml(cfg, db, sim_b.port, [("alpha", SECRET, 3), ("beta", OTHER_SECRET, 5)])
        mark = len(log.lines)
        proc.send_signal(signal.SIGHUP)
        rec = await log.wait("config_reloaded", mark)
        assert rec["changed"] == [{"upstream": "llm", "changed": ["url"]}] and rec["keys"] == 2
        a_before = len(chats(sim_a))
        resp = await httpc.fetch(port, "POST", CHAT, httpc.chat(3), _auth(OTHER_SECRET))
        assert resp.status == 200 and len(chats(sim_b)) == 1
        assert len(chats(sim_a)) == a_before  # new requests go to B
        # alpha used 1 and has 1 in flight: one more under the new limit of 3, then 429
        ok = await httpc.fetch(port, "POST", CHAT, httpc.chat(2), _auth(SECRET))
        refused = await httpc.fetch(port, "POST", CHAT, httpc.chat(2), _auth(SECRET))
        assert (ok.status, refused.status) == (200, 429)
        assert refused.json()["error"]["details"]["limit_value"] == 3
        # the stream that started on A finished there, byte-exact
        await asyncio.wait_for(reading, 10)
        writer.close()
        assert head.status == 200 and head.complete
        text = "".join(
            e["choices"][0]["delta"].get("content") or ""
            for e in head.data_events()
            if e != "[DONE]" and e["choices"]
        )
        assert text == httpc.sim_text(40) and head.data_events()[-1] == "[DONE]"
        assert chats(sim_a)[-1].finished

        # an invalid file: refused with the reason, the running configuration stays
        cfg.write_text(cfg.read_text() + "[server\nbogus = \n")
        mark = len(log.lines)
        proc.send_signal(signal.SIGHUP)
        bad = await log.wait("config_reload_failed", mark)
        assert "relay.toml" in bad["reason"]
        _toml(
            cfg,
            db,
            sim_b.port,
            [("alpha", SECRET, 3), ("beta", OTHER_SECRET, 5)],
            extra="[dispatcher]\nnot_a_key = 1\n",
        )
        mark = len(log.lines)
        proc.send_signal(signal.SIGHUP)
        bad = await log.wait("config_reload_failed", mark)
        assert "not_a_key" in bad["reason"]
        resp = await httpc.fetch(port, "POST", CHAT, httpc.chat(3), _auth(OTHER_SECRET))
        assert resp.status == 200 and len(chats(sim_b)) == 3
        assert proc.returncode is None  # SIGHUP never stops it
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        await log.task
        assert log.lines[-1]["event"] == "relay_stopped"
    finally:
        await kill(proc)
        await sim_a.stop()
        await sim_b.stop()
    assert len(_rows(db)) == 7  # every request has its row (the 401 and the 429 included)


async def test_second_sigterm_ends_the_drain_at_once_with_rows_flushed(tmp_path):
    sim = Simulator()
    await sim.start()
    cfg, db = tmp_path / "relay.toml", str(tmp_path / "relay.db")
    _toml(cfg, db, sim.port, [("alpha", SECRET, 100)])
    proc = await start("serve", "--config", str(cfg))
    streams = []
    try:
        port, _ = await wait_listening(proc)
        log = Tail(proc)
        for i in range(3):
            assert (
                await httpc.fetch(port, "POST", CHAT, httpc.chat(2), _auth(SECRET, f"done{i}"))
            ).status == 200
        for i in range(4):  # long streams: a 30 s drain would wait for them
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                httpc.build_request(
                    "POST", CHAT, httpc.chat(100000, interval_ms=50), _auth(SECRET, f"long{i}")
                )
            )
            head = await asyncio.wait_for(httpc.read_head(reader), 10)
            streams.append((reader, writer, head))
        proc.send_signal(signal.SIGTERM)
        await log.wait("relay_draining")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert loop.time() - t0 < 3.0
        for reader, writer, head in streams:  # cut: a visible truncation
            await asyncio.wait_for(httpc.read_body(reader, head), 5)
            assert head.status == 200 and not head.complete
            writer.close()
        await log.task
        assert log.lines[-1]["event"] == "relay_stopped"
    finally:
        await kill(proc)
        await sim.stop()
    rows = {r["request_id"]: r for r in _rows(db)}
    assert sorted(rows) == sorted([f"done{i}" for i in range(3)] + [f"long{i}" for i in range(4)])
    for i in range(4):
        r = rows[f"long{i}"]
        assert (r["status"], r["upstream_served"], r["error_code"]) == (200, "llm", "shutdown")
        assert r["bytes_out"] > 0 and r["completion_tokens"] > 0

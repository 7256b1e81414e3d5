"""A relay killed with SIGKILL right after a burst: on restart every admitted keyed request
has exactly one row, and a key cannot make more requests than its limit."""

import asyncio
import json
import signal
import sqlite3
import time

from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.helpers import wait_for
from tests.support.keys import SECRET, sha
from tests.support.processes import kill, start, wait_listening

CHAT = "/v1/chat/completions"
LIMIT = 40


def _config(tmp_path, sim_port: int) -> str:
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        f'[server]\nport = 0\n[store]\npath = "{tmp_path / "relay.db"}"\n'
        f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{sim_port}"\nparallel = 64\n'
        f'[[key]]\nid = "alpha"\nsha256 = "{sha(SECRET)}"\nrequests_per_day = {LIMIT}\n'
    )
    return str(cfg)


def _headers(rid: str) -> dict:
    return {"Authorization": f"Bearer {SECRET}", "X-Request-Id": rid}


async def test_kill_9_after_a_burst_loses_no_admitted_request(tmp_path):
    sim = Simulator()
    await sim.start()
    cfg = _config(tmp_path, sim.port)
    proc = await start("serve", "--config", cfg)
    streams = []
    try:
        port, _ = await wait_listening(proc)
        # ten streams in flight...
        for i in range(10):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                httpc.build_request(
                    "POST", CHAT, httpc.chat(100000, interval_ms=50), _headers(f"flight{i}")
                )
            )
            streams.append((reader, writer))
        for reader, _ in streams:
            assert (await asyncio.wait_for(httpc.read_head(reader), 10)).status == 200
        # ...and a burst that completes; then SIGKILL at once (no flush, no drain)
        burst = await asyncio.gather(
            *(
                httpc.fetch(port, "POST", CHAT, httpc.chat(2, stream=False), _headers(f"burst{i}"))
                for i in range(20)
            )
        )
        assert [r.status for r in burst] == [200] * 20
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    finally:
        for _, writer in streams:
            writer.close()
        await kill(proc)

    admitted = {f"flight{i}" for i in range(10)} | {f"burst{i}" for i in range(20)}
    proc = await start("serve", "--config", cfg)
    try:
        port, seen = await wait_listening(proc)
        assert any(r["event"] == "admissions_recovered" for r in seen)
        conn = sqlite3.connect(tmp_path / "relay.db")
        conn.row_factory = sqlite3.Row
        rows = [dict(r) for r in conn.execute("SELECT * FROM request")]
        conn.close()
        ids = [r["request_id"] for r in rows]
        assert sorted(ids) == sorted(admitted)  # exactly one row each
        for r in rows:
            if r["request_id"].startswith("flight"):  # cut by the crash: charged as reserved
                assert (r["error_code"], r["ok"], r["tokens_source"]) == (
                    "relay_crashed",
                    0,
                    "reserved",
                )
                assert r["completion_tokens"] == 100000
        # the key has LIMIT - 30 requests left, not a fresh budget
        statuses = []
        for i in range(LIMIT):
            resp = await httpc.fetch(
                port, "POST", CHAT, httpc.chat(2, stream=False), _headers(f"after{i}")
            )
            statuses.append(resp.status)
            if resp.status == 429:
                break
        assert statuses == [200] * (LIMIT - len(admitted)) + [429]
    finally:
        await kill(proc)
        await sim.stop()


async def test_admission_is_replaced_by_its_row_and_recovered_after_a_crash(tmp_path):
    from relay.observe.record import Record
    from relay.store.sqlite import Store

    db = str(tmp_path / "a.db")
    store = Store(db)
    store.start()
    now = time.time()
    rec = Record(
        ts=now,
        request_id="r1",
        path=CHAT,
        key_id="k",
        model="m",
        stream=True,
        upstream_requested="llm",
    )
    a1 = store.next_admission_id()
    await store.admit(a1, rec, 7, 100)
    # committed before admit returned: another connection sees it
    conn = sqlite3.connect(db)
    assert conn.execute(
        "SELECT id, request_id, prompt_tokens, completion_tokens FROM admission"
    ).fetchall() == [(a1, "r1", 7, 100)]
    row = rec.row()
    row.update(status=200, ok=1, upstream_served="llm", admission_id=a1)
    store.put(row)
    store.flush()
    assert conn.execute("SELECT COUNT(*) FROM admission").fetchone() == (0,)
    assert conn.execute("SELECT request_id FROM request").fetchall() == [("r1",)]
    # a second request admitted, then the process dies before its row (simulated: no put)
    rec2 = Record(ts=now + 1, request_id="r2", path=CHAT, key_id="k", upstream_requested="llm")
    await store.admit(store.next_admission_id(), rec2, 3, 50)
    store.close()
    again = Store(db)
    again.start()
    assert again.recovered == 1
    got = conn.execute(
        "SELECT request_id, error_code, ok, prompt_tokens, completion_tokens, "
        "tokens_source FROM request ORDER BY ts"
    ).fetchall()
    assert got == [("r1", None, 1, None, None, None), ("r2", "relay_crashed", 0, 3, 50, "reserved")]
    assert again.usage_since("k", 0.0, served_only=True) == (2, 53)
    assert conn.execute("SELECT COUNT(*) FROM admission").fetchone() == (0,)
    conn.close()
    again.close()


def _slow_config(tmp_path, sim_port: int, port: int = 0) -> str:
    cfg = tmp_path / f"relay-{port}.toml"
    cfg.write_text(
        f'[server]\nport = {port}\n[store]\npath = "{tmp_path / "relay.db"}"\n'
        f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{sim_port}"\nparallel = 8\n'
        f'[[key]]\nid = "alpha"\nsha256 = "{sha(SECRET)}"\ntokens_per_day = 100000\n'
    )
    return str(cfg)


def _request_rows(tmp_path) -> list[tuple]:
    conn = sqlite3.connect(tmp_path / "relay.db")
    try:
        return conn.execute(
            "SELECT request_id, status, error_code, completion_tokens FROM request ORDER BY ts"
        ).fetchall()
    finally:
        conn.close()


async def test_a_second_relay_on_the_same_database_refuses_to_start(tmp_path):
    """A mistaken second `relay serve` on the same SQLite file (another port) is refused by
    the database's lock before it runs recovery: the first relay's live admission stays
    live, and its request gets exactly one row (not a `relay_crashed` one as well)."""
    sim = Simulator()
    await sim.start()
    first = await start("serve", "--config", _slow_config(tmp_path, sim.port))
    second = None
    try:
        port, _ = await wait_listening(first)
        request = asyncio.create_task(
            httpc.fetch(
                port, "POST", CHAT, httpc.chat(5, first_token_delay_ms=1500), _headers("live")
            )
        )
        await wait_for(lambda: len(sim.requests) == 1, 10)  # admitted, upstream
        second = await start("serve", "--config", _slow_config(tmp_path, sim.port))
        _, err = await asyncio.wait_for(second.communicate(), 20)
        lines = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
        assert second.returncode == 2
        [failed] = [line for line in lines if line["event"] == "relay_start_failed"]
        assert "in use by another relay process" in failed["error"]
        assert "relay.db.lock" in failed["error"]
        assert not [
            line for line in lines if line["event"] in ("admissions_recovered", "relay_listening")
        ]
        resp = await asyncio.wait_for(request, 10)
        assert resp.status == 200 and resp.complete
        first.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(first.wait(), 10) == 0
    finally:
        await kill(first)
        if second is not None:
            await kill(second)
        await sim.stop()
    assert _request_rows(tmp_path) == [("live", 200, None, 5)]
    # the lock went with the first process: a restart takes it and recovers nothing
    third = await start("serve", "--config", _slow_config(tmp_path, sim.port))
    try:
        _, seen = await wait_listening(third)
        assert not [line for line in seen if line["event"] == "admissions_recovered"]
    finally:
        await kill(third)
    assert _request_rows(tmp_path) == [("live", 200, None, 5)]


async def test_a_relay_that_cannot_listen_does_not_touch_the_database(tmp_path):
    """The listener is bound before the store starts: a second relay on the same address
    fails with EADDRINUSE before it takes the lock or recovers anything."""
    import errno

    from relay.app import App
    from relay.observe.log import quiet
    from relay.store.sqlite_file import StoreLocked

    sim = Simulator()
    await sim.start()
    first = await start("serve", "--config", _slow_config(tmp_path, sim.port))
    try:
        port, _ = await wait_listening(first)
        request = asyncio.create_task(
            httpc.fetch(
                port, "POST", CHAT, httpc.chat(5, first_token_delay_ms=1000), _headers("live")
            )
        )
        await wait_for(lambda: len(sim.requests) == 1, 10)
        from relay.config import load_config, parse_config

        cfg = parse_config(load_config(_slow_config(tmp_path, sim.port, port)))
        second = App(cfg, quiet())
        try:
            await second.start()
            raise AssertionError("a second relay started on a port in use")
        except OSError as exc:
            assert not isinstance(exc, StoreLocked)
            assert exc.errno == errno.EADDRINUSE
        assert second.store.recovered == 0
        assert second.store._thread is None and second.store._lock_fd is None
        resp = await asyncio.wait_for(request, 10)
        assert resp.status == 200
        first.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(first.wait(), 10) == 0
    finally:
        await kill(first)
        await sim.stop()
    assert _request_rows(tmp_path) == [("live", 200, None, 5)]

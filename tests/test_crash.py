"""A relay killed with SIGKILL right after a burst: on restart every admitted keyed request
has exactly one row, and a key cannot make more requests than its limit."""

import asyncio
import signal
import time
import sqlite3

from relay.sim import Simulator
from tests import httpc
from tests.test_cli import start, wait_listening
from tests.test_keys_budgets import SECRET, sha

CHAT = "/v1/chat/completions"
LIMIT = 40


def _config(tmp_path, sim_port: int) -> str:
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        f'[server]\nport = 0\n[store]\npath = "{tmp_path / "relay.db"}"\n'
        f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{sim_port}"\nparallel = 64\n'
        f'[[key]]\nid = "alpha"\nsha256 = "{sha(SECRET)}"\nrequests_per_day = {LIMIT}\n')
    return str(cfg)


def _headers(rid: str) -> dict:
    return {"Authorization": f"Bearer {SECRET}", "X-Request-Id": rid}


async def _stop(proc) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


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
            writer.write(httpc.build_request("POST", CHAT, httpc.chat(100000, interval_ms=50),
                                             _headers(f"flight{i}")))
            streams.append((reader, writer))
        for reader, _ in streams:
            assert (await asyncio.wait_for(httpc.read_head(reader), 10)).status == 200
        # ...and a burst that completes; then SIGKILL at once (no flush, no drain)
        burst = await asyncio.gather(*(
            httpc.fetch(port, "POST", CHAT, httpc.chat(2, stream=False), _headers(f"burst{i}"))
            for i in range(20)))
        assert [r.status for r in burst] == [200] * 20
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    finally:
        for _, writer in streams:
            writer.close()
        await _stop(proc)

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
                assert (r["error_code"], r["ok"], r["tokens_source"]) == \
                    ("relay_crashed", 0, "reserved")
                assert r["completion_tokens"] == 100000
        # the key has LIMIT - 30 requests left, not a fresh budget
        statuses = []
        for i in range(LIMIT):
            resp = await httpc.fetch(port, "POST", CHAT, httpc.chat(2, stream=False),
                                     _headers(f"after{i}"))
            statuses.append(resp.status)
            if resp.status == 429:
                break
        assert statuses == [200] * (LIMIT - len(admitted)) + [429]
    finally:
        await _stop(proc)
        await sim.stop()


async def test_admission_is_replaced_by_its_row_and_recovered_after_a_crash(tmp_path):
    from relay.record import Record
    from relay.store import Store

    db = str(tmp_path / "a.db")
    store = Store(db)
    store.start()
    now = time.time()
    rec = Record(ts=now, request_id="r1", path=CHAT, key_id="k", model="m", stream=True,
                 upstream_requested="llm")
    a1 = store.next_admission_id()
    await store.admit(a1, rec, 7, 100)
    # committed before admit returned: another connection sees it
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT id, request_id, prompt_tokens, completion_tokens "
                        "FROM admission").fetchall() == [(a1, "r1", 7, 100)]
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
    got = conn.execute("SELECT request_id, error_code, ok, prompt_tokens, completion_tokens, "
                       "tokens_source FROM request ORDER BY ts").fetchall()
    assert got == [("r1", None, 1, None, None, None),
                   ("r2", "relay_crashed", 0, 3, 50, "reserved")]
    assert again.usage_since("k", 0.0, served_only=True) == (2, 53)
    assert conn.execute("SELECT COUNT(*) FROM admission").fetchone() == (0,)
    conn.close()
    again.close()

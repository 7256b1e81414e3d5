"""SIGHUP adding a limit while another connection holds the SQLite write lock and a row waits
behind it: the new window is rebuilt from the rows once they are committed, and the relay's
event loop never waits for that - the streams in flight keep their pace, and the reload is
applied once the lock goes (the figures exact) or refused after its bound, nothing changed."""

from __future__ import annotations

import asyncio
import itertools
import signal
import sqlite3

from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.helpers import wait_for
from tests.support.keys import SECRET, sha
from tests.support.pg_relays import CHAT, Relay, chat, headers

INTERVAL_MS = 20  # the stream's pace
MAX_GAP_S = 0.5  # a gap in it: the relay's loop stopped (the bug: 2 s)


def _toml(path, db: str, sim_port: int, per_day: int | None) -> None:
    limit = f"requests_per_day = {per_day}\n" if per_day else ""
    path.write_text(
        f'[server]\nport = 0\n[store]\npath = "{db}"\n'
        f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{sim_port}"\nparallel = 8\n'
        f'[[key]]\nid = "alpha"\nsha256 = "{sha(SECRET)}"\n{limit}'
    )


def _committed(db: str) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT COUNT(*) FROM request").fetchone()[0]
    finally:
        conn.close()


async def _paced_stream(port: int, rid: str, tokens: int) -> float:
    """A keyed stream read as it comes: the longest gap between two reads, in seconds."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = httpc.chat(tokens, interval_ms=INTERVAL_MS)
    writer.write(httpc.build_request("POST", CHAT, body, headers(rid)))
    seen = [loop.time()]
    data = b""
    try:
        while b"[DONE]" not in data:
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            assert chunk, "the relay closed the stream"
            seen.append(loop.time())
            data = data[-16:] + chunk
    finally:
        writer.close()
    return max(b - a for a, b in itertools.pairwise(seen[1:]))  # (from the first read)


async def _settled(relay: Relay, rid: str) -> None:
    """Until the request's access line is read (its row and its charge came before it)."""
    await wait_for(lambda: any(e.get("request_id") == rid for e in relay.events("access")), 10)


class _Locked:
    """Another connection on the relay's database holding its write lock (BEGIN IMMEDIATE)."""

    def __init__(self, db: str) -> None:
        self.conn: sqlite3.Connection | None = sqlite3.connect(db, isolation_level=None, timeout=0)
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        if self.conn is not None:
            self.conn.execute("COMMIT")
            self.conn.close()
            self.conn = None


async def _relay_with_a_row_behind_a_lock(tmp_path, sim) -> tuple[Relay, str, _Locked]:
    """A relay whose key has no limit: 2 requests committed, then the lock taken and a
    third request settled, its row waiting behind the lock (the writer retries it)."""
    cfg, db = tmp_path / "relay.toml", str(tmp_path / "relay.db")
    _toml(cfg, db, sim.port, None)
    relay = await Relay(str(cfg)).start()
    assert [await chat(relay.port, f"r{i}") for i in range(2)] == [200, 200]
    await wait_for(lambda: _committed(db) == 2, 10, step=0.02)
    lock = _Locked(db)
    assert await chat(relay.port, "pending") == 200
    await wait_for(lambda: relay.events("store_warning"), 10, step=0.02)
    assert relay.events("store_warning")[0]["kind"] == "write"
    return relay, db, lock


async def test_a_reload_waiting_for_a_locked_database_never_stops_the_loop(tmp_path):
    sim = Simulator()
    await sim.start()
    relay, db, lock = await _relay_with_a_row_behind_a_lock(tmp_path, sim)
    try:
        # queued behind the batch the writer retries: to be read, unlike the next ones
        assert await chat(relay.port, "pending2") == 200
        stream = asyncio.create_task(_paced_stream(relay.port, "stream", 100))  # 2 s
        await wait_for(lambda: any(r.path == CHAT and r.tokens_sent >= 5 for r in sim.requests))
        _toml(tmp_path / "relay.toml", db, sim.port, 7)  # alpha: 7 a day, a new window
        mark = len(relay.lines)
        relay.proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.3)  # (the reload waits for the store: the next one settles)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await chat(relay.port, "meanwhile") == 200  # no limit yet
        took = loop.time() - t0
        assert took < MAX_GAP_S, f"a request took {took:.2f}s"
        await asyncio.sleep(0.7)  # the lock held 1 s in all, within the reload's bound
        assert not [r for r in relay.lines[mark:] if r["event"].startswith("config_reload")]
        lock.release()
        await wait_for(lambda: relay.events("config_reloaded"), 5, step=0.02)
        assert relay.events("config_reload_failed") == []
        gap = await asyncio.wait_for(stream, 20)
        assert gap < MAX_GAP_S, f"the relay's loop stopped {gap:.2f}s"
        await _settled(relay, "stream")
        # rebuilt from the 4 rows there were (and none later), the one settled meanwhile and
        # the stream in flight then charged on top: 6 of 7 used
        assert [await chat(relay.port, f"after{i}") for i in range(2)] == [200, 429]
        assert await relay.stop() == 0
    finally:
        lock.release()
        if relay.proc.returncode is None:
            relay.proc.kill()
            await relay.proc.wait()
        await sim.stop()


async def test_a_reload_the_locked_database_cannot_answer_in_time_is_refused(tmp_path):
    sim = Simulator()
    await sim.start()
    relay, db, lock = await _relay_with_a_row_behind_a_lock(tmp_path, sim)
    try:
        stream = asyncio.create_task(_paced_stream(relay.port, "stream", 175))  # 3.5 s
        await wait_for(lambda: any(r.path == CHAT and r.tokens_sent >= 5 for r in sim.requests))
        _toml(tmp_path / "relay.toml", db, sim.port, 6)
        relay.proc.send_signal(signal.SIGHUP)
        await wait_for(lambda: relay.events("config_reload_failed"), 10, step=0.02)
        gap = await asyncio.wait_for(stream, 20)
        assert gap < MAX_GAP_S, f"the relay's loop stopped {gap:.2f}s"
        [failed] = relay.events("config_reload_failed")
        assert "not read within 2.0s" in failed["reason"] and "nothing changed" in failed["reason"]
        lock.release()
        # the old configuration holds: alpha has no limit (4 served so far, 4 more now)
        assert [await chat(relay.port, f"old{i}") for i in range(4)] == [200] * 4
        # the same file again, the database free: applied, rebuilt from all 8 rows
        await wait_for(lambda: _committed(db) == 8, 10, step=0.02)
        relay.proc.send_signal(signal.SIGHUP)
        await wait_for(lambda: relay.events("config_reloaded"), 10, step=0.02)
        assert await chat(relay.port, "spent") == 429
        assert await relay.stop() == 0
    finally:
        lock.release()
        if relay.proc.returncode is None:
            relay.proc.kill()
            await relay.proc.wait()
        await sim.stop()

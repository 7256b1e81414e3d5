"""A worker that stops answering while it relays (SIGSTOP, a blocked loop, a debugger) is
lost after `[server].worker_timeout_s`: killed, what it held given back (its admitted
requests settled as crash rows), replaced, and said in one log line. A worker only paused
for less than the bound, or a parent that itself did not run, loses nothing. Real processes,
real sockets, SIGSTOP on a real worker's pid."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from relay.sim.server import Simulator
from tests.app.test_shutdown import rows as stored
from tests.app.test_signals import Tail
from tests.support import httpc
from tests.support.helpers import CHAT
from tests.support.keys import SECRET, sha
from tests.support.processes import alive, established, kill, socket_inodes, start, wait_listening

pytestmark = pytest.mark.timeout(120)
AUTH = {"Authorization": f"Bearer {SECRET}"}
# The bound in these tests: short, and still well above a busy machine's loop delays.
BOUND_S = 2.0


def _config(path, db: str, up_port: int, *, bound: float = BOUND_S) -> None:
    path.write_text(
        f'[server]\nport = 0\ndrain_timeout_s = 10\nworker_timeout_s = {bound}\n[store]\npath = "{db}"\n'
        "[dispatcher]\npool_timeout_s = 3\nhealth_interval_s = 0\n"
        f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{up_port}"\nparallel = 1\nqueue = 8\n'
        f'[[key]]\nid = "alpha"\nsha256 = "{sha(SECRET)}"\nrequests_per_day = 100\n'
    )


async def _serve(tmp_path, up_port: int, **cfg):
    path, db = tmp_path / "relay.toml", str(tmp_path / "relay.db")
    _config(path, db, up_port, **cfg)
    proc = await start("serve", "--config", str(path), "--workers", "2")
    port, seen = await wait_listening(proc)
    pids = next(r["pids"] for r in seen if r["event"] == "workers_serving")
    return proc, port, db, Tail(proc), pids


async def _open_stream(port: int, sim: Simulator, tokens: int = 400):
    """A stream under way (the upstream generates it): (reader, writer, head)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(httpc.build_request("POST", CHAT, httpc.chat(tokens, interval_ms=25), AUTH))
    head = await asyncio.wait_for(httpc.read_head(reader), 10)
    assert head.status == 200
    deadline = time.monotonic() + 10
    while not any(r.path == CHAT for r in sim.requests):
        assert time.monotonic() < deadline, "the stream never reached the upstream"
        await asyncio.sleep(0.01)
    return reader, writer, head


def _owner(pids: list[int], relay_port: int, client_port: int) -> int:
    """The worker holding the relay's end of the client connection from `client_port`."""
    inodes = {inode for inode, remote in established(relay_port).items() if remote == client_port}
    for pid in pids:
        if socket_inodes(pid) & inodes:
            return pid
    raise AssertionError(f"no worker holds the connection from port {client_port}")


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


async def _drained(reader) -> None:
    """Read until the relay's end of the connection is gone (cut or closed)."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass


async def test_a_worker_stopped_mid_stream_is_lost_killed_and_replaced(tmp_path):
    sim = Simulator()
    await sim.start()
    proc, port, db, log, pids = await _serve(tmp_path, sim.port)
    victim = None
    try:
        reader, writer, _ = await _open_stream(port, sim)
        victim = _owner(pids, port, writer.get_extra_info("sockname")[1])
        index = pids.index(victim)
        mark = len(log.lines)
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        lost = await log.wait("worker_unresponsive", mark, timeout=30)
        assert (lost["worker"], lost["pid"]) == (index, victim)
        assert lost["silent_s"] >= BOUND_S and lost["timeout_s"] == BOUND_S
        # It was silent from its stop at least: the line cannot come sooner than the bound.
        assert time.monotonic() - stopped_at >= BOUND_S
        gone = await log.wait("worker_lost", mark, timeout=30)
        assert gone["pid"] == victim and gone["crash_rows"] == 1
        restarted = await log.wait("worker_restarted", mark, timeout=30)
        assert restarted["worker"] == index and restarted["pid"] not in pids
        # Killed, not left stopped: it can never come back and write.
        deadline = time.monotonic() + 10
        while alive(victim):
            assert time.monotonic() < deadline, "the stopped worker still runs"
            await asyncio.sleep(0.05)
        await asyncio.wait_for(_drained(reader), 10)
        writer.close()
        # Its one slot is back: the next request is served, not 503 upstream_busy.
        again = await httpc.fetch(port, "POST", CHAT, httpc.chat(2, stream=False), AUTH)
        assert again.status == 200
        slots = (await httpc.fetch(port, "GET", "/api/slots/metrics")).json()
        assert slots["llm"]["in_flight"] == 0
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 40) == 0
        rows = stored(db)
        crashed = [r for r in rows if r["error_code"] == "relay_crashed"]
        assert len(rows) == 2 and len(crashed) == 1
        assert crashed[0]["key_id"] == "alpha" and crashed[0]["tokens_source"] == "reserved"
        # The parent's end of the killed worker's socket was reset (what it sent was never
        # read): that is its end, not an error of the parent's.
        assert [e for e in log.lines if e["event"] == "loop_error"] == []
    finally:
        if victim is not None:
            _resume(victim)
        await kill(proc)
        await sim.stop()


async def test_a_worker_paused_again_and_again_below_the_bound_is_not_lost(tmp_path):
    """A loop that is held up often (a busy worker, a loaded machine) but answers within the
    bound each time: nothing is lost, its stream ends whole."""
    sim = Simulator()
    await sim.start()
    bound = 3.0
    proc, port, _, log, pids = await _serve(tmp_path, sim.port, bound=bound)
    victim = None
    try:
        reader, writer, head = await _open_stream(port, sim, tokens=300)
        victim = _owner(pids, port, writer.get_extra_info("sockname")[1])
        # Paused, and asked at once (a view asks every worker for its figures; the other
        # answers it): the ask goes unanswered for longer than the parent waits for one
        # answer (1 s), less than the bound. Then a little run. Three times.
        for _ in range(3):
            os.kill(victim, signal.SIGSTOP)
            paused = time.monotonic()
            assert (await httpc.fetch(port, "GET", "/api/slots/metrics")).status == 200
            await asyncio.sleep(max(0.0, 1.6 - (time.monotonic() - paused)))
            os.kill(victim, signal.SIGCONT)
            await asyncio.sleep(0.4)
        await asyncio.wait_for(httpc.read_body(reader, head), 30)
        writer.close()
        assert head.complete and head.data_events()[-1] == "[DONE]"
        # The parent has asked it since its last pause and had its answer (a view waits for
        # every worker's figures).
        assert (await httpc.fetch(port, "GET", "/api/slots/metrics")).status == 200
        assert [e for e in log.lines if e["event"] == "worker_unresponsive"] == []
        assert [e for e in log.lines if e["event"] == "worker_lost"] == []
        assert alive(victim)
    finally:
        if victim is not None:
            _resume(victim)
        await kill(proc)
        await sim.stop()


async def test_a_parent_that_did_not_run_declares_no_worker_lost(tmp_path):
    """The parent asked a worker, then was itself stopped past the bound while the worker
    answered: the answer waits in the parent's socket. When the parent runs again it is
    the parent that was silent, not the worker: nothing is lost."""
    sim = Simulator()
    await sim.start()
    bound = 3.0
    proc, port, _, log, pids = await _serve(tmp_path, sim.port, bound=bound)
    worker = pids[0]
    try:
        os.kill(worker, signal.SIGSTOP)
        try:
            # A view waits for every worker's figures: once it is answered (by the other
            # worker), the parent has asked the stopped one and has no answer.
            assert (await httpc.fetch(port, "GET", "/api/slots/metrics")).status == 200
            os.kill(proc.pid, signal.SIGSTOP)
        finally:
            os.kill(worker, signal.SIGCONT)
        try:
            # The worker runs and answers; the parent does not run, past the bound.
            await asyncio.sleep(bound + 1.0)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        for _ in range(3):  # (the parent's loop ran, with its checks, between these)
            assert (await httpc.fetch(port, "GET", "/api/slots/metrics")).status == 200
            await asyncio.sleep(0.3)
        assert [e for e in log.lines if e["event"] == "worker_unresponsive"] == []
        assert [e for e in log.lines if e["event"] == "worker_lost"] == []
        assert alive(worker)
    finally:
        _resume(worker)
        _resume(proc.pid)
        await kill(proc)
        await sim.stop()

"""`relay serve` under a systemd `Type=notify` unit, the manager's socket bound by the test (a
path and an abstract `@` name): `READY=1` once it serves, `RELOADING=1` then `READY=1` around
every SIGHUP (a refused file too), `STOPPING=1` when the drain begins, nothing else; with
`--workers 2` the same, every datagram from the parent, no worker given the socket."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import pytest

from relay.sim.server import Simulator
from tests.app.test_signals import Tail
from tests.support import httpc
from tests.support.notify_socket import ManagerSocket, Note
from tests.support.processes import kill, start, wait_listening

CHAT = "/v1/chat/completions"
pytestmark = pytest.mark.timeout(120)
# A generous deadline for what the relay is waited for to do, on a busy machine.
WAIT_S = 30.0


def _config(path, db: str, sim_port: int, parallel: int) -> None:
    path.write_text(
        f'[server]\nport = 0\ndrain_timeout_s = 20\n[store]\npath = "{db}"\n'
        f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{sim_port}"\n'
        f"parallel = {parallel}\n"
    )


def _usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def _environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        entries = fh.read().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


async def _reload(proc, manager: ManagerSocket) -> tuple[Note, Note, int, int]:
    """SIGHUP: the two datagrams it brings, and the monotonic clock in µs around them."""
    before = _usec()
    proc.send_signal(signal.SIGHUP)
    reloading = await manager.next(WAIT_S)
    ready = await manager.next(WAIT_S)
    return reloading, ready, before, _usec()


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("kind", ["path", "abstract"])
async def test_ready_reloading_stopping_reach_the_manager(tmp_path, kind, workers):
    sim = Simulator()
    await sim.start()
    manager = ManagerSocket(kind)
    cfg, db = tmp_path / "relay.toml", str(tmp_path / "relay.db")
    _config(cfg, db, sim.port, parallel=2)
    proc = await start(
        "serve", "--config", str(cfg), "--workers", str(workers), env={"NOTIFY_SOCKET": manager.env}
    )
    try:
        port, seen = await wait_listening(proc)
        log = Tail(proc)
        ready = await manager.next(WAIT_S)
        assert ready.fields == {"READY": "1", "STATUS": ready.fields["STATUS"]}
        where = f"serving 1 upstream (llm) on 127.0.0.1:{port}"
        assert ready.fields["STATUS"] == (
            where if workers == 1 else f"{where} with {workers} workers"
        )
        # READY means it serves.
        assert (await httpc.fetch(port, "POST", CHAT, httpc.chat(2))).status == 200
        if workers > 1:
            pids = next(r["pids"] for r in seen if r["event"] == "workers_serving")
            assert len(pids) == workers
            # No worker was given the socket: only the process the manager started notifies.
            for pid in pids:
                assert "NOTIFY_SOCKET" not in _environ_of(pid)

        # A reload applied.
        _config(cfg, db, sim.port, parallel=3)
        reloading, ready, before, after = await _reload(proc, manager)
        assert set(reloading.fields) == {"RELOADING", "MONOTONIC_USEC", "STATUS"}
        assert reloading.fields["STATUS"] == f"reloading {cfg}"
        # CLOCK_MONOTONIC in µs, taken between the signal and its datagram's arrival.
        assert before <= int(reloading.fields["MONOTONIC_USEC"]) <= after
        assert ready.fields == {"READY": "1", "STATUS": f"{ready.fields['STATUS']}"}
        assert ready.fields["STATUS"].startswith(where) and ready.fields["STATUS"].endswith(
            "; reloaded"
        )
        await log.wait("config_reloaded")

        # A file refused: the relay goes on with what it had, and says it is ready again.
        cfg.write_text(cfg.read_text() + "[server\nbogus = \n")
        reloading, ready, _, _ = await _reload(proc, manager)
        assert reloading.state == "RELOADING" and ready.state == "READY"
        status = ready.fields["STATUS"]
        assert status.startswith(f"{where}") and "; reload refused: " in status
        assert str(cfg) in status and "\n" not in status
        await log.wait("config_reload_failed")
        assert (await httpc.fetch(port, "POST", CHAT, httpc.chat(2))).status == 200

        # STOPPING when the drain begins: a long stream is still being relayed then.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(httpc.build_request("POST", CHAT, httpc.chat(100000, interval_ms=50)))
        head = await asyncio.wait_for(httpc.read_head(reader), WAIT_S)
        streaming = asyncio.create_task(httpc.read_body(reader, head))
        proc.send_signal(signal.SIGTERM)
        stopping = await manager.next(WAIT_S)
        assert stopping.fields == {"STOPPING": "1", "STATUS": "draining: up to 20 s"}
        assert not streaming.done()
        # A second SIGTERM ends the drain at once.
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), WAIT_S) == 0
        await asyncio.wait_for(streaming, WAIT_S)
        writer.close()
        assert head.status == 200 and not head.complete
        await log.task
        # Nothing after STOPPING; every datagram came from the relay's own process.
        assert manager.pending() == []
        assert [n.state for n in manager.seen] == [
            "READY", "RELOADING", "READY", "RELOADING", "READY", "STOPPING"
        ]  # fmt: skip
        assert {n.pid for n in manager.seen} == {proc.pid}
    finally:
        await kill(proc)
        manager.close()
        await sim.stop()


async def test_a_relay_that_cannot_start_says_why_and_never_ready():
    manager = ManagerSocket("abstract")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    proc = await start(
        "serve",
        "--upstream",
        "http://127.0.0.1:9",
        "--port",
        str(port),
        env={"NOTIFY_SOCKET": manager.env},
    )
    try:
        assert await asyncio.wait_for(proc.wait(), WAIT_S) == 2
        notes = [await manager.next(WAIT_S)] + manager.pending()
        assert [n.state for n in notes] == [None]
        assert notes[0].fields["STATUS"].startswith("start failed: ")
        assert "in use" in notes[0].fields["STATUS"]
    finally:
        await kill(proc)
        manager.close()
        busy.close()

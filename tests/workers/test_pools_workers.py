"""`relay serve --workers 2` in front of a pool of two simulators, real processes (issue 32):
the parent holds the pool, its one queue and its prefix table, so each conversation's turns
land on the member of its first turn whichever worker accepted them, and requests wait in the
parent's one queue for a slot of either member.

Which worker accepts a connection is the kernel's choice; to have each turn accepted by a
known worker the other is stopped (SIGSTOP) while the turn is sent, and the worker holding the
client's connection is read from /proc."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.app.test_signals import Tail
from tests.support import httpc
from tests.support.pools import MODEL, Conversation, Held, hold, landed
from tests.support.processes import established, kill, socket_inodes, start, wait_listening
from tests.workers.test_workers import CountingSim

CHAT = "/v1/chat/completions"
pytestmark = pytest.mark.timeout(180)
# A generous deadline for what the relay is waited for to do, on a busy machine.
WAIT_S = 30.0


def _config(path, db: str, ports: list[int], parallel: int, queue: int) -> None:
    # A stopped worker is not lost: the test stops one on purpose.
    text = (
        f"[server]\nport = 0\ndrain_timeout_s = 20\nworker_timeout_s = 3600\n"
        f'[store]\npath = "{db}"\n'
        f"[dispatcher]\npool_timeout_s = 60\nhealth_interval_s = 0.2\nheartbeat_s = 0\n"
    )
    for i, port in enumerate(ports):
        text += (
            f'[[upstream]]\nname = "m{i}"\nurl = "http://127.0.0.1:{port}"\n'
            f'models = ["{MODEL}"]\nparallel = {parallel}\nqueue = {queue}\n'
        )
    path.write_text(text)


async def _serve(tmp_path, sims: dict, parallel: int, queue: int = 8):
    path, db = tmp_path / "relay.toml", str(tmp_path / "relay.db")
    _config(path, db, [s.port for s in sims.values()], parallel, queue)
    proc = await start("serve", "--config", str(path), "--workers", "2")
    port, seen = await wait_listening(proc)
    pids = next(r["pids"] for r in seen if r["event"] == "workers_serving")
    assert len(pids) == 2
    return proc, port, Tail(proc), pids


def _metric(text: str, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


async def _until(port: int, name: str, want: float, **labels) -> str:
    """The parent's /metrics once `name` is `want`."""
    deadline = time.monotonic() + WAIT_S
    while True:
        resp = await httpc.fetch(port, "GET", "/metrics", timeout=WAIT_S)
        assert resp.status == 200
        text = resp.body.decode()
        if _metric(text, name, **labels) == want:
            return text
        assert time.monotonic() < deadline, f"{name} {labels} never {want}"
        await asyncio.sleep(0.05)


async def _idle(port: int) -> None:
    """The parent has every slot back (and learnt what each answer taught its table)."""
    for m in ("m0", "m1"):
        await _until(port, "relay_slots_in_flight", 0, upstream=m)


def _worker_of(held: Held, port: int, pids: list[int]) -> int:
    """The worker holding the client connection of `held`."""
    mine = held.local_port
    [inode] = [i for i, remote in established(port).items() if remote == mine]
    [pid] = [p for p in pids if inode in socket_inodes(p)]
    return pid


class Only:
    """While in this block, only worker `pid` accepts: the other is stopped."""

    def __init__(self, pid: int, pids: list[int]) -> None:
        [self.other] = [p for p in pids if p != pid]

    def __enter__(self) -> Only:
        os.kill(self.other, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        os.kill(self.other, signal.SIGCONT)


async def test_a_conversation_keeps_its_member_whichever_worker_accepts_it(tmp_path):
    sims = {f"m{i}": CountingSim() for i in range(2)}
    for s in sims.values():
        await s.start()
    proc, port, _, pids = await _serve(tmp_path, sims, parallel=2)
    helds: list[Held] = []
    try:
        first, second = pids
        convs = {n: Conversation("chat", f"workers-{n}") for n in ("p", "q", "r", "s")}
        home: dict[str, str] = {}
        # First turns, all accepted by the first worker, held at once: two on each member.
        with Only(first, pids):
            for n, conv in convs.items():
                helds.append(await hold(port, conv, f"{n}1"))
                [home[n]] = landed(sims, f"{n}1")
                assert _worker_of(helds[-1], port, pids) == first
            assert home["p"] != home["q"] and home["r"] != home["s"]
            for h in helds:
                h.close()
            await _idle(port)
        on = {m: [n for n in convs if home[n] == m] for m in sims}
        assert sorted(len(v) for v in on.values()) == [2, 2]
        (x, (p, q)), (y, (r, s)) = on.items()
        # Second turns, all accepted by the other worker, which never saw the first ones: Q's
        # goes to X beside P's, S's to Y beside R's, though the other member is idler.
        for conv in convs.values():
            conv.follow()
        with Only(second, pids):
            for n in (p, q, r):
                helds.append(await hold(port, convs[n], f"{n}2"))
                assert landed(sims, f"{n}2") == [home[n]]
                assert _worker_of(helds[-1], port, pids) == second
            for h in helds[-3:-1]:
                h.close()
            await _until(port, "relay_slots_in_flight", 0, upstream=x)
            helds.append(await hold(port, convs[s], f"{s}2"))
            assert landed(sims, f"{s}2") == [y]
            for h in helds:
                h.close()
            await _idle(port)
        # Third turns, whole, a new connection each, whichever worker the kernel picks.
        for n, conv in convs.items():
            conv.follow()
            resp = await httpc.fetch(
                port, "POST", CHAT, conv.body(tokens=3), {"X-Request-Id": f"{n}3"}
            )
            assert resp.status == 200 and resp.complete
            assert landed(sims, f"{n}3") == [home[n]]
    finally:
        for h in helds:
            h.close()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        await kill(proc)
        for sim in sims.values():
            await sim.stop()


async def test_requests_wait_in_the_parents_one_queue_for_either_member(tmp_path):
    sims = {f"m{i}": CountingSim() for i in range(2)}
    for s in sims.values():
        await s.start()
    proc, port, _, _ = await _serve(tmp_path, sims, parallel=1, queue=4)
    try:
        # Two slow streams run, one on each member (the least loaded takes the second).
        running = []
        for i in range(2):
            conv = Conversation("chat", f"run{i}")
            h = Held(port, CHAT, conv.body(tokens=120, interval_ms=50), f"run{i}")
            running.append(await h.start(WAIT_S))
        assert sorted(n for i in range(2) for n in landed(sims, f"run{i}")) == ["m0", "m1"]
        # Two more wait in the parent's one queue, whichever worker took them.
        waiting = [
            asyncio.create_task(
                httpc.fetch(
                    port,
                    "POST",
                    CHAT,
                    Conversation("chat", f"wait{i}").body(tokens=3),
                    {"X-Request-Id": f"wait{i}"},
                    timeout=WAIT_S * 2,
                )
            )
            for i in range(2)
        ]
        text = await _until(port, "relay_pool_queue_waiting", 2, pool=MODEL)
        assert _metric(text, "relay_slots_in_flight", upstream="m0") == 1
        assert _metric(text, "relay_slots_in_flight", upstream="m1") == 1
        assert not any(t.done() for t in waiting)
        # All four served: each waiter once a running stream ended.
        for h in running:
            body = await h.ended(WAIT_S * 2)
            assert body.endswith(b"0\r\n\r\n")
        results = await asyncio.gather(*waiting)
        assert [r.status for r in results] == [200, 200]
        assert all(r.complete for r in results)
        # Never two generations at once on a member of parallel 1.
        assert [s.peak for s in sims.values()] == [1, 1]
        assert [len(landed(sims, f"wait{i}")) for i in range(2)] == [1, 1]
        await _until(port, "relay_pool_queue_waiting", 0, pool=MODEL)
    finally:
        await kill(proc)
        for sim in sims.values():
            await sim.stop()

"""PostgreSQL frozen (every process of the server SIGSTOPped), not down: it accepts TCP and its
kernel ACKs every byte, but nothing answers. A keyed request still waits at most the bound of
docs/postgresql.md's "When PostgreSQL is away" (unreachable 2 s: the local view), and a relay
stopped meanwhile ends within drain_timeout_s and a small bound, its rows in the spill file,
sent at its next start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.helpers import wait_for
from tests.support.keys import OTHER_SECRET, sha
from tests.support.pg_relays import CHAT, Relay, chat, config, headers

BOUND_S = 2.0  # docs/postgresql.md: PostgreSQL unreachable 2 s, then the local view
MARGIN_S = 0.75  # the relay's own work and the simulator's answer, on a shared CPU
DRAIN_S = 3.0


def _postmaster(pg) -> int:
    with open(os.path.join(pg.data, "postmaster.pid")) as fh:
        return int(fh.readline())


def _children(main: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _stat(int(entry))[1] == main:
            out.append(int(entry))
    return out


def _stat(pid: int) -> tuple[str, int]:
    """(state, parent) of a process; ("X", 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return "X", 0
    return fields[0], int(fields[1])


def _stop(pid: int, end: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    # stopped for certain before the test goes on (or gone: a backend that was exiting)
    while _stat(pid)[0] not in ("T", "t", "Z", "X"):
        assert time.monotonic() < end, f"postgres process {pid} did not stop"
        time.sleep(0.001)


@contextlib.contextmanager
def frozen(pg):
    """The whole server stopped (SIGSTOP) inside the block - the postmaster first (it forks
    no backend after that), then its children: the backends serving the open connections,
    the checkpointer, ... - and resumed (SIGCONT) after it whatever happens."""
    main = _postmaster(pg)
    pids = [main]
    end = time.monotonic() + 5.0
    try:
        _stop(main, end)
        pids += _children(main)
        assert len(pids) > 1
        for pid in pids[1:]:
            _stop(pid, end)
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def timed(port: int, rid: str) -> tuple[int | None, float]:
    """A keyed request: (status, seconds to its answer); None: no answer in 30 s."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        resp = await httpc.fetch(
            port, "POST", CHAT, httpc.chat(2, stream=False), headers(rid), timeout=30
        )
    except TimeoutError:
        return None, loop.time() - t0
    return resp.status, loop.time() - t0


async def _beta(port: int, rid: str) -> int:
    h = {"Authorization": f"Bearer {OTHER_SECRET}", "X-Request-Id": rid}
    return (await httpc.fetch(port, "POST", CHAT, httpc.chat(2, stream=False), h)).status


async def logged(relay: Relay, *rids: str) -> None:
    """Until the access lines of these requests are read (a request's other lines, such as
    its admission_not_durable, come before it)."""
    want = set(rids)
    await wait_for(lambda: want <= {e.get("request_id") for e in relay.events("access")}, 10)


def _ids(pg, db: str) -> list[str]:
    return sorted(r[0] for r in pg.query(db, "SELECT request_id FROM request"))


async def test_keyed_requests_while_postgres_is_frozen_wait_at_most_the_bound(tmp_path, pg_server):
    sim = Simulator()
    await sim.start()
    db = pg_server.create_db()
    cfg = Path(config(tmp_path, "r", sim.port, pg_server.url(db), limit=6))
    # a second key, far from its limit: its requests are admitted in the database
    cfg.write_text(
        cfg.read_text() + f'[[key]]\nid = "beta"\nsha256 = "{sha(OTHER_SECRET)}"\n'
        "requests_per_day = 1000\n"
    )
    relay = await Relay(str(cfg)).start()

    async def paced(i: int) -> tuple[int | None, float]:
        await asyncio.sleep(i * 0.25)  # 4 a second
        return await timed(relay.port, f"frozen{i}")

    try:
        assert [await chat(relay.port, f"before{i}") for i in range(2)] == [200, 200]
        await wait_for(lambda: len(_ids(pg_server, db)) == 2, 10, step=0.05)
        with frozen(pg_server):
            results = await asyncio.gather(*(paced(i) for i in range(12)))
        statuses = [s for s, _ in results]
        waits = [round(t, 2) for s, t in results if s == 200]
        # the budget on the local view: 6 a day, 2 used before, so 4 more, then 429
        assert statuses == [200] * 4 + [429] * 8, results
        assert max(waits) < BOUND_S + MARGIN_S, waits
        await logged(relay, *(f"frozen{i}" for i in range(12)))
        assert sorted(e["request_id"] for e in relay.events("admission_not_durable")) == [
            f"frozen{i}" for i in range(4)
        ]
        # once it is back every row lands, each once (refused requests have rows too)
        want = sorted([f"before{i}" for i in range(2)] + [f"frozen{i}" for i in range(12)])
        await wait_for(lambda: len(_ids(pg_server, db)) >= len(want), 20, step=0.1)
        assert _ids(pg_server, db) == want
        # the connections it cut off are not used again: the shared budget answers (once
        # the relay tries it again: it fails fast for a moment after a failure)
        durable = 0
        for i in range(20):
            assert await _beta(relay.port, f"after{i}") == 200
            await logged(relay, f"after{i}")
            late = [e["request_id"] for e in relay.events("admission_not_durable")]
            durable = 0 if f"after{i}" in late else durable + 1
            if durable == 3:
                break
            await asyncio.sleep(0.1)
        assert durable == 3, relay.events("admission_not_durable")[4:]
        assert await chat(relay.port, "spent") == 429
        assert await relay.stop() == 0
    finally:
        if relay.proc.returncode is None:
            relay.proc.kill()
            await relay.proc.wait()
        await sim.stop()


async def test_a_relay_stopped_while_postgres_is_frozen_exits_in_time_and_spills(
    tmp_path, pg_server
):
    sim = Simulator()
    await sim.start()
    db = pg_server.create_db()
    cfg = config(tmp_path, "r", sim.port, pg_server.url(db), limit=100)
    Path(cfg).write_text(
        Path(cfg).read_text().replace("port = 0\n", f"port = 0\ndrain_timeout_s = {DRAIN_S}\n")
    )
    spill = cfg.replace(".toml", "-spill.jsonl")
    relay = await Relay(cfg).start()
    loop = asyncio.get_running_loop()
    stream = None
    try:
        assert await chat(relay.port, "before") == 200
        await wait_for(lambda: _ids(pg_server, db) == ["before"], 10, step=0.05)
        with frozen(pg_server):
            done = await asyncio.gather(*(timed(relay.port, f"frozen{i}") for i in range(3)))
            assert [s for s, _ in done] == [200] * 3
            # a stream longer than the drain: cut by the shutdown, its row written too
            stream = asyncio.create_task(
                httpc.fetch(
                    relay.port, "POST", CHAT, httpc.chat(400, interval_ms=50), headers("long")
                )
            )
            await wait_for(
                lambda: any(r.path == CHAT and r.tokens_sent >= 10 for r in sim.requests)
            )
            t0 = loop.time()
            relay.proc.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.wait_for(relay.proc.wait(), DRAIN_S + 4.0)
            except TimeoutError:
                code = None
            took = loop.time() - t0
            assert code == 0, f"still running {took:.1f}s after SIGTERM"
            await asyncio.wait_for(relay._reader, 10)
            # everything it could not write is in the spill file, nothing in the database
            assert len(Path(spill).read_bytes().splitlines()) == 4
        assert _ids(pg_server, db) == ["before"]
        relay = await Relay(cfg).start()  # the next start sends them, once
        assert relay.events("spill_replayed")[0]["rows"] == 4
        assert os.path.getsize(spill) == 0
        assert _ids(pg_server, db) == sorted(["before", "long", "frozen0", "frozen1", "frozen2"])
        assert await relay.stop() == 0
    finally:
        if relay.proc.returncode is None:
            relay.proc.kill()
            await relay.proc.wait()
        if stream is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(stream, 5)
        await sim.stop()

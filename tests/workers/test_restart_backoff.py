"""Workers that cannot start any more (the code broken in place, as a half-done upgrade
leaves it): their restarts back off, 1 s doubling; once no worker has served for
`[server].no_workers_exit_s` the parent exits 3, so that a supervisor restarts the relay and
the port is not held by a relay that answers nothing. Real processes: each attempt of a
worker writes when it began (the system's monotonic clock, which this test reads too)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import time

import pytest

from tests.app.test_signals import Tail
from tests.support.processes import kill, start, wait_listening

pytestmark = pytest.mark.timeout(120)

# A worker started once the flag file exists notes its index and start, and exits 7 before
# it serves.
_SITE = """\
import os, sys, time
if "relay.workers.worker" in sys.orig_argv and os.path.exists({flag!r}):
    index = sys.orig_argv[sys.orig_argv.index("--index") + 1]
    with open({starts!r}, "a") as fh:
        fh.write(f"{{index}} {{time.monotonic()}}\\n")
    os._exit(7)
"""


async def _serve(tmp_path, exit_after: float):
    site = tmp_path / "site"
    site.mkdir()
    flag, starts = tmp_path / "broken", tmp_path / "starts"
    (site / "sitecustomize.py").write_text(_SITE.format(flag=str(flag), starts=str(starts)))
    path = tmp_path / "relay.toml"
    path.write_text(
        f"[server]\nport = 0\ndrain_timeout_s = 5\nno_workers_exit_s = {exit_after}\n"
        f'[store]\npath = "{tmp_path / "relay.db"}"\n[dispatcher]\nhealth_interval_s = 0\n'
        '[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:9"\n'
    )
    proc = await start(
        "serve", "--config", str(path), "--workers", "2", env={"PYTHONPATH": str(site)}
    )
    port, seen = await wait_listening(proc)
    pids = next(r["pids"] for r in seen if r["event"] == "workers_serving")
    return proc, port, Tail(proc), pids, flag, starts


def _attempts(starts) -> dict[int, list[float]]:
    """Each worker index's attempts to start, when each began."""
    out: dict[int, list[float]] = {}
    if starts.exists():
        for line in starts.read_text().splitlines():
            index, at = line.split()
            out.setdefault(int(index), []).append(float(at))
    return out


def _break_and_kill(flag, pids: list[int]) -> float:
    """The workers' code is broken from now on; every worker is killed. When."""
    flag.write_text("")
    at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return at


async def test_restarts_of_workers_that_cannot_start_back_off(tmp_path):
    proc, _, log, pids, flag, starts = await _serve(tmp_path, exit_after=600)
    try:
        _break_and_kill(flag, pids)
        deadline = time.monotonic() + 60
        while not all(len(_attempts(starts).get(i, [])) >= 3 for i in range(2)):
            assert time.monotonic() < deadline, f"attempts: {_attempts(starts)}"
            assert proc.returncode is None
            await asyncio.sleep(0.05)
        for index, times in _attempts(starts).items():
            gaps = [b - a for a, b in itertools.pairwise(times)]
            # Each restart waits its backoff before it begins: 1 s, then 2 s (more on a busy
            # machine, never less).
            assert gaps[0] >= 1.0 and gaps[1] >= 2.0, (index, gaps)
            assert gaps[1] > gaps[0], (index, gaps)
        waits = [e["restart_in_s"] for e in log.lines if e["event"] == "worker_lost"]
        assert {1.0, 2.0} <= set(waits)
        # A stop in the middle of a backoff is not held up by it: no further attempt, exit 0.
        before = sum(len(t) for t in _attempts(starts).values())
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert sum(len(t) for t in _attempts(starts).values()) == before
    finally:
        await kill(proc)


async def test_with_no_worker_serving_for_the_bound_the_parent_exits_3(tmp_path):
    exit_after = 3.0
    proc, port, log, pids, flag, starts = await _serve(tmp_path, exit_after=exit_after)
    try:
        killed_at = _break_and_kill(flag, pids)
        assert await asyncio.wait_for(proc.wait(), 40) == 3
        assert time.monotonic() - killed_at >= exit_after
        await asyncio.wait_for(log.task, 10)
        (line,) = [e for e in log.lines if e["event"] == "relay_no_workers"]
        assert line["exit_code"] == 3 and f"{exit_after:g} s" in line["reason"]
        assert line["last_exit_codes"] == {"0": 7, "1": 7}
        assert any(e["event"] == "relay_stopped" for e in log.lines)
        assert len(_attempts(starts)) == 2
        # The port is given up: a client is refused at once, a supervisor sees the exit.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        await kill(proc)

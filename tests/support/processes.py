"""The relay as a user runs it: `python -m relay ...` in a real process, its JSON log read."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from tests.support.fixtures import ROOT


async def start(*args: str, env: dict | None = None, cwd: str | None = None):
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "relay",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=cwd,
    )
    return proc


async def wait_listening(proc) -> tuple[int, list[dict]]:
    """Read the relay's JSON log lines until it says where it listens."""
    seen = []
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), 20)
        assert line, f"relay exited early: {seen}"
        if line.startswith(b"{"):
            rec = json.loads(line)
            seen.append(rec)
            if rec["event"] == "relay_listening":
                return rec["port"], seen


async def kill(proc) -> None:
    """SIGKILL the process if it still runs, and reap it."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()

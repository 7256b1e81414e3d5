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


# ---- what the kernel says of a process (Linux /proc) -------------------------------------
def alive(pid: int) -> bool:
    """`pid` runs (or is stopped): it exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets `pid` holds a descriptor on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def established(port: int) -> dict[str, int]:
    """The TCP connections established on local port `port` (IPv4 and IPv6): each one's
    socket inode, and the remote port."""
    conns = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as fh:
            for line in list(fh)[1:]:
                f = line.split()
                local, remote, state, inode = f[1], f[2], f[3], f[9]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    conns[inode] = int(remote.rsplit(":", 1)[1], 16)
    return conns

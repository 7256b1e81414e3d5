"""Admission under hostile request bodies (issue 10), measured on a relay subprocess.

    python -m bench.admission_flood [--root TREE] [--clients 60] [--mib 7]

TREE is the source tree to run (default: this one), so the starting commit can be measured
the same way. Three measurements, each against `python -m relay serve --config ...` in front
of the simulator:
1. a 1 MB request body sent as 1-byte chunks (authenticated): status, relay CPU seconds, time;
2. a 4 MB one: status and when the answer came (the head deadline is 10 s);
3. N unauthenticated clients each sending a 7 MiB body at once: the relay's peak RSS and its
   RSS once they are gone.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECRET = "sk-bench-secret"
CLK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def one_byte_chunked(size: int) -> bytes:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + SECRET.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    prefix = b'{"model":"tiny","max_tokens":1,"messages":[{"role":"user","content":"'
    body = prefix + b"x" * (size - len(prefix) - 4) + b'"}]}'
    return head + b"".join(b"1\r\n%c\r\n" % c for c in body) + b"0\r\n\r\n"


async def send_and_status(port: int, data: bytes, timeout: float) -> tuple[int | None, float]:
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        line = await asyncio.wait_for(reader.readline(), timeout)
        return (int(line.split()[1]) if line else None), time.monotonic() - t0
    except (TimeoutError, ConnectionError):
        return None, time.monotonic() - t0
    finally:
        writer.close()


async def unauth_client(port: int, body: bytes, auth: bool = False) -> int | None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return None
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
        + (b"Authorization: Bearer " + SECRET.encode() + b"\r\n" if auth else b"")
        + b"Content-Length: %d\r\n\r\n" % len(body)
    )
    status = None
    try:
        writer.write(head)
        view = memoryview(body)
        for i in range(0, len(body), 256 * 1024):
            writer.write(view[i : i + 256 * 1024])
            await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 60)
        status = int(line.split()[1]) if line else None
    except (TimeoutError, ConnectionError, OSError):
        pass
    if status is None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            status = int(line.split()[1]) if line else None
        except (TimeoutError, ConnectionError, OSError, IndexError):
            pass
    writer.close()
    return status


async def flood(pid: int, port: int, clients: int, mib: int, auth: bool = False) -> dict:
    body = b'{"x":"' + b"y" * (mib * 1024 * 1024 - 8) + b'"}'
    peak = rss_mb(pid)
    before = peak
    tasks = [asyncio.create_task(unauth_client(port, body, auth)) for _ in range(clients)]
    t0 = time.monotonic()
    while not all(t.done() for t in tasks):
        peak = max(peak, rss_mb(pid))
        await asyncio.sleep(0.05)
    took = time.monotonic() - t0
    statuses = [t.result() for t in tasks]
    await asyncio.sleep(3.0)  # lingering closes are over
    return {
        "rss_before_mb": round(before, 1),
        "rss_peak_mb": round(peak, 1),
        "rss_after_mb": round(rss_mb(pid), 1),
        "seconds": round(took, 2),
        "statuses": {s: statuses.count(s) for s in set(statuses)},
    }


async def measure(pid: int, port: int, args) -> None:
    if args.flood_only:
        who = "authenticated" if args.auth else "unauthenticated"
        print(
            f"{args.clients} {who} x {args.mib} MiB: "
            f"{await flood(pid, port, args.clients, args.mib, args.auth)}",
            flush=True,
        )
        return
    c0 = cpu_s(pid)
    status, took = await send_and_status(port, one_byte_chunked(1_000_000), 60)
    print(
        f"1 MB in 1-byte chunks: status {status}, relay CPU {cpu_s(pid) - c0:.2f} s, "
        f"answer after {took:.2f} s",
        flush=True,
    )
    c0 = cpu_s(pid)
    status, took = await send_and_status(port, one_byte_chunked(4_000_000), 60)
    print(
        f"4 MB in 1-byte chunks: status {status} after {took:.2f} s, "
        f"relay CPU {cpu_s(pid) - c0:.2f} s",
        flush=True,
    )
    res = await flood(pid, port, args.clients, args.mib)
    print(f"{args.clients} unauthenticated x {args.mib} MiB: {res}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--clients", type=int, default=60)
    ap.add_argument("--mib", type=int, default=7)
    ap.add_argument(
        "--flood-only", action="store_true", help="only measurement 3, on a fresh relay"
    )
    ap.add_argument("--auth", action="store_true", help="--flood-only with a valid key")
    ap.add_argument("--extra", default="", help="more [server] TOML lines, e.g. max_body_chunks")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": args.root}
    sim_port, relay_port = free_port(), free_port()
    tmp = tempfile.mkdtemp(prefix="admission-flood-")
    cfg = Path(tmp, "relay.toml")
    cfg.write_text(f"""[server]
port = {relay_port}
{args.extra}
[store]
path = ":memory:"
[[upstream]]
name = "sim"
url = "http://127.0.0.1:{sim_port}"
[[key]]
id = "bench"
sha256 = "{hashlib.sha256(SECRET.encode()).hexdigest()}"
""")
    logs = open(Path(tmp, "out.log"), "wb")  # noqa: SIM115 - the children write it to the end
    sim = subprocess.Popen(
        [sys.executable, "-m", "relay.sim", "--port", str(sim_port)],
        cwd=args.root,
        env=env,
        stdout=logs,
        stderr=logs,
    )
    wait_port(sim_port)  # before the relay's first health probe
    relay = subprocess.Popen(
        [sys.executable, "-m", "relay", "serve", "--config", str(cfg)],
        cwd=args.root,
        env=env,
        stdout=logs,
        stderr=logs,
    )
    try:
        wait_port(sim_port)
        wait_port(relay_port)
        asyncio.run(measure(relay.pid, relay_port, args))
    finally:
        for p in (relay, sim):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

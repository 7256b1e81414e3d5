"""Added TTFT of durable admissions: keyed requests of a key with limits (admission record
committed before the upstream is contacted) vs a key without limits, same relay, same run.
`--store both`: a SQLite relay and a PostgreSQL relay (whose keyed requests take their
reservation in the database, one round trip) side by side in the same run.

    python -m bench.admission_ttft [--requests 200] [--store sqlite|postgres|both]

Relay and simulator are their own processes; requests alternate between the two keys,
sequentially, one keep-alive connection per key; TTFT is from just before the request is
written to the response head (held by the relay until the first content event)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def _proc(*args: str, cwd: str, log: str):
    env = {**os.environ, "PYTHONPATH": ROOT}
    with open(os.path.join(cwd, log), "wb") as err:  # a file: a full pipe would block it
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "relay",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            env=env,
            cwd=cwd,
        )


async def _listening(path: str) -> int:
    for _ in range(2000):
        with open(path, "rb") as fh:
            for line in fh:
                if line.startswith(b"{") and json.loads(line)["event"] == "relay_listening":
                    return json.loads(line)["port"]
        await asyncio.sleep(0.01)
    raise RuntimeError("relay did not start")


async def _ttft(reader, writer, body: bytes, secret: str) -> float:
    req = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + secret.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body
    t0 = time.perf_counter()
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    t = time.perf_counter() - t0
    assert b" 200 " in head.split(b"\r\n", 1)[0], head
    while True:  # read the chunked body to its end
        line = await reader.readuntil(b"\r\n")
        size = int(line.split(b";")[0], 16)
        await reader.readexactly(size + 2)
        if size == 0:
            return t


def _config(tmp: str, name: str, sim_port: int, store: str, keys: dict) -> str:
    cfg = os.path.join(tmp, f"{name}.toml")
    with open(cfg, "w") as fh:
        fh.write(
            f"[server]\nport = 0\n[store]\n{store}\n"
            f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{sim_port}"\n'
            f"parallel = 4\n"
        )
        for kid, secret in keys.items():
            sha = hashlib.sha256(secret.encode()).hexdigest()
            limit = "requests_per_day = 1000000000\n" if kid == "limited" else ""
            fh.write(f'[[key]]\nid = "{kid}"\nsha256 = "{sha}"\n{limit}')
    return cfg


def _postgres(pg_url: str | None):
    """(store lines, server to stop or None): --pg-url (password from PGPASSWORD), else a
    throwaway server of the test suite's (tests/support/pg_server.py: Debian's binaries), with fsync
    on as a real one has (each reservation's commit waits for its WAL flush)."""
    if pg_url:
        return f'url = "{pg_url}"', None
    from tests.support.pg_server import PASSWORD, PASSWORD_ENV, PgServer, find_bin

    server = PgServer(find_bin(), fsync=True)
    server.init()
    os.environ[PASSWORD_ENV] = PASSWORD
    return f'url = "{server.url(server.create_db())}"\npassword_env = "{PASSWORD_ENV}"', server


async def main(n: int, store: str = "sqlite", pg_url: str | None = None) -> None:
    tmp = tempfile.mkdtemp(prefix="relay-admission-")
    sim = await _proc("sim", "--port", "0", cwd=tmp, log="sim.log")
    sim_port = json.loads(await sim.stdout.readline())["port"]
    keys = {"limited": "sk-limited", "free": "sk-free"}
    stores = {}
    server = None
    if store in ("sqlite", "both"):
        stores["sqlite"] = f'path = "{tmp}/relay.db"'
    if store in ("postgres", "both"):
        stores["postgres"], server = _postgres(pg_url)
        stores["postgres"] += f'\nspill_path = "{tmp}/spill.jsonl"'
    relays, conns = [], {}
    body = json.dumps(
        {
            "model": "tiny",
            "stream": True,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        }
    ).encode()
    got: dict[tuple, list[float]] = {}
    try:
        for name, lines in stores.items():
            relay = await _proc(
                "serve",
                "--config",
                _config(tmp, name, sim_port, lines, keys),
                cwd=tmp,
                log=f"{name}.log",
            )
            relays.append(relay)
            port = await _listening(os.path.join(tmp, f"{name}.log"))
            for k in keys:
                conns[name, k] = await asyncio.open_connection("127.0.0.1", port)
                got[name, k] = []
        order = list(conns)
        for i in range(n + 20):  # the first 20 of each warm up
            for j in range(len(order)):  # every store and key in turn, rotated each round
                name, kid = order[(i + j) % len(order)]
                t = await _ttft(*conns[name, kid], body, keys[kid])
                if i >= 20:
                    got[name, kid].append(t * 1000)
    finally:
        for proc in relays + [sim]:
            proc.terminate()
            await proc.wait()
        if server is not None:
            server.destroy()
    p50 = {f"{s}/{k}": statistics.median(v) for (s, k), v in got.items()}
    p90 = {f"{s}/{k}": statistics.quantiles(v, n=10)[-1] for (s, k), v in got.items()}
    out = {
        "requests_per_key": n,
        "ttft_p50_ms": p50,
        "ttft_p90_ms": p90,
        "added_p50_ms": {s: p50[f"{s}/limited"] - p50[f"{s}/free"] for s in stores},
    }
    if len(stores) == 2:
        out["postgres_minus_sqlite_keyed_p50_ms"] = p50["postgres/limited"] - p50["sqlite/limited"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument(
        "--store",
        choices=("sqlite", "postgres", "both"),
        default="sqlite",
        help="both: a SQLite relay and a PostgreSQL relay in the same run",
    )
    ap.add_argument(
        "--pg-url",
        help="an existing PostgreSQL for --store postgres/both "
        "(password from PGPASSWORD); default: a throwaway server (Debian's binaries)",
    )
    args = ap.parse_args()
    asyncio.run(main(args.requests, args.store, args.pg_url))

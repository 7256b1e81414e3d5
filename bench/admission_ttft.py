"""Added TTFT of durable admissions: keyed requests of a key with limits (admission record
committed before the upstream is contacted) vs a key without limits, same relay, same run.

    python -m bench.admission_ttft [--requests 200]

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
            sys.executable, "-m", "relay", *args, stdout=asyncio.subprocess.PIPE,
            stderr=err, env=env, cwd=cwd)


async def _listening(path: str) -> int:
    for _ in range(2000):
        with open(path, "rb") as fh:
            for line in fh:
                if line.startswith(b"{") and json.loads(line)["event"] == "relay_listening":
                    return json.loads(line)["port"]
        await asyncio.sleep(0.01)
    raise RuntimeError("relay did not start")


async def _ttft(reader, writer, body: bytes, secret: str) -> float:
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
           b"Authorization: Bearer " + secret.encode() + b"\r\nContent-Length: %d\r\n\r\n"
           % len(body)) + body
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


async def main(n: int) -> None:
    tmp = tempfile.mkdtemp(prefix="relay-admission-")
    sim = await _proc("sim", "--port", "0", cwd=tmp, log="sim.log")
    sim_port = json.loads(await sim.stdout.readline())["port"]
    keys = {"limited": "sk-limited", "free": "sk-free"}
    cfg = os.path.join(tmp, "relay.toml")
    with open(cfg, "w") as fh:
        fh.write(f'[server]\nport = 0\n[store]\npath = "{tmp}/relay.db"\n'
                 f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{sim_port}"\n'
                 f'parallel = 4\n')
        for kid, secret in keys.items():
            sha = hashlib.sha256(secret.encode()).hexdigest()
            limit = "requests_per_day = 1000000000\n" if kid == "limited" else ""
            fh.write(f'[[key]]\nid = "{kid}"\nsha256 = "{sha}"\n{limit}')
    relay = await _proc("serve", "--config", cfg, cwd=tmp, log="relay.log")
    port = await _listening(os.path.join(tmp, "relay.log"))
    body = json.dumps({"model": "tiny", "stream": True, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    conns = {k: await asyncio.open_connection("127.0.0.1", port) for k in keys}
    got: dict[str, list[float]] = {k: [] for k in keys}
    try:
        for i in range(n + 20):  # the first 20 of each warm up
            for kid in (("limited", "free") if i % 2 else ("free", "limited")):
                t = await _ttft(*conns[kid], body, keys[kid])
                if i >= 20:
                    got[kid].append(t * 1000)
    finally:
        relay.terminate()
        sim.terminate()
        await relay.wait()
        await sim.wait()
    p50 = {k: statistics.median(v) for k, v in got.items()}
    p90 = {k: statistics.quantiles(v, n=10)[-1] for k, v in got.items()}
    print(json.dumps({"requests_per_key": n, "ttft_p50_ms": p50, "ttft_p90_ms": p90,
                      "added_p50_ms": p50["limited"] - p50["free"]}, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    asyncio.run(main(ap.parse_args().requests))

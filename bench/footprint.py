"""Footprint: start-up time, base RSS, and RSS per open idle stream (issue 15, part 3).

    python -m bench.footprint                       # relay and nginx, 1000 and 5000 streams
    python -m bench.footprint --streams 1000 --targets relay --startups 5

For each target and each stream count a FRESH proxy process:

- start-up: from the spawn of the proxy (``python -m relay serve --config ...``) to the first
  accepted connection answered (``GET /health``), polled every 2 ms; median of ``--startups``
  (the relay's bytecode cached, as an installed package has it);
- base RSS: VmRSS of the proxy tree once it answers, and again after a few warm-up requests
  (the first request of a process pays for what it touches the first time);
- then N slow streams are opened and VmRSS is read once all are open and quiet: RSS per open
  stream = (RSS with N open - warm base) / N. Each count is measured with the streams in two
  states (``--states``): ``next-token``, every stream has had its first content event and
  waits for the next (the simulator sends one every ``--interval-ms``); ``first-token``, the
  upstream's head and role event are in but no token yet (a long prompt: the simulator's
  ``first_token_delay_ms``), which the relay holds until the first token comes, so that
  another candidate could still serve. RSS is read once the simulator reports every request
  in progress (its /metrics ``requests_processing``), since the client sees nothing meanwhile.

The client side is this process: one asyncio loop holding every connection, reading and
discarding what arrives (so nothing piles up in a socket buffer).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench import nginx, procs, relay_conf
from bench.upstreams import SimUpstream

HOST = "127.0.0.1"
CONNECT_BATCH = 200  # connections opened at a time (nginx's listen backlog is 511)
# the relay's one upstream must admit every stream of the largest count at once
RELAY_TOML = "[[upstream]]\nparallel = 20000\n"
INTERVAL_MS = 2000  # one token per stream every 2 s: open, mostly idle streams
# What the open streams wait for when RSS is read (see the docstring), and how long the
# simulator keeps a `first-token` stream waiting (far longer than a measurement).
STATES = ("next-token", "first-token")
FIRST_TOKEN_MS = 600_000


def rss_kb(proc: procs.Proc) -> int:
    return sum(procs.status_kb(p, "VmRSS") for p in proc.pids())


def request(port: int, tokens: int, interval_ms: float, first_token_ms: int = 0) -> bytes:
    body = (
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,'
        b'"max_tokens":%d,"sim":{"tokens":%d,"interval_ms":%d,"first_token_delay_ms":%d}}'
        % (tokens, tokens, interval_ms, first_token_ms)
    )
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: "
        b"application/json\r\nAccept: text/event-stream\r\nContent-Length: %d\r\n\r\n"
        % (HOST.encode(), port, len(body))
    ) + body


class _Stream(asyncio.Protocol):
    """Reads until the first content event (then `first` is set), discards the rest."""

    def __init__(self, first: asyncio.Future) -> None:
        self.first, self.buf, self.tr = first, b"", None

    def connection_made(self, tr) -> None:
        self.tr = tr

    def data_received(self, data: bytes) -> None:
        if self.first.done():
            return
        self.buf += data
        if self.buf.startswith(b"HTTP/1.1 ") and not self.buf.startswith(b"HTTP/1.1 200"):
            self.first.set_exception(RuntimeError(f"answered {self.buf[:60]!r}"))
        elif b'"content"' in self.buf:
            self.buf = b""
            self.first.set_result(None)

    def connection_lost(self, exc) -> None:
        if not self.first.done():
            self.first.set_exception(ConnectionError(f"closed before content: {exc!r}"))


async def hold_streams(
    port: int,
    n: int,
    interval_ms: float,
    timeout: float,
    on_open,
    state: str = "next-token",
    up=None,
):
    """Open n streams, await every first content event (`next-token`; for `first-token`,
    every request in progress at the upstream `up`), call `on_open()`, then close all."""
    loop = asyncio.get_running_loop()
    first_token = state == "first-token"
    req = request(port, 100000, interval_ms, FIRST_TOKEN_MS if first_token else 0)
    transports, firsts = [], []
    if first_token:
        await asyncio.wait_for(_quiet(up), timeout)
    try:
        for start in range(0, n, CONNECT_BATCH):
            batch = []
            for _ in range(min(CONNECT_BATCH, n - start)):
                fut = loop.create_future()
                tr, _ = await asyncio.wait_for(
                    loop.create_connection(lambda f=fut: _Stream(f), HOST, port), timeout
                )
                transports.append(tr)
                tr.write(req)
                batch.append(fut)
            firsts += batch
            if first_token:
                await asyncio.wait_for(_processing(up, len(transports)), timeout)
            else:
                await asyncio.wait_for(asyncio.gather(*batch), timeout)
        await asyncio.sleep(0.5)  # let the proxy settle (its read buffers, timers)
        return on_open()
    finally:
        for tr in transports:
            tr.abort()
        for fut in firsts:  # (a proxy may pass the role event on: not waited for here)
            if fut.done() and not fut.cancelled():
                fut.exception()


async def _live(up) -> float:
    """The requests the simulator `up` is generating (processing or deferred: it has a few
    slots), from its /metrics."""
    reader, writer = await asyncio.open_connection(up.host, up.port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: sim\r\nConnection: close\r\n\r\n")
    text = (await reader.read()).decode("latin-1")
    writer.close()
    gauges = ("llamacpp:requests_processing ", "llamacpp:requests_deferred ")
    return sum(float(x.split()[1]) for x in text.splitlines() if x.startswith(gauges))


async def _processing(up, n: int) -> None:
    """Wait until the simulator `up` generates at least n requests."""
    while await _live(up) < n:
        await asyncio.sleep(0.1)


async def _quiet(up) -> None:
    """Wait until the simulator `up` generates nothing (the last measure's streams are gone)."""
    while await _live(up) > 0:
        await asyncio.sleep(0.1)


def _start(target: str, up, logdir: Path, relay_toml: Path):
    from bench.__main__ import start_proxy  # (the one way the bench starts a proxy)

    a = SimpleNamespace(relay_config=str(relay_toml), baseline_dir=None)
    return start_proxy(target, up, logdir, a)


def measure(
    target: str,
    n: int,
    up,
    logdir: Path,
    interval_ms: float,
    warmup: int = 20,
    state: str = "next-token",
) -> dict:
    row = {"scenario": "footprint", "target": target, "streams": n, "state": state}
    if target == "nginx" and not nginx.binary():
        return {**row, "skipped": "nginx: not found"}
    toml = logdir / "footprint.toml"
    toml.write_text(RELAY_TOML)
    proxy = _start(target, up, logdir, toml)
    try:
        time.sleep(0.3)
        row["base_rss_kb"] = rss_kb(proxy)
        warm = request(proxy.port, 2, 0)
        for _ in range(warmup):
            _one_request(proxy.port, warm)
        time.sleep(0.2)
        row["warm_rss_kb"] = rss_kb(proxy)
        row["open_rss_kb"] = asyncio.run(
            hold_streams(proxy.port, n, interval_ms, 60.0, lambda: rss_kb(proxy), state, up)
        )
        row["kb_per_stream"] = (row["open_rss_kb"] - row["warm_rss_kb"]) / n
    finally:
        proxy.stop()
    return row


def _one_request(port: int, req: bytes) -> None:
    import socket

    with socket.create_connection((HOST, port), timeout=10) as s:
        s.sendall(req)
        data = b""
        while b"0\r\n\r\n" not in data and b"[DONE]" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk


def measure_startup(target: str, up, logdir: Path, runs: int) -> dict:
    row = {"scenario": "startup", "target": target}
    if target == "nginx" and not nginx.binary():
        return {**row, "skipped": "nginx: not found"}
    toml = logdir / "footprint.toml"
    toml.write_text(RELAY_TOML)
    times = []
    # Bytecode cached as an installed package has it (this machine may set
    # PYTHONDONTWRITEBYTECODE, which would compile every module at every start): one start
    # fills the cache and is not timed.
    env = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(logdir / "pycache")}
    for i in range(runs + (target == "relay")):
        port = procs.free_port(HOST)
        if target == "relay":
            conf = relay_conf.write(up.url, logdir, str(toml))
            argv = [
                sys.executable,
                "-m",
                "relay",
                "serve",
                "--config",
                str(conf),
                "--host",
                HOST,
                "--port",
                str(port),
            ]
            t0 = time.monotonic()
            p = procs.Proc(target, argv, logdir, env=env)
        else:
            tmp = logdir / "nginx"
            conf = nginx.write_conf(tmp, HOST, port, up.host, up.port, None, None)
            t0 = time.monotonic()
            p = procs.Proc("nginx", nginx.argv(tmp, conf), logdir)
        try:
            took = _first_answer(p, port, t0)
            if i or target != "relay":
                times.append(took)
        finally:
            p.stop()
    row["startup_s"] = times
    return row


def _first_answer(p: procs.Proc, port: int, t0: float, timeout: float = 20.0) -> float:
    while time.monotonic() - t0 < timeout:
        try:
            procs.http_get_status(HOST, port, "/health", timeout=2.0)
            return time.monotonic() - t0
        except OSError:
            p.check_alive()
            time.sleep(0.002)
    raise TimeoutError(f"{p.name}: no answer on {port} in {timeout}s: {p.tail()}")


def run(
    up,
    logdir: Path,
    targets: list[str],
    counts: list[int],
    startups: int,
    interval_ms: float,
    repeat: int = 1,
    rep: int | None = None,
    states: tuple[str, ...] = STATES,
) -> list[dict]:
    """Start-up and footprint rows for relay and nginx (`rep`: one given repeat only), each
    count in each of `states`."""
    rows = []
    for i in range(repeat) if rep is None else [rep]:
        for target in targets:
            if target not in ("relay", "nginx"):
                continue
            print(f"bench: [{i + 1}] startup -> {target} ...", file=sys.stderr, flush=True)
            rows.append({**measure_startup(target, up, logdir, startups), "repeat": i})
            for n, state in ((n, s) for n in counts for s in states):
                print(
                    f"bench: [{i + 1}] footprint {n} streams ({state}) -> {target} ...",
                    file=sys.stderr,
                    flush=True,
                )
                r = {**measure(target, n, up, logdir, interval_ms, state=state), "repeat": i}
                rows.append(r)
                if "kb_per_stream" in r:
                    print(
                        f"bench:   base {r['base_rss_kb']} KB, warm {r['warm_rss_kb']} KB, "
                        f"open {r['open_rss_kb']} KB: {r['kb_per_stream']:.2f} KB/stream",
                        file=sys.stderr,
                        flush=True,
                    )
    return rows


def render(rows: list[dict]) -> list[str]:
    """Markdown lines: start-up and RSS per open idle stream, per target (medians)."""
    fp = [r for r in rows if r.get("scenario") == "footprint" and "kb_per_stream" in r]
    st = [r for r in rows if r.get("scenario") == "startup" and "startup_s" in r]
    if not fp and not st:
        return []
    med = statistics.median
    out = [
        "",
        "**Footprint** (a fresh proxy per line; RSS = VmRSS of the proxy process tree; "
        "per stream = (RSS with N slow streams open − RSS after 20 warm-up requests) ÷ N; "
        "the streams wait for their next token, or for their first: the upstream's head is "
        "in, no token yet):",
        "",
        "| target | open streams | waiting for | base RSS MiB (started) | RSS MiB after warm-up "
        "| RSS MiB with N open | KB per open stream | repeats |",
        "|" + "---|" * 8,
    ]
    keys = {(r["target"], r["streams"], r.get("state", STATES[0])) for r in fp}
    order = {s: i for i, s in enumerate(STATES)}
    for t, n, state in sorted(
        keys, key=lambda k: (["relay", "nginx"].index(k[0]), k[1], order.get(k[2], len(order)))
    ):
        rs = [
            r for r in fp if (r["target"], r["streams"], r.get("state", STATES[0])) == (t, n, state)
        ]
        if rs:
            out.append(
                f"| {t} | {n} | {state} | {med([r['base_rss_kb'] for r in rs]) / 1024:.1f} | "
                f"{med([r['warm_rss_kb'] for r in rs]) / 1024:.1f} | "
                f"{med([r['open_rss_kb'] for r in rs]) / 1024:.1f} | "
                f"**{med([r['kb_per_stream'] for r in rs]):.2f}** | "
                + ", ".join(f"{r['kb_per_stream']:.2f}" for r in rs)
                + " |"
            )
    for t in ("relay", "nginx"):
        times = [x for r in st if r["target"] == t for x in r["startup_s"]]
        if times:
            out.append(
                f"\nStart-up, {t} (spawn → first accepted connection answered, "
                f"{len(times)} starts): median **{med(times) * 1000:.0f} ms**, "
                f"min {min(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms"
            )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.footprint", description=__doc__.split("\n")[0]
    )
    p.add_argument("--targets", default="relay,nginx")
    p.add_argument("--streams", default="1000,5000", help="comma list of open stream counts")
    p.add_argument("--startups", type=int, default=5, help="start-up time: starts per target")
    p.add_argument("--interval-ms", type=float, default=INTERVAL_MS, help="sim: ms between tokens")
    p.add_argument(
        "--states", default=",".join(STATES), help="what the open streams wait for (see above)"
    )
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--keep-logs", action="store_true")
    a = p.parse_args(argv)
    procs.raise_nofile()
    logdir = Path(tempfile.mkdtemp(prefix="relay-footprint-"))
    up = SimUpstream(HOST)
    try:
        up.start(logdir)
        rows = run(
            up,
            logdir,
            a.targets.split(","),
            [int(x) for x in a.streams.split(",")],
            a.startups,
            a.interval_ms,
            a.repeat,
            states=tuple(a.states.split(",")),
        )
    finally:
        up.stop()
        procs.stop_all()
        if not a.keep_logs:
            import shutil

            shutil.rmtree(logdir, ignore_errors=True)
    print("\n".join(render(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

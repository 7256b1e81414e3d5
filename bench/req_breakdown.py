"""Where one request's work goes, stage by stage: Python opcodes per request, counted exactly.

    python -m bench.req_breakdown [--requests 300] [--tokens 4]

The simulator runs in its own process and the relay in this one (uvloop, the configuration
`bench.req_profile` measures: one upstream, a new client connection per request, 4-token
streams at 5 ms); after a warm-up, `sys.settrace` counts every opcode the relay's thread runs
while the ttft load (`bench.load`, its own process) sends `--requests` requests, by the
function that ran it, and each function is put in a stage of the request's life (`stage_of`).
Opcodes, not seconds: the count is the same however busy the machine is, and it tracks the
instructions `bench.req_profile` counts (about 95 instructions an opcode all in, C calls
included, on CPython 3.11). The SQLite writer's thread is not traced (its share of the
instructions is in req_profile's figure).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import procs

# (stage, rules): a function is in the first stage one of whose rules matches it; a rule is a
# module path suffix, optionally with ":function".
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("parse", ("http/usual_head.py", "h11/", "proxy/client.py:data_received", "proxy/client.py:_whole",
               "proxy/client.py:_pump", "proxy/client.py:_process", "proxy/client.py:_give",
               "proxy/client.py:_on_head", "proxy/client.py:_take_body", "proxy/client.py:_dispatch",
               "http/fields.py:request_headers", "http/fields.py:header_list")),
    ("judge the head", ("policy/request_head.py", "http/request_framing.py", "policy/admin_access.py",
                        "policy/admission.py:head_check", "policy/keys.py", "http/request_path.py")),
    ("peek the body", ("policy/admission.py:peek_body", "policy/body_fields.py",
                       "policy/admission.py:_typed")),
    ("admission", ("proxy/dispatch.py", "policy/routing.py", "policy/budget.py", "policy/limits.py",
                   "proxy/slots.py", "policy/affinity.py", "policy/fair.py", "proxy/attempt.py:take_slot",
                   "proxy/ledger.py", "observe/record.py:__init__", "<string>:__init__", "proxy/endpoints.py",
                   "policy/cors.py", "policy/admission.py", "proxy/request.py")),
    ("upstream write", ("proxy/attempt.py", "http/to_upstream.py", "proxy/pool.py", "policy/model_map.py",
                        "http/upstream_url.py", "proxy/exchange.py:__init__")),
    ("first read", ("http/response_head.py", "http/response_framing.py", "proxy/exchange.py:_head_data",
                    "proxy/exchange.py:start_body", "proxy/exchange.py:_hold_head")),
    ("hold and head out", ("stream/content_hold.py", "proxy/reply.py", "http/to_client.py",
                           "proxy/client_writer.py")),
    ("relay the events", ("stream/sse.py", "stream/fastpath.py", "stream/observer.py", "stream/dialect.py",
                          "stream/itl.py:add", "stream/itl.py:tick", "stream/itl.py:events",
                          "http/chunked.py", "http/body.py", "proxy/exchange.py", "proxy/stall_guard.py",
                          "proxy/deadlines.py", "proxy/client_flow.py", "stream/stall.py")),
    ("settlement", ("proxy/settle.py", "policy/outcome.py", "stream/usage.py", "observe/row_timings.py",
                    "stream/itl.py", "stream/summary.py", "proxy/telemetry.py")),
    ("the row and the log", ("observe/record.py", "store/", "observe/log.py", "app.py:put_row")),
    ("metrics", ("observe/metrics.py", "observe/prom_histogram.py")),
    ("the page's trend", ("observe/ui_state.py",)),
)  # fmt: skip
OTHER = "other (asyncio, weakref, the connection's life)"


def stage_of(filename: str, function: str) -> str:
    """The stage a function's opcodes count in."""
    path = filename.replace("\\", "/")
    for stage, rules in STAGES:
        for rule in rules:
            where, _, name = rule.partition(":")
            if (path.endswith(where) or f"/{where}" in path) and (not name or name == function):
                return stage
    return OTHER


def table(counts: dict[tuple[str, str], int], requests: int) -> list[tuple[str, float, float]]:
    """(stage, opcodes per request, share) in the order of STAGES, OTHER last."""
    by: collections.Counter[str] = collections.Counter()
    for (filename, function), n in counts.items():
        by[stage_of(filename, function)] += n
    total = sum(by.values()) or 1
    order = [s for s, _ in STAGES] + [OTHER]
    return [(s, by[s] / requests, by[s] / total) for s in order]


async def _run(requests: int, tokens: int, tmp: Path) -> tuple[dict[tuple[str, str], int], int]:
    from relay.app import App
    from relay.config import parse_config
    from relay.observe.log import quiet

    sim_port, port = procs.free_port("127.0.0.1"), procs.free_port("127.0.0.1")
    sim = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay", "sim", "--port", str(sim_port),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        frame.f_trace_opcodes = True
        key = (frame.f_code.co_filename, frame.f_code.co_name)

        def local(frame, event, arg):  # type: ignore[no-untyped-def]
            if event == "opcode":
                counts[key] += 1
            return local

        return local

    async def load(n: int) -> None:
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.load", "--port", str(port), "--concurrency", "1",
            "--requests", str(n), "--max-tokens", str(tokens), "--interval-ms", "5",
            cwd=str(procs.ROOT), stdout=subprocess.DEVNULL,
        )  # fmt: skip
        await p.wait()

    try:
        await _listening(sim_port)
        app = App(
            parse_config(
                {
                    "server": {"port": port},
                    "upstream": [
                        {"name": "bench", "url": f"http://127.0.0.1:{sim_port}", "parallel": 4096}
                    ],
                    "store": {"path": str(tmp / "relay.db")},
                }
            ),
            quiet(),
        )
        await app.start()
        await load(50)
        sys.settrace(tracer)
        try:
            await load(requests)
        finally:
            sys.settrace(None)
        await app.stop()
    finally:
        sim.terminate()
        await sim.wait()
    return dict(counts), requests


async def _listening(port: int, timeout: float = 30.0) -> None:
    """Wait until something accepts connections on the port."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if loop.time() > end:
                raise
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.req_breakdown", description=__doc__)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--functions", type=int, default=0, help="also list the N costliest functions")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        counts, n = run_counts(a.requests, a.tokens, Path(tmp))
    rows = table(counts, n)
    total = sum(per for _, per, _ in rows)
    print(f"opcodes per request ({a.tokens}-token streams, {n} requests): {total:.0f}")
    print("| stage | opcodes per request | share |")
    print("|---|---:|---:|")
    for stage, per, share in rows:
        print(f"| {stage} | {per:.0f} | {100 * share:.1f} % |")
    if a.functions:
        print("| function | stage | opcodes per request |")
        print("|---|---|---:|")
        top = sorted(counts.items(), key=lambda kv: -kv[1])[: a.functions]
        for (filename, function), count in top:
            where = _short(filename)
            print(f"| {where}:{function} | {stage_of(filename, function)} | {count / n:.0f} |")
    return 0


def _short(filename: str) -> str:
    """A function's file as a path from the package that holds it, no machine's directories."""
    path = filename.replace("\\", "/")
    for root in ("/relay/", "/site-packages/", "/lib/python"):
        if root in path:
            return path.rsplit(root, 1)[1]
    return path.rsplit("/", 1)[-1]


def run_counts(requests: int, tokens: int, tmp: Path) -> tuple[dict[tuple[str, str], int], int]:
    try:
        import uvloop

        return uvloop.run(_run(requests, tokens, tmp))
    except ImportError:
        return asyncio.run(_run(requests, tokens, tmp))


if __name__ == "__main__":
    sys.exit(main())

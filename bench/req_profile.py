"""Instructions per request of the relay process (callgrind), the ttft load.

    python -m bench.req_profile [--warm 50] [--requests 100] [--repeat 1] [--baseline REV]

The simulator and one relay (`python -m relay serve` under `valgrind --tool=callgrind`) on
127.0.0.1; the ttft load (one stream at a time, a new connection each, 4 tokens at 5 ms) runs
`--warm` requests, then the counters are dumped and zeroed (`callgrind_control --dump`), then
`--requests` more and a second dump: its instruction total ÷ `--requests` is the figure.
`--tokens N` sets the streams' length (4): the difference of two runs' figures over the
difference of their tokens is the instructions per relayed event.
Instruction counts do not depend on what else the machine runs (CPU time does), so two builds
compare within about 1 % (event-loop turns still depend on timing). `--baseline REV` also
measures the relay of git revision REV (its package unpacked, first on the relay's path),
the two builds alternating repeat by repeat, with the ratio of each repeat. `--keep DIR`
keeps the callgrind files for `callgrind_annotate`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import procs, relay_conf
from bench.__main__ import extract_baseline
from bench.upstreams import SimUpstream

HOST = "127.0.0.1"


def _load(port: int, n: int, tokens: int = 4) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.load",
            "--port",
            str(port),
            "--concurrency",
            "1",
            "--requests",
            str(n),
            "--max-tokens",
            str(tokens),
            "--interval-ms",
            "5",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=str(procs.ROOT),
    ).stdout
    res = json.loads(out.strip().splitlines()[-1])
    if res.get("errors") or res.get("incomplete"):
        raise RuntimeError(f"load failed: {res}")
    return res


def _dump(pid: int, tmp: Path, before: set[Path], timeout: float = 120.0) -> Path:
    subprocess.run(["callgrind_control", "--dump", str(pid)], check=True, capture_output=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = [p for p in tmp.glob(f"callgrind.out.{pid}.*") if p not in before]
        if new:
            time.sleep(0.5)  # (the file is written whole before the command returns)
            return new[0]
        time.sleep(0.2)
    raise TimeoutError("no callgrind dump")


def _total(path: Path) -> int:
    for line in path.read_text(errors="replace").splitlines():
        m = re.match(r"(?:summary|totals):\s*(\d+)", line)
        if m:
            return int(m.group(1))
    raise ValueError(f"no total in {path}")


def measure(a, tmp: Path, root: Path | None = None) -> float:
    """Instructions per request of the working tree's relay, or of the package under `root`."""
    sim = SimUpstream(HOST)
    sim.start(tmp)
    relay = None
    try:
        port = procs.free_port(HOST)
        conf = relay_conf.build(sim.url, tmp)
        conf["server"] = {"host": HOST, "port": port}
        (tmp / "relay.toml").write_text(relay_conf.dumps(conf))
        relay = procs.Proc(
            "relay",
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={tmp}/callgrind.out.%p",
                sys.executable,
                "-m",
                "relay",
                "serve",
                "--config",
                str(tmp / "relay.toml"),
            ],
            tmp,
            env={"PYTHONPATH": str(root)} if root is not None else None,
        )
        relay.wait_http(HOST, port, "/health", timeout=120)
        _load(port, a.warm, a.tokens)
        pid = relay.pid
        first = _dump(pid, tmp, set())
        _load(port, a.requests, a.tokens)
        second = _dump(pid, tmp, {first})
        per = _total(second) / a.requests
        if a.keep:
            Path(a.keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(second, Path(a.keep) / second.name)
        return per
    finally:
        if relay is not None:
            relay.stop()
        sim.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.req_profile", description=__doc__.split("\n")[0]
    )
    p.add_argument("--warm", type=int, default=50)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--keep", default="", help="copy the measured callgrind file here")
    p.add_argument("--baseline", default="", help="also measure the relay of git revision REV")
    p.add_argument(
        "--tokens",
        type=int,
        default=4,
        help="tokens per stream (two runs with different counts give instructions per event)",
    )
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="relay-reqprof-base-") as base:
        root = extract_baseline(a.baseline, Path(base)) if a.baseline else None
        figures, baseline = [], []
        for _ in range(a.repeat):
            with tempfile.TemporaryDirectory(prefix="relay-reqprof-") as d:
                figures.append(measure(a, Path(d)))
            print(f"instructions per request: {figures[-1] / 1e6:.4f} M", flush=True)
            if root is not None:
                with tempfile.TemporaryDirectory(prefix="relay-reqprof-") as d:
                    baseline.append(measure(a, Path(d), root))
                print(
                    f"baseline ({a.baseline}): {baseline[-1] / 1e6:.4f} M; "
                    f"ratio {figures[-1] / baseline[-1]:.3f}",
                    flush=True,
                )
    if len(figures) > 1:
        print("median: %.4f M" % (sorted(figures)[len(figures) // 2] / 1e6))
    if len(baseline) > 1:
        print("baseline median: %.4f M" % (sorted(baseline)[len(baseline) // 2] / 1e6))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

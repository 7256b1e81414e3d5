"""Workers (issue 24): the relay with `--workers 1` and `--workers 2` beside nginx with
`worker_processes` 1 and 2, in one run, on bench.transit's stamping upstream and clients.

    .venv/bin/python -m bench.workers --loads 128,256,384,512,768 --repeat 2 \\
        --output bench/RESULTS-workers.md

For each load (concurrent streams at `--rate` events/s, the upstream writing one event to every
stream per `--step-ms`) and target: CPU per relayed event (the proxy's processes, all of them),
the added transit p99 per event (target − direct, same repeat), and from the ladder the
capacity: the highest load whose added p99 stays under `--budget-ms` (5 ms). Then a request
load (`--request-load` streams of `--request-tokens` events, a new connection each): CPU per
request. Each figure next to nginx at the same worker count (relay ÷ nginx), each repeat's
too; and what the upstream and the clients took of the two cores.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from bench import procs, report, transit

TARGETS = ("direct", "relay", "relay_w2", "nginx", "nginx_w2")
PAIRS = (("relay", "nginx"), ("relay_w2", "nginx_w2"))  # the same worker count


def proxy_us_per(row: dict, counted: str) -> float | None:
    """The proxy's CPU (µs) over the run, per `counted` ("content_events", "requests")."""
    cpu = row.get("cpu_pct", {}).get("proxy")
    n = row.get(counted)
    if cpu is None or not n:
        return None
    return cpu / 100 * row["wall_s"] * 1e6 / n


def per_event_us(row: dict) -> float | None:
    return proxy_us_per(row, "content_events")


def per_request_us(row: dict) -> float | None:
    return proxy_us_per(row, "requests")


def added_p99_ms(rows: list[dict], row: dict) -> float | None:
    v = transit.added(rows, row, "transit_us", "p99")
    return None if v is None else v / 1000


def _runs(rows, target, load, phase):
    return sorted(
        (
            r
            for r in rows
            if r["target"] == target
            and r["load"] == load
            and r.get("phase") == phase
            and "skipped" not in r
        ),
        key=lambda r: r["repeat"],
    )


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _f(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def capacity(rows: list[dict], target: str, loads: list[int], budget_ms: float) -> int | None:
    """The highest load of the ladder whose median added p99 is under the budget, every lower
    load too (None: not even the first)."""
    best = None
    for load in loads:
        med = _med([added_p99_ms(rows, r) for r in _runs(rows, target, load, "events")])
        if med is None or med >= budget_ms:
            break
        best = load
    return best


def render(rows: list[dict], a, loads: list[int], targets: list[str], command: str) -> str:
    out = ["# Workers: the relay with 1 and 2 worker processes, beside nginx with 1 and 2", ""]
    out += report.machine()
    out += [
        f"- command: `{command}`",
        f"- load: bench.transit's stamping upstream (one process), {a.rate:g} events/s per"
        f" stream, one event to every live stream per {a.step_ms:g} ms step; {a.clients}"
        f" client processes; {a.duration_s:g} s per run, {a.tokens} events a stream",
        "- relay: `relay serve` (bench/relay_conf.py's config), `relay_w2` with `--workers 2`;"
        " nginx: bench/nginx.py's config, `nginx_w2` with `worker_processes 2`",
        f"- repeats: {a.repeat}, target order rotating; CPU = all the proxy's processes"
        " (the relay's parent and workers, nginx's master and workers)",
        "",
        "## CPU per relayed event (µs), and relay ÷ nginx at the same worker count",
        "",
        "| streams | " + " | ".join(targets[1:]) + " | relay ÷ nginx | relay_w2 ÷ nginx_w2 |",
        "|---|" + "---|" * (len(targets) - 1) + "---|---|",
    ]
    for load in loads:
        cells = []
        for t in targets[1:]:
            per = [per_event_us(r) for r in _runs(rows, t, load, "events")]
            cells.append(f"**{_f(_med(per))}** ({', '.join(_f(x) for x in per)})")
        ratios = []
        for r_t, n_t in PAIRS:
            rr = _runs(rows, r_t, load, "events")
            nn = {r["repeat"]: r for r in _runs(rows, n_t, load, "events")}
            per = []
            for r in rr:
                n = nn.get(r["repeat"])
                x, y = per_event_us(r), per_event_us(n) if n else None
                per.append(x / y if x and y else None)
            ratios.append(f"**{_f(_med(per), 2)}×** ({', '.join(_f(x, 2) for x in per)})")
        out.append(f"| {load} | " + " | ".join(cells + ratios) + " |")
    out += [
        "",
        f"## Added transit p99 per event (ms, target − direct), capacity under {a.budget_ms:g} ms",
        "",
        "| streams | " + " | ".join(targets[1:]) + " |",
        "|---|" + "---|" * (len(targets) - 1),
    ]
    for load in loads:
        cells = []
        for t in targets[1:]:
            per = [added_p99_ms(rows, r) for r in _runs(rows, t, load, "events")]
            cells.append(f"**{_f(_med(per), 2)}** ({', '.join(_f(x, 2) for x in per)})")
        out.append(f"| {load} | " + " | ".join(cells) + " |")
    caps = {t: capacity(rows, t, loads, a.budget_ms) for t in targets[1:]}
    out += [
        "",
        "Capacity (the highest load of the ladder with the added p99 under the budget):",
        "",
    ]
    for t in targets[1:]:
        c = caps[t]
        out.append(
            f"- {t}: "
            + (f"{c} streams = {c * a.rate:.0f} events/s" if c else f"under {loads[0]} streams")
            + (" (the ladder's top: more not tried)" if c == loads[-1] else "")
        )
    for r_t, n_t in PAIRS:
        if caps.get(r_t) and caps.get(n_t):
            out.append(f"- {r_t} ÷ {n_t}: {caps[r_t] / caps[n_t]:.2f}×")
    out += [
        "",
        "## What the load took of the two cores (% of one core, median over repeats and targets)",
        "",
        "| streams | upstream | clients | proxy (each target) |",
        "|---|---|---|---|",
    ]
    for load in loads:
        rs = [r for r in rows if r["load"] == load and r.get("phase") == "events"]
        up = _med([r["cpu_pct"]["upstream"] for r in rs if "cpu_pct" in r])
        cl = _med([r["cpu_pct"]["clients"] for r in rs if "cpu_pct" in r])
        px = ", ".join(
            f"{t} {_f(_med([r['cpu_pct']['proxy'] for r in _runs(rows, t, load, 'events')]), 0)}"
            for t in targets[1:]
        )
        out.append(f"| {load} | {_f(up, 0)} | {_f(cl, 0)} | {px} |")
    rl = a.request_load
    out += [
        "",
        f"## CPU per request (µs): {rl} streams of {a.request_tokens} events, a new"
        " connection each",
        "",
        "| target | µs per request | requests | ÷ nginx at the same worker count |",
        "|---|---|---|---|",
    ]
    for t in targets[1:]:
        rs = _runs(rows, t, rl, "requests")
        per = [per_request_us(r) for r in rs]
        pair = next((n for r_t, n in PAIRS if r_t == t), None)
        ratio = ""
        if pair:
            nn = {r["repeat"]: r for r in _runs(rows, pair, rl, "requests")}
            rat = []
            for r in rs:
                n = nn.get(r["repeat"])
                x, y = per_request_us(r), per_request_us(n) if n else None
                rat.append(x / y if x and y else None)
            ratio = f"**{_f(_med(rat), 2)}×** ({', '.join(_f(x, 2) for x in rat)})"
        out.append(
            f"| {t} | **{_f(_med(per), 0)}** ({', '.join(_f(x, 0) for x in per)}) |"
            f" {sum(r.get('requests', 0) for r in rs)} | {ratio} |"
        )
    bad = sum(r.get("errors", 0) + r.get("mismatch", 0) for r in rows)
    out += ["", f"Errors + streams with a wrong event count, all runs: **{bad}**.", ""]
    return "\n".join(out)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.workers", description=__doc__.split("\n")[0])
    p.add_argument("--loads", default="128,256,384,512,768")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--budget-ms", type=float, default=5.0)
    p.add_argument("--request-load", type=int, default=64)
    p.add_argument("--request-tokens", type=int, default=2)
    p.add_argument("--output", default=str(Path(__file__).parent / "RESULTS-workers.md"))
    p.add_argument("--json")
    own, rest = p.parse_known_args(argv)
    a = transit.parse_args(rest + ["--targets", own.targets])
    for k, v in vars(own).items():
        setattr(a, k, v)
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    procs.raise_nofile()
    loads = [int(x) for x in a.loads.split(",") if x.strip()]
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    logdir = Path(tempfile.mkdtemp(prefix="relay-workers-"))
    rows: list[dict] = []
    up = None
    events_tokens = a.tokens
    try:
        up = transit.Upstream(a, logdir)
        for rep in range(a.repeat):
            k = rep % len(targets)
            order = targets[k:] + targets[:k]
            for load in loads:
                for t in order:
                    print(f"workers: [{rep + 1}/{a.repeat}] {load} -> {t}", file=sys.stderr)
                    a.tokens = events_tokens
                    row = transit.run_quiet(t, load, rep, up, logdir, a)
                    row["phase"] = "events"
                    rows.append(row)
                    print("workers:   " + transit.brief(row), file=sys.stderr, flush=True)
            for t in order:
                a.tokens = a.request_tokens
                row = transit.run_quiet(t, a.request_load, rep, up, logdir, a)
                row["phase"] = "requests"
                rows.append(row)
                print("workers:   requests " + transit.brief(row), file=sys.stderr, flush=True)
    finally:
        a.tokens = events_tokens
        if up:
            up.stop()
        procs.stop_all()
    cmd = "python -m bench.workers " + " ".join(shlex.quote(x) for x in argv)
    text = render(rows, a, loads, targets, cmd)
    print(text)
    Path(a.output).write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 1 if any(r.get("errors") or r.get("mismatch") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

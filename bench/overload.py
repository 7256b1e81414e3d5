"""Overload (issue 33): at 2x what the upstream can serve, does an interactive key keep its
goodput while a batch key floods? Direct, nginx, the relay as one FIFO line, and the relay's
fair queue, side by side in one run.

    .venv/bin/python -m bench.overload --repeat 3        # ~22 min; a section atop bench/RESULTS.md

The upstream is the simulator with a fixed capacity: `relay sim --parallel P --defer` (a
generation beyond its P slots waits, first come first served, as llama-server defers it), each
request `--tokens` tokens `--interval-ms` apart, so a request holds a slot for S = tokens x
interval and the upstream serves C = P / S requests a second (measured once at the start: a
burst of 4 P requests). Two keys load it:

- interactive: `--users` virtual users, each with one request at a time and an exponential
  think time (mean `--think-s`) between the end of one and the next: N / (S + think) requests
  a second when unloaded;
- batch: an open-loop Poisson arrival process at `--load` x C minus the interactive rate, so
  the total offered load is `--load` x C (2x by default).

Targets, alternated (the order rotates each repeat), each a fresh proxy against the one
simulator: `unloaded` (the interactive users alone, direct: the reference), `direct` (the
upstream's own FIFO), `nginx` (passes everything: the upstream's FIFO), `relay_fifo` (both
clients send the same key: one line, first come first served), `relay_fair` (two keys of one
class: fair turns), `relay_prio` (the interactive key `priority = "high"`), and
`relay_fair_noage`, `relay_prio_noage` (the same with `[balance] aging_s` at its maximum, 3600 s,
out of a run's reach). The relay's `parallel` is P, its `queue` 100000 and `pool_timeout_s`
3600, so it refuses nothing.

A run sends for `--duration-s`; the figures count the interactive requests sent in
[`--warmup-s`, duration) and the batch requests completed in it. Goodput = interactive requests
whose first content event came within `--bound-s` (2 s) of the request, per second of that
window and as a share of its requests; an interactive request still without its first token
`--drain-s` after the sending stopped is cut and counts as missed (its wait, a lower bound, in
the TTFT quantiles, marked >=). The goal, printed, not asserted: `relay_prio` keeps at least
90 % of the unloaded goodput while the FIFO targets collapse (under half of it).

Processes: `python -m bench.overload client` (this module, its own process, uvloop, raw
sockets, one connection per request, bench/load.py's stream parser) runs one target's plan.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import load, nginx, procs, relay_conf, report
from bench.upstreams import SimUpstream

HOST = "127.0.0.1"
TARGETS = (
    "unloaded",
    "direct",
    "nginx",
    "relay_fifo",
    "relay_fair",
    "relay_prio",
    "relay_fair_noage",
    "relay_prio_noage",
)
FIFO = ("direct", "nginx", "relay_fifo")
GOAL_TARGET = "relay_prio"
GOAL_SHARE = 0.9
# `[balance] aging_s` of the *_noage targets: its maximum, out of any run's reach.
NO_AGING_S = 3600.0
COLLAPSED = 0.5
SECRETS = {"interactive": "sk-bench-interactive", "batch": "sk-bench-batch"}
SHARED = "sk-bench-shared"
BEGIN = "<!-- bench.overload: begin (python -m bench.overload rewrites this section) -->"
END = "<!-- bench.overload: end -->"


# -- the schedule (pure) ----------------------------------------------------------------------


def capacity(parallel: int, service_s: float) -> float:
    """Requests a second an upstream of `parallel` slots serves, each request holding its slot
    for `service_s`."""
    return parallel / service_s


def interactive_rate(users: int, service_s: float, think_s: float) -> float:
    """Requests a second of closed-loop users when nothing waits: one request each per
    service time plus think time."""
    return users / (service_s + think_s)


def batch_rate(cap: float, factor: float, interactive: float) -> float:
    """The open-loop rate that brings the offered load to `factor` x `cap`."""
    return max(0.0, factor * cap - interactive)


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of `rate` a second in [0, duration_s), the same for
    the same seed."""
    if rate <= 0:
        return []
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def think_times(mean_s: float, horizon_s: float, seed: int) -> list[float]:
    """Exponential think times of one user, enough of them to fill `horizon_s` even if every
    request took no time (none: no think time), the same for the same seed."""
    if mean_s <= 0:
        return []
    rng = random.Random(seed)
    out: list[float] = []
    total = 0.0
    while total < horizon_s:
        out.append(rng.expovariate(1.0 / mean_s))
        total += out[-1]
    return out


def plan(a, seed: int, with_batch: bool, shared_key: bool) -> dict:
    """What one target's client sends: each user's start offset and think times, the batch
    arrivals, the keys; the same users and arrivals for every target of a repeat."""
    service = a.tokens * a.interval_ms / 1000
    cycle = service + a.think_s
    lam_i = interactive_rate(a.users, service, a.think_s)
    lam_b = batch_rate(capacity(a.parallel, service), a.load, lam_i)
    users = [
        {
            "offset": cycle * u / a.users,
            "thinks": think_times(a.think_s, a.duration_s, seed * 1000 + u),
        }
        for u in range(a.users)
    ]
    return {
        "duration_s": a.duration_s,
        "drain_s": a.drain_s,
        "tokens": a.tokens,
        "interval_ms": a.interval_ms,
        "users": users,
        "batch": poisson_arrivals(lam_b, a.duration_s, seed) if with_batch else [],
        "secrets": {k: SHARED if shared_key else v for k, v in SECRETS.items()},
        "wait_batch": False,
    }


# -- the figures (pure) -----------------------------------------------------------------------


def summarise(records: list[dict], start_s: float, end_s: float, bound_s: float) -> dict:
    """One run's figures from its requests (times in s from the client's start): the
    interactive requests sent in [start_s, end_s), their TTFT and goodput; the batch requests
    and all requests completed in the window, per second."""
    span = end_s - start_s
    inter = [r for r in records if r["kind"] == "interactive" and start_s <= r["sent"] < end_s]
    waits: list[float] = []
    cut: list[float] = []
    errors = 0
    good = 0
    for r in inter:
        if r["first"] is not None:
            w = r["first"] - r["sent"]
            waits.append(w)
            good += w <= bound_s
        elif r["error"]:
            errors += 1
        else:
            cut.append(r["cut"] - r["sent"])

    def done(kind: str | None) -> int:
        return sum(
            1
            for r in records
            if (kind is None or r["kind"] == kind)
            and r["done"] is not None
            and start_s <= r["done"] < end_s
        )

    every = waits + cut
    floor = min(cut, default=None)
    q = {p: load.pct(every, p) for p in (50, 99)}
    return {
        "interactive": len(inter),
        "good": good,
        "goodput_rps": good / span,
        "good_share": good / len(inter) if inter else None,
        # A cut request's wait is a lower bound: a quantile at or above the shortest of them is
        # one too (ttft_floor).
        "ttft_s": {f"p{p}": v for p, v in q.items()},
        "ttft_floor": {
            f"p{p}": floor is not None and v is not None and v >= floor for p, v in q.items()
        },
        "cut": len(cut),
        "errors": errors,
        "batch_sent": sum(
            1 for r in records if r["kind"] == "batch" and start_s <= r["sent"] < end_s
        ),
        "batch_rps": done("batch") / span,
        "served_rps": done(None) / span,
        "batch_errors": sum(1 for r in records if r["kind"] == "batch" and r["error"]),
    }


def ratio(loaded: float | None, unloaded: float | None) -> float | None:
    """Loaded goodput over the unloaded one (None without a reference)."""
    if loaded is None or not unloaded:
        return None
    return loaded / unloaded


def measured_capacity(records: list[dict]) -> float | None:
    """Requests a second of a burst: those completed over first sent to last completed."""
    ends = [r["done"] for r in records if r["done"] is not None]
    if not ends:
        return None
    t0 = min(r["sent"] for r in records)
    return len(ends) / (max(ends) - t0)


# -- the client (`python -m bench.overload client`) --------------------------------------------


class _Stream(load.Stream):
    """bench.load's stream parser, and when the response ended in full."""

    t_end: float | None = None

    def connection_lost(self, exc):
        self.t_end = load.now()
        super().connection_lost(exc)


def _request(p: dict, host: str, port: int, secret: str) -> bytes:
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": p["tokens"],
            # The first token one interval after the start, the last at tokens x interval: the
            # slot is held for that long.
            "sim": {
                "tokens": p["tokens"],
                "interval_ms": p["interval_ms"],
                "first_token_delay_ms": p["interval_ms"],
            },
        },
        separators=(",", ":"),
    ).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {secret}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def client_run(p: dict, host: str, port: int) -> dict:
    loop = asyncio.get_running_loop()
    reqs = {k: _request(p, host, port, s) for k, s in p["secrets"].items()}
    t0 = load.now() + 0.2
    end = t0 + p["duration_s"]
    open_: dict[_Stream, str] = {}
    records: list[dict] = []

    def record(s: _Stream, kind: str, asked: float, cut: float | None = None) -> None:
        r = s.r
        ok = r.error is None and r.finished and r.done and s.t_end is not None
        records.append(
            {
                "kind": kind,
                "sent": (r.t_sent if r.t_sent is not None else asked) - t0,
                "first": None if r.t_first is None else r.t_first - t0,
                "done": s.t_end - t0 if ok else None,
                "error": None if cut is not None else (r.error or (None if ok else "incomplete")),
                "cut": None if cut is None else cut - t0,
            }
        )

    async def one(kind: str) -> None:
        fut = loop.create_future()
        s = _Stream(reqs[kind], fut)
        open_[s] = kind
        asked = load.now()
        try:
            await loop.create_connection(lambda: s, host, port)
            await fut
        except OSError as e:
            s.r.error = s.r.error or repr(e)
        except asyncio.CancelledError:
            if s.tr is not None:
                s.tr.abort()
            del open_[s]
            record(s, kind, asked, cut=load.now())
            raise
        del open_[s]
        record(s, kind, asked)

    async def user(u: dict) -> None:
        await asyncio.sleep(max(0.0, t0 + u["offset"] - load.now()))
        thinks = iter(u["thinks"])
        while load.now() < end:
            await one("interactive")
            await asyncio.sleep(next(thinks, 0.0))

    batch: set[asyncio.Task] = set()

    async def arrivals() -> None:
        for t in p["batch"]:
            await asyncio.sleep(max(0.0, t0 + t - load.now()))
            task = asyncio.ensure_future(one("batch"))
            batch.add(task)
            task.add_done_callback(batch.discard)

    ru0 = _cpu()
    users = [asyncio.ensure_future(user(u)) for u in p["users"]]
    sender = asyncio.ensure_future(arrivals())
    await asyncio.sleep(max(0.0, end - load.now()))
    # Sending stops; an interactive request still waiting may get its first token within the
    # drain bound (the batch ones too, when the plan waits for them: the capacity burst).
    cut_at = end + p["drain_s"]
    while load.now() < cut_at:
        first_due = any(k == "interactive" and s.r.t_first is None for s, k in open_.items())
        batch_due = p["wait_batch"] and (not sender.done() or batch)
        if not first_due and not batch_due:
            break
        await asyncio.sleep(0.05)
    sender.cancel()
    for t in users + list(batch):
        t.cancel()
    await asyncio.gather(sender, *users, *batch, return_exceptions=True)
    return {"records": records, "client_cpu_s": _cpu() - ru0, "wall_s": load.now() - t0}


def _cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def client_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overload client")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--plan", required=True, help="the plan, JSON (written by the orchestrator)")
    ap.add_argument("--out", required=True, help="the requests, JSON")
    a = ap.parse_args(argv)
    procs.raise_nofile()
    p = json.loads(Path(a.plan).read_text())
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        out = runner.run(client_run(p, HOST, a.port))
    Path(a.out).write_text(json.dumps(out))
    return 0


# -- orchestration ----------------------------------------------------------------------------


def relay_config(a, up_url: str, tmp: Path, target: str) -> Path:
    """The relay's config for `target`: one upstream of the simulator's slots, a queue that
    refuses nothing, and the keys (one shared key for relay_fifo)."""
    keys = (
        [{"id": "shared", "sha256": hashlib.sha256(SHARED.encode()).hexdigest()}]
        if target == "relay_fifo"
        else [
            {"id": k, "sha256": hashlib.sha256(s.encode()).hexdigest()} for k, s in SECRETS.items()
        ]
    )
    if target.startswith("relay_prio"):
        keys[0]["priority"] = "high"
    conf: dict = {
        "dispatcher": {"pool_timeout_s": 3600},
        "upstream": [{"name": "bench", "url": up_url, "parallel": a.parallel, "queue": 100000}],
        "store": {"path": str(tmp / "relay.db")},
        "key": keys,
    }
    if target.endswith("_noage"):
        conf["balance"] = {"aging_s": NO_AGING_S}
    elif a.aging_s is not None:
        conf["balance"] = {"aging_s": a.aging_s}
    for suffix in ("", "-wal", "-shm"):
        (tmp / f"relay.db{suffix}").unlink(missing_ok=True)
    path = tmp / f"{target}.toml"
    path.write_text(relay_conf.dumps(conf))
    return path


def start_proxy(target: str, up: SimUpstream, logdir: Path, a) -> procs.Proc | None:
    if target in ("unloaded", "direct"):
        return None
    port = procs.free_port(HOST)
    if target == "nginx":
        tmp = logdir / "nginx"
        conf = nginx.write_conf(tmp, HOST, port, up.host, up.port)
        p = procs.Proc("nginx", nginx.argv(tmp, conf), logdir)
    else:
        conf = relay_config(a, up.url, logdir, target)
        argv = [sys.executable, "-m", "relay", "serve", "--config", str(conf)]
        p = procs.Proc(target, argv + ["--host", HOST, "--port", str(port)], logdir)
    p.port = port
    p.wait_http(HOST, port, "/health")
    return p


def sim_busy(up: SimUpstream) -> float:
    """Generations the simulator runs or defers (its /metrics)."""
    with socket.create_connection((up.host, up.port), timeout=5) as s:
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: {up.host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    busy = 0.0
    for line in data.decode("utf-8", "replace").splitlines():
        if line.startswith(("llamacpp:requests_processing ", "llamacpp:requests_deferred ")):
            busy += float(line.split()[1])
    return busy


def wait_idle(up: SimUpstream, timeout: float = 60.0) -> None:
    """Until the simulator holds no generation (the last target's are gone)."""
    deadline = time.monotonic() + timeout
    while sim_busy(up):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the simulator stayed busy {timeout:g} s after a run")
        time.sleep(0.1)


def run_client(p: dict, port: int, logdir: Path, name: str) -> dict:
    plan_path, out_path = logdir / f"{name}.plan.json", logdir / f"{name}.records.json"
    out_path.unlink(missing_ok=True)
    plan_path.write_text(json.dumps(p))
    argv = [sys.executable, "-m", "bench.overload", "client", "--port", str(port)]
    c = procs.Proc(name, argv + ["--plan", str(plan_path), "--out", str(out_path)], logdir)
    try:
        c.popen.wait(p["duration_s"] + p["drain_s"] + 120)
    finally:
        c.stop()
    if c.popen.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"client failed ({c.popen.returncode}): {c.tail()}")
    return json.loads(out_path.read_text())


def measure_capacity(up: SimUpstream, logdir: Path, a) -> float | None:
    """A burst of 4 P requests straight to the simulator, unloaded: requests a second."""
    wait_idle(up)
    p = plan(a, 0, with_batch=False, shared_key=False)
    p.update(users=[], batch=[0.0] * (4 * a.parallel), wait_batch=True, duration_s=0.01)
    p["drain_s"] = 60.0
    out = run_client(p, up.port, logdir, "capacity")
    return measured_capacity(out["records"])


def run_one(target: str, rep: int, up: SimUpstream, logdir: Path, a) -> dict:
    row: dict = {"target": target, "repeat": rep}
    if target == "nginx" and not nginx.binary():
        return {**row, "skipped": "nginx: not found"}
    wait_idle(up)
    proxy = start_proxy(target, up, logdir, a)
    try:
        p = plan(a, a.seed + rep, target != "unloaded", target == "relay_fifo")
        u0, x0, b0 = up.cpu_us(), proxy.cpu_us() if proxy else 0.0, procs.system_busy_us()
        out = run_client(p, proxy.port if proxy else up.port, logdir, "client")
        u1, x1, b1 = up.cpu_us(), proxy.cpu_us() if proxy else 0.0, procs.system_busy_us()
    finally:
        if proxy:
            proxy.stop()
    wall = out["wall_s"]
    row.update(summarise(out["records"], a.warmup_s, a.duration_s, a.bound_s))
    row["wall_s"] = wall
    row["cpu_pct"] = {
        "upstream": (u1 - u0) / wall / 1e4,
        "proxy": (x1 - x0) / wall / 1e4 if proxy else None,
        "client": out["client_cpu_s"] * 1e6 / wall / 1e4,
        "other": max(0.0, (b1 - b0) - (u1 - u0) - (x1 - x0) - out["client_cpu_s"] * 1e6)
        / wall
        / 1e4,
    }
    if target == "nginx":
        row["nginx_upstream_errors"] = nginx.upstream_errors(logdir / "nginx")
    return row


# -- the report -------------------------------------------------------------------------------


def _f(x, nd=2, pre="") -> str:
    return "-" if x is None else f"{pre}{x:.{nd}f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.0f} %"


def _ttft(r: dict, p: str) -> str:
    return _f(r["ttft_s"][p], 2, ">= " if r["ttft_floor"][p] else "")


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with its goodput over the unloaded goodput of its repeat."""
    ref = {
        r["repeat"]: r["goodput_rps"]
        for r in rows
        if r["target"] == "unloaded" and "skipped" not in r
    }
    return [
        {**r, "ratio": ratio(r.get("goodput_rps"), ref.get(r["repeat"]))}
        if "skipped" not in r
        else r
        for r in rows
    ]


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def verdict(rows: list[dict], targets) -> list[str]:
    """The goal, in words: the prioritised relay at >= 90 % of the unloaded goodput, the FIFO
    targets under half of it (medians over repeats)."""
    med = {
        t: _med([r.get("ratio") for r in rows if r["target"] == t and "skipped" not in r])
        for t in targets
    }
    out = []
    g = med.get(GOAL_TARGET)
    if g is not None:
        out.append(
            f"**Goal: {GOAL_TARGET} keeps {_pct(g)} of the unloaded goodput (median ratio; "
            f"each repeat: "
            + ", ".join(_pct(r.get("ratio")) for r in rows if r["target"] == GOAL_TARGET)
            + f"): {'met' if g >= GOAL_SHARE else 'NOT met'} (>= {GOAL_SHARE * 100:.0f} %).**"
        )
    fifo = [t for t in FIFO if med.get(t) is not None]
    if fifo:
        out.append(
            "**FIFO: "
            + "; ".join(
                f"{t} {_pct(med[t])} ({'collapses' if med[t] < COLLAPSED else 'does NOT collapse'})"
                for t in fifo
            )
            + f"** (collapse: under {COLLAPSED * 100:.0f} % of the unloaded goodput)."
        )
    for t in targets:
        if t not in FIFO and t not in (GOAL_TARGET, "unloaded") and med.get(t) is not None:
            out.append(f"{t}: {_pct(med[t])} of the unloaded goodput (median ratio).")
    return out


def median_row(t: str, rs: list[dict]) -> str:
    """The summary table's line of target `t` from its runs: medians over repeats."""
    if not rs:
        return f"| {t} | skipped |" + " |" * 6

    def m(*path):
        return _med([_get(r, path) for r in rs])

    def ttft(p: str) -> str:
        return _f(m("ttft_s", p), 2, ">= " if any(r["ttft_floor"][p] for r in rs) else "")

    cells = [
        t,
        _f(m("goodput_rps")),
        _pct(m("ratio")),
        _pct(m("good_share")),
        ttft("p50"),
        ttft("p99"),
        _f(m("batch_rps")) if t != "unloaded" else "-",
        _f(m("served_rps")),
    ]
    return "| " + " | ".join(cells) + " |"


def _get(row: dict, path: tuple):
    for k in path:
        row = row.get(k) if isinstance(row, dict) else None
    return row


def render(rows: list[dict], a, targets, cap_measured, command: str, commit: str) -> str:
    service = a.tokens * a.interval_ms / 1000
    cap = capacity(a.parallel, service)
    lam_i = interactive_rate(a.users, service, a.think_s)
    lam_b = batch_rate(cap, a.load, lam_i)
    rows = with_ratios(rows)
    out = [BEGIN, "# Overload (issue 33 item 7): the interactive key's goodput at 2x capacity", ""]
    out += report.machine()
    out += [
        f"- commit: {commit}",
        f"- command: `{command}`",
        f"- upstream: `relay sim --parallel {a.parallel} --defer` (generations beyond its slots"
        f" wait, first come first served), {a.tokens} tokens x {a.interval_ms:g} ms = {service:g} s"
        f" a request: capacity C = {cap:.2f} requests/s from its settings, "
        f"{_f(cap_measured)} measured unloaded (a burst of {4 * a.parallel})",
        f"- interactive key: {a.users} users, one request at a time, exponential think time"
        f" (mean {a.think_s:g} s): {lam_i:.2f} requests/s offered when unloaded",
        f"- batch key: open-loop Poisson arrivals at {lam_b:.2f} requests/s: offered"
        f" {lam_i + lam_b:.2f} requests/s = {(lam_i + lam_b) / cap:.2f} x C"
        + (f" ({(lam_i + lam_b) / cap_measured:.2f} x the measured C)" if cap_measured else ""),
        f"- a run sends for {a.duration_s:g} s; figures over [{a.warmup_s:g} s,"
        f" {a.duration_s:g} s): interactive requests sent in it, batch and all requests completed"
        f" in it; goodput = interactive requests with their first token within {a.bound_s:g} s;"
        f" an interactive request without it {a.drain_s:g} s after the sending stopped is cut"
        f" (missed; its wait then is a lower bound, TTFT shown >=)",
        "- targets: unloaded (the interactive users alone, direct: the reference of its repeat),"
        " direct (the simulator's FIFO), nginx (passes everything), relay_fifo (both clients send"
        " one key: one line), relay_fair (two keys of one class: fair turns), relay_prio (the"
        ' interactive key `priority = "high"`), relay_fair_noage and relay_prio_noage (the'
        f" same with `[balance] aging_s = {NO_AGING_S:g}`, out of the run's reach); relay:"
        f" `parallel = {a.parallel}`, `queue = 100000`, `pool_timeout_s = 3600`"
        + (
            f", `[balance] aging_s = {a.aging_s:g}`"
            if a.aging_s is not None
            else ", `[balance] aging_s` default (5 s)"
        )
        + f"; a fresh proxy per run; seed {a.seed} + repeat (the same arrivals and think times"
        " for every target of a repeat)",
        f"- repeats: {a.repeat}, target order rotating per repeat",
        "",
    ]
    out += verdict(rows, targets)
    out += [
        "",
        "Medians over repeats:",
        "",
        "| target | interactive goodput req/s | ÷ unloaded | within 2 s | TTFT p50 s | TTFT p99 s"
        " | batch done req/s | all done req/s |",
        "|" + "---|" * 8,
    ]
    for t in targets:
        out.append(median_row(t, [r for r in rows if r["target"] == t and "skipped" not in r]))
    out += [
        "",
        "Each repeat:",
        "",
        "| repeat | target | interactive requests | within 2 s | goodput req/s | ÷ unloaded"
        " | share | TTFT p50 s | TTFT p99 s | cut | errors | batch sent | batch done req/s"
        " | all done req/s | CPU % sim / proxy / client / other |",
        "|" + "---|" * 15,
    ]
    for r in sorted(rows, key=lambda r: (r["repeat"], targets.index(r["target"]))):
        if "skipped" in r:
            out.append(f"| {r['repeat'] + 1} | {r['target']} | {r['skipped']} |" + " |" * 12)
            continue
        c = r["cpu_pct"]
        out.append(
            "| "
            + " | ".join(
                [
                    str(r["repeat"] + 1),
                    r["target"],
                    str(r["interactive"]),
                    str(r["good"]),
                    _f(r["goodput_rps"]),
                    _pct(r["ratio"]),
                    _pct(r["good_share"]),
                    _ttft(r, "p50"),
                    _ttft(r, "p99"),
                    str(r["cut"]),
                    f"{r['errors']} + {r['batch_errors']}",
                    str(r["batch_sent"]),
                    _f(r["batch_rps"]),
                    _f(r["served_rps"]),
                    " / ".join(_f(c[k], 0) for k in ("upstream", "proxy", "client", "other")),
                ]
            )
            + " |"
        )
    ng = sum(r.get("nginx_upstream_errors", 0) for r in rows)
    out += [
        "",
        "Errors: interactive + batch requests that failed (not cut at the end); nginx upstream"
        f" errors logged: {ng}. CPU % is of one core over the run (other: the machine's busy time"
        " not used by the simulator, the proxy or the client).",
        END,
        "",
    ]
    return "\n".join(out)


def place(section: str, old: str) -> str:
    """RESULTS.md with `section` in place of the last one this module wrote, or on top (the
    file's newest-first order)."""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        return head + section + "\n" + tail
    return section + "\n" + old


def commit() -> str:
    root = str(procs.ROOT)
    try:
        rev = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "relay", "bench"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return rev + (" (with uncommitted changes)" if dirty else "")


def settings_of(argv: list[str]) -> list[str]:
    """The command line without where files went (no machine's paths in the report)."""
    out: list[str] = []
    skip = False
    for x in argv:
        if skip:
            skip = False
        elif x in ("--output", "--json"):
            skip = True
        elif not x.startswith(("--output=", "--json=", "--keep-logs")):
            out.append(x)
    return out


def brief(r: dict) -> str:
    if "skipped" in r:
        return r["skipped"]
    return (
        f"interactive={r['interactive']} good={r['good']} goodput={r['goodput_rps']:.2f}/s"
        f" share={_pct(r['good_share'])} ttft p50={_ttft(r, 'p50')} p99={_ttft(r, 'p99')}"
        f" cut={r['cut']} errors={r['errors']}+{r['batch_errors']}"
        f" batch={r['batch_rps']:.2f}/s served={r['served_rps']:.2f}/s"
        f" other cpu={r['cpu_pct']['other']:.0f}%"
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__.split("\n")[0])
    p.add_argument(
        "--parallel", type=int, default=2, help="the simulator's slots (and the relay's)"
    )
    p.add_argument("--tokens", type=int, default=25, help="tokens a request")
    p.add_argument("--interval-ms", type=float, default=20.0, help="between two tokens")
    p.add_argument("--users", type=int, default=8, help="interactive users")
    p.add_argument("--think-s", type=float, default=7.5, help="their mean think time")
    p.add_argument("--load", type=float, default=2.0, help="offered load, x capacity")
    p.add_argument("--duration-s", type=float, default=45.0, help="sending, per run")
    p.add_argument("--warmup-s", type=float, default=5.0, help="figures from here on")
    p.add_argument("--drain-s", type=float, default=10.0, help="after the sending, at most")
    p.add_argument("--bound-s", type=float, default=2.0, help="goodput: first token within")
    p.add_argument("--aging-s", type=float, help="the relay's [balance] aging_s (unset: default)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument(
        "--output",
        default=str(Path(__file__).parent / "RESULTS.md"),
        help="the report goes atop this file, in place of the one written before",
    )
    p.add_argument("--json", help="also write the raw per-run rows here")
    p.add_argument("--keep-logs", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "client":
        return client_main(argv[1:])
    a = parse_args(argv)
    signal_setup()
    procs.raise_nofile()
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    if bad := [t for t in targets if t not in TARGETS]:
        raise SystemExit(f"unknown target: {bad}")
    logdir = Path(tempfile.mkdtemp(prefix="relay-overload-"))
    up = SimUpstream(HOST)
    up.extra = ["--parallel", str(a.parallel), "--defer"]
    rows: list[dict] = []
    try:
        up.start(logdir)
        cap = measure_capacity(up, logdir, a)
        print(f"overload: capacity measured {_f(cap)} requests/s", file=sys.stderr, flush=True)
        for rep in range(a.repeat):
            k = rep % len(targets)
            for t in targets[k:] + targets[:k]:
                print(f"overload: [{rep + 1}/{a.repeat}] {t} ...", file=sys.stderr, flush=True)
                row = run_one(t, rep, up, logdir, a)
                rows.append(row)
                print("overload:   " + brief(row), file=sys.stderr, flush=True)
                if up.exit_code() is not None:
                    raise RuntimeError(f"the simulator exited: {up.proc.tail()}")
    except KeyboardInterrupt:
        print("overload: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"overload: error: {e}\noverload: logs in {logdir}", file=sys.stderr)
        a.keep_logs = True
        return 2
    finally:
        up.stop()
        procs.stop_all()
        if not a.keep_logs:
            import shutil

            shutil.rmtree(logdir, ignore_errors=True)
    cmd = "python -m bench.overload " + " ".join(shlex.quote(x) for x in settings_of(argv))
    text = render(rows, a, targets, cap, cmd, commit())
    print(text)
    path = Path(a.output)
    path.write_text(place(text, path.read_text() if path.exists() else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"overload: wrote {path}", file=sys.stderr)
    return 0


def signal_setup() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))


if __name__ == "__main__":
    raise SystemExit(main())

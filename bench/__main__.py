"""python -m bench: direct vs relay vs nginx, side by side, in one run.

Starts the upstream (simulator, or a real llama-server with --real), then for
every scenario and target a FRESH proxy process (so its peak RSS belongs to
that scenario), samples the proxy's and the upstream's CPU time around one
run of the load client (``python -m bench.load``, its own process), stops the
proxy, and finally prints a Markdown report and writes it to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench import footprint, framings, nginx, procs, relay_conf, report, tls
from bench.upstreams import RealUpstream, SimUpstream

HOST = "127.0.0.1"
# relay_ui: the relay with its operator page open (bench/ui_poll.py polls /api/ui/state 1/s)
TARGETS = ("direct", "relay", "nginx", "baseline", "relay_ui", "relay_otel")
# relay_otel: the relay with OpenTelemetry on through the standard OTEL_* variables, exporting
# spans and metrics over OTLP/HTTP to a local sink (bench/otlp_sink.py; docs/otel.md)


def scenarios(a) -> dict[str, dict]:
    q = a.quick
    out = {
        # 200 streams x 50 tok/s, ~10 s (quick ~3 s)
        "paced": dict(
            concurrency=a.streams,
            requests=a.streams,
            max_tokens=150 if q else 500,
            interval_ms=20,
            ramp_s=0.5,
        ),
        # one short stream at a time, new connection each
        "ttft": dict(
            concurrency=1,
            requests=a.ttft_requests or (50 if q else 200),
            max_tokens=4,
            interval_ms=5,
            ramp_s=0,
        ),
        # 1000 slow streams (1 token / 1.5 s) held ~10 s (quick: 1 / s, ~3 s)
        "idle": dict(
            concurrency=a.idle_streams,
            requests=a.idle_streams,
            max_tokens=4 if q else 8,
            interval_ms=1000 if q else 1500,
            ramp_s=1.0,
        ),
        # issue 12: a TLS upstream that keeps its connections after a stream (as a hosted API
        # does), so both proxies pool them. "tls": 50 streams at a time in 3 waves (CPU per
        # event); "tls-req": short streams one at a time, a new client connection each, the
        # upstream connection pooled (CPU per request). "keep" / "keep-req": the same loads
        # against the upstream over plain HTTP, so tls - keep is what TLS costs each proxy.
        **{
            f"{up}{sfx}": dict(sc, upstream=up)
            for up in ("tls", "keep")
            for sfx, sc in (
                (
                    "",
                    dict(
                        concurrency=50,
                        requests=100 if q else 150,
                        max_tokens=100 if q else 300,
                        interval_ms=10,
                        ramp_s=0.5,
                    ),
                ),
                (
                    "-req",
                    dict(
                        concurrency=1,
                        requests=a.ttft_requests or (50 if q else 200),
                        max_tokens=4,
                        interval_ms=5,
                        ramp_s=0,
                    ),
                ),
            )
        },
        # real llama-server (tiny deterministic model, tests/e2e): sequential streams, no
        # sim knobs; the model never stops early, so every stream must carry max_tokens
        # content events (the load client checks it)
        "real": dict(
            concurrency=1,
            requests=a.real_requests or (10 if q else 100),
            max_tokens=a.real_tokens,
            interval_ms=0,
            ramp_s=0,
            extra=["--no-sim"],
        ),
    }
    # issue 15: the paced load on other servers' chunk shapes, and long real streams
    out.update(framings.scenarios(a, out["paced"]))
    return out


def start_proxy(target: str, up, logdir: Path, a) -> procs.Proc | None:
    if target == "direct":
        return None
    port = procs.free_port(HOST)
    pki = getattr(up, "pki", None)
    sink = None
    if target == "relay_otel":  # the collector first: the relay's exporter posts to it
        sink_port = procs.free_port(HOST)
        sink = procs.Proc(
            "otlp_sink",
            [sys.executable, "-m", "bench.otlp_sink", "--port", str(sink_port)],
            logdir,
        )
        time.sleep(0.3)
    if target in ("relay", "baseline", "relay_ui", "relay_otel"):
        # The upstream is in the generated config (with parallel = 4096), so
        # no --upstream here: the relay refuses both.
        conf = relay_conf.write(up.url, logdir, a.relay_config, str(pki.ca) if pki else None)
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
        env = {"PYTHONPATH": str(a.baseline_dir)} if target == "baseline" else None
        if sink is not None:
            env = {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{HOST}:{sink_port}",
                "OTEL_METRIC_EXPORT_INTERVAL": "5000",
                "OTEL_BSP_SCHEDULE_DELAY": "1000",
            }
        p = procs.Proc(target, argv, logdir, env=env)
    else:
        tmp = logdir / "nginx"
        conf = nginx.write_conf(
            tmp, HOST, port, up.host, up.port, pki.ca if pki else None, tls.NAME
        )
        p = procs.Proc("nginx", nginx.argv(tmp, conf), logdir)
    p.port = port
    p.wait_http(HOST, port, "/health")
    p.poller = sink  # (stopped with the proxy; relay_ui's is the page's poller)
    if target == "relay_ui":
        p.poller = procs.Proc(
            "ui_poll",
            [sys.executable, "-m", "bench.ui_poll", "--host", HOST, "--port", str(port)],
            logdir,
        )
    return p


def run_load(port: int, sc: dict, logdir: Path, timeout: float) -> dict:
    argv = [
        sys.executable,
        "-m",
        "bench.load",
        "--host",
        HOST,
        "--port",
        str(port),
        "--concurrency",
        str(sc["concurrency"]),
        "--requests",
        str(sc["requests"]),
        "--max-tokens",
        str(sc["max_tokens"]),
        "--interval-ms",
        str(sc["interval_ms"]),
        "--ramp-s",
        str(sc["ramp_s"]),
        "--timeout",
        str(timeout),
    ] + sc.get("extra", [])
    p = procs.Proc("load", argv, logdir)
    try:
        p.popen.wait(timeout + 60)
    finally:
        p.stop()
    lines = [ln for ln in p.out_path.read_text().splitlines() if ln.startswith("{")]
    if p.popen.returncode != 0 or not lines:
        raise RuntimeError(f"load client failed ({p.popen.returncode}): {p.tail()}")
    return json.loads(lines[-1])


def measure(scenario: str, sc: dict, target: str, up, logdir: Path, a) -> dict:
    row = {"scenario": scenario, "target": target}
    if target == "nginx" and not nginx.binary():
        return {**row, "skipped": "nginx: not found"}
    if target == "direct" and getattr(up, "pki", None):
        return {**row, "skipped": "direct: the load client speaks no TLS"}
    proxy = start_proxy(target, up, logdir, a)
    try:
        time.sleep(0.3)  # let startup settle before the window opens
        p0, s0 = (proxy.cpu_us() if proxy else 0.0), up.cpu_us()
        b0, t0 = procs.system_busy_us(), time.monotonic()
        est = sc["ramp_s"] + sc["requests"] / sc["concurrency"] * (
            sc["max_tokens"] * sc["interval_ms"] / 1000 + 1
        )
        load = run_load(proxy.port if proxy else up.port, sc, logdir, timeout=est * 3 + 30)
        p1, s1 = (proxy.cpu_us() if proxy else 0.0), up.cpu_us()
        busy, wall = procs.system_busy_us() - b0, time.monotonic() - t0
        row.update(load=load, sim_cpu_us=s1 - s0)
        # CPU used on this machine by anything but sim, proxy and load client:
        # the noise from other work, as a share of all cores.
        other = (
            busy
            - (s1 - s0)
            - (p1 - p0)
            - load.get("client_cpu_total_s", load["client_cpu_s"]) * 1e6
        )
        row["other_cpu_frac"] = max(0.0, other) / (wall * 1e6 * (os.cpu_count() or 1))
        if proxy:
            row.update(proxy_cpu_us=p1 - p0, proxy_hwm_kb=proxy.hwm_kb())
    finally:
        if proxy:
            if getattr(proxy, "poller", None) is not None:
                polled = proxy.poller.out_path.read_text()
                if proxy.name == "relay_otel":
                    row["otlp_exports"] = polled.count("export ")
                else:
                    row["ui_polls"] = polled.count("status 200")
                if proxy.name != "relay_otel":
                    proxy.poller.stop()
            proxy.stop()
            if proxy.name == "relay_otel":  # (the sink takes the relay's last export)
                proxy.poller.stop()
    if target == "nginx":
        row["nginx_upstream_errors"] = nginx.upstream_errors(logdir / "nginx")
    return row


def measure_safely(name: str, sc: dict, target: str, up, logdir: Path, a) -> dict:
    """measure(), but if the upstream died meanwhile (e.g. killed by someone
    else on a shared machine), restart it and measure once more."""
    for attempt in (1, 2):
        if up.exit_code() is not None:
            up.stop()
            up.start(logdir)
        row = measure(name, sc, target, up, logdir, a)
        rc = up.exit_code()
        if rc is None:
            return {**row, "upstream_restarts": attempt - 1}
        msg = f"upstream ({up.kind}) exited with {rc} during {name}/{target}"
        print(
            f"bench: {msg}; restarting it" + (" and measuring again" if attempt == 1 else ""),
            file=sys.stderr,
            flush=True,
        )
    raise RuntimeError(msg + " twice")


def extract_baseline(rev: str, logdir: Path) -> Path:
    """The relay package of git revision `rev`, unpacked for the 'baseline' target."""
    import subprocess
    import tarfile

    out = logdir / "baseline"
    out.mkdir()
    root = Path(__file__).resolve().parents[1]
    tar = subprocess.run(
        ["git", "-C", str(root), "archive", rev, "relay"], check=True, capture_output=True
    ).stdout
    import io

    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(out, filter="data")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="~3 s scenarios instead of ~10 s")
    p.add_argument("--repeat", type=int, default=1, help="repeat every measurement; report medians")
    p.add_argument(
        "--scenarios",
        default="paced,ttft,idle,footprint",
        help="comma list of paced,ttft,idle,footprint,tls,tls-req,keep,keep-req (tls*: a "
        "TLS upstream; keep*: the same loads over plain HTTP; footprint: start-up "
        "time and RSS per open idle stream, bench/footprint.py), paced-vllm, "
        "paced-openai, paced-events3, paced-chunks3, paced-openai-batch, "
        "real-long (bench/framings.py)",
    )
    p.add_argument("--targets", default=",".join(TARGETS), help="comma list of direct,relay,nginx")
    p.add_argument("--streams", type=int, default=200, help="paced: concurrent streams")
    p.add_argument("--idle-streams", type=int, default=1000, help="idle: open slow streams")
    p.add_argument("--ttft-requests", type=int, default=0, help="ttft: sequential requests")
    p.add_argument(
        "--footprint-streams",
        default="1000,5000",
        help="footprint: open stream counts (a fresh proxy each)",
    )
    p.add_argument("--startups", type=int, default=5, help="footprint: starts timed per target")
    p.add_argument("--real", action="store_true", help="against a real llama-server instead")
    p.add_argument("--real-requests", type=int, default=0)
    p.add_argument("--real-tokens", type=int, default=64)
    p.add_argument(
        "--real-long-requests",
        type=int,
        default=20,
        help="real-long: 500-token streams from the real llama-server",
    )
    p.add_argument(
        "--relay-config",
        help="TOML merged over the generated relay config (see bench/relay_conf.py)",
    )
    p.add_argument(
        "--output", help="report file (default bench/RESULTS.md, --real: RESULTS-real.md)"
    )
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also run the relay of git revision REV (target 'baseline'), side by side",
    )
    p.add_argument("--json", help="also write the raw per-run results here")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with child logs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["fleet"]:  # python -m bench fleet ...: bench/fleet.py
        from bench import fleet

        return fleet.main(args[1:])
    if args[:1] == ["overload"]:  # python -m bench overload ...: bench/overload.py
        from bench import overload

        return overload.main(args[1:])
    a = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    procs.raise_nofile()
    scs = scenarios(a)
    names = ["real"] if a.real else [s.strip() for s in a.scenarios.split(",") if s.strip()]
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    if a.baseline and "baseline" not in targets:
        targets.append("baseline")
    bad = [n for n in names if n not in scs and n != "footprint"] + [
        t for t in targets if t not in TARGETS
    ]
    if bad:
        raise SystemExit(f"unknown scenario/target: {bad}")
    logdir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    up = RealUpstream() if a.real else SimUpstream(HOST)
    ups = {None: up}  # by scenario "upstream": the default one, "tls", "keep"
    rows: list[dict] = []
    try:
        if "baseline" in targets:
            a.baseline_dir = extract_baseline(a.baseline or "HEAD", logdir)
        if any(scs.get(n, {}).get("upstream") is None for n in names):
            up.start(logdir)
        for n in names:
            kind = scs.get(n, {}).get("upstream")
            if kind == "real" and kind not in ups:
                ups[kind] = RealUpstream()
                ups[kind].start(logdir)
            if kind is not None and kind not in ups:
                ups[kind] = SimUpstream(HOST, tls.make(logdir / "pki") if kind == "tls" else None)
                if kind == "keep":
                    ups[kind].extra = ["--keep-alive-streams"]
                ups[kind].start(logdir)
        for rep in range(a.repeat):
            for name in names:
                if name == "footprint":  # its own loop: a fresh proxy per stream count
                    rows += footprint.run(
                        up,
                        logdir,
                        targets,
                        [int(x) for x in a.footprint_streams.split(",")],
                        a.startups,
                        footprint.INTERVAL_MS,
                        repeat=1,
                        rep=rep,
                    )
                    continue
                k = rep % len(targets)  # rotate target order between repeats
                for target in targets[k:] + targets[:k]:
                    print(
                        f"bench: [{rep + 1}/{a.repeat}] {name} -> {target} ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    row = measure_safely(
                        name, scs[name], target, ups[scs[name].get("upstream")], logdir, a
                    )
                    rows.append({**row, "repeat": rep})
                    print("bench:   " + report.brief(row), file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("bench: interrupted; stopping processes", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"bench: error: {e}\nbench: logs in {logdir}", file=sys.stderr)
        a.keep_logs = True
        if isinstance(e, (RuntimeError, TimeoutError, OSError)):
            return 2
        raise
    finally:
        for u in ups.values():
            u.stop()
        procs.stop_all()
        if not a.keep_logs:
            import shutil

            shutil.rmtree(logdir, ignore_errors=True)
    text = report.render(rows, scs, [n for n in names if n in scs], targets, a, up.kind)
    text += framings.summary(rows, names) + "\n".join(footprint.render(rows) + [""])
    print(text)
    out = (
        Path(a.output)
        if a.output
        else Path(__file__).parent
        / (
            "RESULTS-real.md"
            if a.real
            else "RESULTS-tls.md"
            if all(scs.get(n, {}).get("upstream") in ("tls", "keep") for n in names)
            else "RESULTS.md"
        )
    )
    out.write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"bench: wrote {out}", file=sys.stderr)
    return 1 if report.failures(rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

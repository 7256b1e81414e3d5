"""relay: an HTTP/1.1 relay for Server-Sent-Event LLM traffic.

Commands: `relay serve` runs the relay, `relay report` summarises and benchmarks the stored
request rows, `relay sim` runs the built-in llama-server simulator."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sqlite3
import sys
from typing import TYPE_CHECKING

from relay.app import run, worker_count
from relay.config import Config, ConfigError, load_config, parse_config
from relay.observe.notify import Notifier, State, serving_status

if TYPE_CHECKING:
    from relay.app import App
    from relay.observe.log import Log


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the relay")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--host", help="listen address (overrides [server].host)")
    p.add_argument("--port", type=int, help="listen port (overrides [server].port)")
    p.add_argument("--upstream", help="single upstream URL, e.g. http://127.0.0.1:8081")
    p.add_argument(
        "--parallel", type=int, help="with --upstream/--demo: slots of that upstream (default 4)"
    )
    p.add_argument(
        "--demo", action="store_true", help="run in front of the built-in llama-server simulator"
    )
    p.add_argument(
        "--workers",
        help="worker processes (overrides [server].workers; a number or auto: the cores the "
        "relay may use); slots, queues, budgets, rows and metrics stay relay-wide",
    )


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--workers: a number or auto, not {text!r}") from None


def build_config(args: argparse.Namespace, sim_url: str | None = None) -> Config:
    data = load_config(args.config) if args.config else {}
    server = data.setdefault("server", {})
    if args.host is not None:
        server["host"] = args.host
    if args.port is not None:
        server["port"] = args.port
    if getattr(args, "workers", None) is not None:
        server["workers"] = args.workers if args.workers == "auto" else _count(args.workers)
    url = sim_url or args.upstream
    if url:
        if data.get("upstream"):
            raise ConfigError("--upstream/--demo: the config file already has [[upstream]]")
        data["upstream"] = [
            {"name": "demo" if sim_url else "default", "url": url, "parallel": args.parallel or 4}
        ]
    if not data.get("upstream"):
        raise ConfigError("no upstream: give --upstream URL, --demo, or [[upstream]] in --config")
    return parse_config(data)


async def _serve(args: argparse.Namespace) -> int:
    from relay.app import App
    from relay.observe.log import Log

    log = Log()
    # systemd's Type=notify (observe.notify); no worker inherits its socket.
    notify = Notifier.from_environ(os.environ, log)
    # What asyncio would print as text (a callback's exception, ...) is a JSON line too.
    asyncio.get_running_loop().set_exception_handler(
        lambda _loop, ctx: log.event(
            "loop_error", message=str(ctx.get("message")), error=repr(ctx.get("exception"))[:300]
        )
    )
    sim = None
    sim_url = None
    if args.demo:
        from relay.sim.server import Simulator
        from relay.sim.state import SimDefaults

        sim = Simulator(defaults=SimDefaults(interval_ms=40.0, tokens=24))
        await sim.start()
        sim_url = f"http://127.0.0.1:{sim.port}"
        log.event("demo_simulator", url=sim_url)
    try:
        config = build_config(args, sim_url)
        workers = worker_count(config.server.workers)
        if workers > 1:
            from relay.workers.parent import ParentApp

            # Its lines whole beside the workers'.
            log.shared()
            app: App = ParentApp(config, log, workers)
        else:
            app = App(config, log)
        await app.start()
    except (ConfigError, OSError, sqlite3.Error) as exc:
        what = f"store.path {app.config.store.path!r}: " if isinstance(exc, sqlite3.Error) else ""
        log.event("relay_start_failed", error=f"{what}{exc}")
        log.flush()
        notify.send(None, f"start failed: {what}{exc}")
        if sim is not None:
            await sim.stop()
        return 2
    notify.send(State.READY, _serving(app))
    if args.demo:
        _demo_try(app, log)
    await _until_stopped(app, args, sim_url, log, notify)
    notify.send(State.STOPPING, f"draining: up to {app.config.server.drain_timeout_s:g} s")
    await app.stop()
    if sim is not None:
        await sim.stop()
    return 0


async def _until_stopped(
    app: App, args: argparse.Namespace, sim_url: str | None, log: Log, notify: Notifier
) -> None:
    """Serve until SIGTERM or SIGINT; SIGHUP reloads meanwhile."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stop() -> None:
        # A second SIGTERM or SIGINT ends the drain now (the rows are still flushed).
        if stop.is_set():
            log.event("relay_hurry")
            app.hurry()
        stop.set()

    reloads: set[asyncio.Task[None]] = set()

    # A task: a reload waits for the store off the loop.
    def on_hup() -> None:
        if not stop.is_set():
            task = loop.create_task(reload_config(app, args, sim_url, log, notify))
            reloads.add(task)
            task.add_done_callback(reloads.discard)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    await stop.wait()


def _demo_try(app: App, log: Log) -> None:
    """The demo's first request, as a command to paste."""
    host = app.config.server.host
    log.event(
        "demo_try",
        command=(
            f"curl -N http://{host}:{app.port}/v1/chat/completions "
            '-H \'Content-Type: application/json\' -d \'{"model":"demo","stream":true,'
            '"messages":[{"role":"user","content":"hi"}]}\''
        ),
    )


async def reload_config(
    app: App, args: argparse.Namespace, sim_url: str | None, log: Log, notify: Notifier
) -> None:
    """SIGHUP: read the file again (flags still override it) and apply it, or keep the
    running configuration and say why. The service manager hears `RELOADING=1`, then
    `READY=1` whatever came of it."""
    notify.send(State.RELOADING, f"reloading {args.config or 'the flags'}")
    outcome = "reload failed"
    try:
        summary = await app.reload_async(build_config(args, sim_url))
        outcome = "reloaded"
        log.event("config_reloaded", config=args.config, **summary)
    except ConfigError as exc:
        log.event("config_reload_failed", reason=str(exc), config=args.config)
        outcome = f"reload refused: {exc}"
    finally:
        notify.send(State.READY, f"{_serving(app)}; {outcome}")


def _serving(app: App) -> str:
    """The status line of a serving relay (observe.notify)."""
    s = app.config.server
    return serving_status(list(app.upstreams), s.host, app.port, worker_count(s.workers))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "sim":
        from relay.sim import cli as sim

        return sim.main(argv[1:])
    if argv and argv[0] == "report":
        from relay.report import summary as report

        return report.main(argv[1:])
    from relay import __version__

    parser = argparse.ArgumentParser(
        prog="relay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"relay {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    sub.add_parser("sim", help="run the built-in llama-server simulator (see `relay sim -h`)")
    sub.add_parser(
        "report",
        help="latency, throughput and benchmark figures (TTFT, TPOT, ITL, "
        "E2EL, goodput) of the stored request rows (see `relay report -h`)",
    )
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        try:
            return run(_serve(args))
        except ConfigError as exc:
            from relay.observe.log import Log

            Log().event("config_error", error=str(exc))
            return 2
    return 2

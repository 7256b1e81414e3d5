"""relay: an HTTP/1.1 relay for Server-Sent-Event LLM traffic.

Commands: `relay serve` runs the relay, `relay check` checks a configuration and prints what
it would serve, `relay key new` makes an API key, `relay report` summarises and benchmarks the
stored request rows, `relay sim` runs the built-in llama-server simulator."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import secrets
import signal
import sqlite3
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import msgspec

from relay.app import run, worker_count
from relay.config import (
    Config,
    ConfigError,
    KeyConfig,
    ServerConfig,
    UpstreamConfig,
    in_file,
    load_config,
    parse_config,
    quoted,
)
from relay.http.upstream_url import TargetError, parse_target
from relay.observe.log import LogFormat
from relay.observe.notify import Notifier, State, serving_status
from relay.preflight import LIMITS, check, describe

if TYPE_CHECKING:
    from relay.app import App
    from relay.observe.log import Log

# `--parallel` when `--upstream` or `--demo` make the upstream (a file's defaults to 1).
FLAG_PARALLEL = 4


class FlagError(ConfigError):
    """A flag that cannot apply (to this file); the message names the flag."""


class _Parser(argparse.ArgumentParser):
    """argparse's, its error in one line on stderr naming the flag, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message.removeprefix('argument ')}\n")


def _typed(
    struct: type[msgspec.Struct],
    name: str,
    parse: Callable[[str], object] = int,
    what: str = "a whole number",
) -> Callable[[str], object]:
    """An argparse `type` that takes what the config key `name` of `struct` takes, in its
    bounds (one rule for the file and the flag); argparse names the flag in its error."""
    kind = next(f.type for f in msgspec.structs.fields(struct) if f.name == name)

    def convert(text: str) -> object:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}, not {text!r}") from None
        try:
            return msgspec.convert(value, kind)
        except msgspec.ValidationError as exc:
            raise argparse.ArgumentTypeError(f"{exc}, not {text!r}") from None

    return convert


def _priority(text: str) -> object:
    return text if text in ("high", "normal", "low") else int(text)


def _workers(text: str) -> object:
    return text if text == "auto" else int(text)


def _host(text: str) -> str:
    # An empty value is most often an unset variable (`--host "$HOST"`), not a wish to
    # listen on every interface.
    if not text:
        raise argparse.ArgumentTypeError("empty (every interface is 0.0.0.0 or ::)")
    return text


def _upstream_url(text: str) -> str:
    try:
        parse_target(text)
    except TargetError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, not {text!r}") from None
    return text


def _config_flags(p: argparse.ArgumentParser) -> None:
    """The flags that make the configuration (`relay serve` and `relay check`)."""
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--host", type=_host, help="listen address (overrides [server].host)")
    p.add_argument(
        "--port", type=_typed(ServerConfig, "port"), help="listen port (overrides [server].port)"
    )
    p.add_argument(
        "--upstream", type=_upstream_url, help="single upstream URL, e.g. http://127.0.0.1:8081"
    )
    p.add_argument(
        "--parallel",
        type=_typed(UpstreamConfig, "parallel"),
        help=f"with --upstream/--demo: slots of that upstream (default {FLAG_PARALLEL})",
    )
    p.add_argument(
        "--workers",
        type=_typed(ServerConfig, "workers", _workers, "a number or auto"),
        help="worker processes (overrides [server].workers; a number or auto: the cores the "
        "relay may use); slots, queues, budgets, rows and metrics stay relay-wide",
    )


def _serve_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("serve", help="run the relay")
    _config_flags(p)
    p.add_argument(
        "--demo", action="store_true", help="run in front of the built-in llama-server simulator"
    )
    p.add_argument(
        "--log-format",
        choices=[f.value for f in LogFormat],
        default=LogFormat.JSON.value,
        help="log lines on stderr: one JSON object each (default), or text for a terminal",
    )


def _check_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "check",
        help="check a configuration as `relay serve` would and print what it would serve "
        "(binds no port, opens no store); exit 0, or 2 with the error",
    )
    _config_flags(p)


def _key_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("key", help="API keys (see `relay key new -h`)")
    keys = p.add_subparsers(dest="key_cmd", required=True)
    new = keys.add_parser(
        "new",
        help="a fresh secret, shown once, and its [[key]] block",
        description="Print a fresh secret on stderr, once, and the [[key]] block of the "
        "config file on stdout: its id, the sha256 of the secret, the limits given (0 or "
        "none: no limit). `relay key new --id team-a >> relay.toml` appends the block.",
    )
    new.add_argument("--id", required=True, type=_typed(KeyConfig, "id", str), help="key id")
    for name in LIMITS:
        new.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            metavar="N",
            default=0,
            type=_typed(KeyConfig, name),
            help=f"{name} (default 0: no limit)",
        )
    new.add_argument(
        "--priority",
        default="normal",
        metavar="CLASS",
        type=_typed(KeyConfig, "priority", _priority, "high, normal, low or a whole number"),
        help="priority: high, normal, low, or -100..100 (default normal)",
    )
    new.add_argument(
        "--weight",
        default=1,
        metavar="N",
        type=_typed(KeyConfig, "weight"),
        help="weight among the keys of its class (default 1)",
    )


def _flag_rules(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that cannot apply together: an error naming the flag."""
    demo = getattr(args, "demo", False)
    if args.parallel is not None and not (args.upstream or demo):
        parser.error(
            "--parallel: applies with --upstream or --demo only "
            "(an [[upstream]] in the file sets its own parallel)"
        )
    if demo and args.upstream:
        parser.error("--demo: relays to the simulator; not with --upstream")


def build_config(args: argparse.Namespace, sim_url: str | None = None) -> Config:
    """The file's configuration with the flags over it. A flag that cannot apply to the
    file is a FlagError naming the flag; the file's own errors name the file."""
    data = load_config(args.config) if args.config else {}
    url = sim_url or args.upstream
    if url and data.get("upstream"):
        flag = "--demo" if sim_url else "--upstream"
        raise FlagError(f"{flag}: {args.config} already has [[upstream]]; give one or the other")
    flags = {"host": args.host, "port": args.port, "workers": getattr(args, "workers", None)}
    given = {k: v for k, v in flags.items() if v is not None}
    server = data.setdefault("server", {}) if given else None
    # A `server` that is no table is the file's error, which parse_config names below.
    if isinstance(server, dict):
        server.update(given)
    if url:
        parallel = FLAG_PARALLEL if args.parallel is None else args.parallel
        data["upstream"] = [
            {"name": "demo" if sim_url else "default", "url": url, "parallel": parallel}
        ]
    elif not data.get("upstream"):
        if args.config:
            raise ConfigError(
                f"{args.config}: no [[upstream]]: add one, or give --upstream URL or --demo"
            )
        raise ConfigError("no upstream: give --upstream URL, --demo, or [[upstream]] in --config")
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise in_file(args.config, exc) from None


def checked_config(args: argparse.Namespace, sim_url: str | None = None) -> Config:
    """`build_config`, then what the configuration needs from outside the file
    (`preflight.check`): what `relay check` checks, `relay serve` before it starts, and
    SIGHUP before it reloads."""
    config = build_config(args, sim_url)
    try:
        check(config)
    except ConfigError as exc:
        raise in_file(args.config, exc) from None
    return config


async def _start(args: argparse.Namespace, sim_url: str | None, log: Log) -> App:
    """The relay checked and started (its workers too), or the error that stopped it."""
    from relay.app import App, worker_count

    config = checked_config(args, sim_url)
    workers = worker_count(config.server.workers)
    if workers > 1:
        from relay.workers.parent import ParentApp

        # Its lines whole beside the workers'.
        log.shared()
        app: App = ParentApp(config, log, workers)
    else:
        app = App(config, log)
    try:
        await app.start()
    except sqlite3.Error as exc:
        where = f"store.path: cannot open {config.store.path!r}: {exc}"
        raise in_file(args.config, ConfigError(where)) from None
    return app


async def _serve(args: argparse.Namespace) -> int:
    from relay.observe.log import Log

    log = Log(fmt=LogFormat(args.log_format))
    # systemd's Type=notify (observe.notify); no worker inherits its socket.
    notify = Notifier.from_environ(os.environ, log)
    # What asyncio would print as text (a callback's exception, ...) is a log line too.
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
        app = await _start(args, sim_url, log)
    except (ConfigError, OSError) as exc:
        if isinstance(exc, FlagError):
            _flag_failed("relay serve", exc)
        else:
            log.event("relay_start_failed", error=str(exc))
        log.flush()
        notify.send(None, f"start failed: {exc}")
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
    """SIGHUP: read the file again (flags still override it), check it as a start does,
    and apply it; or keep the running configuration and say why. The service manager hears
    `RELOADING=1`, then `READY=1` whatever came of it."""
    notify.send(State.RELOADING, f"reloading {args.config or 'the flags'}")
    outcome = "reload failed"
    try:
        config = checked_config(args, sim_url)
        try:
            summary = await app.reload_async(config)
        except ConfigError as exc:
            raise in_file(args.config, exc) from None
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


def _flag_failed(prog: str, exc: FlagError) -> None:
    """A flag's error as argparse writes one (`_Parser.error`)."""
    print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)


def _check(args: argparse.Namespace) -> int:
    """`relay check`: what `relay serve` would serve, on stdout; exit 0, or 2 with the error
    on stderr. It binds no port and opens no store."""
    try:
        config = checked_config(args)
    except FlagError as exc:
        _flag_failed("relay check", exc)
        return 2
    except ConfigError as exc:
        print(f"relay check: {exc}", file=sys.stderr)
        return 2
    print(f"relay check: {args.config or 'the flags'}: ok, it would serve:")
    for line in describe(config, os.getcwd()):
        print(line)
    return 0


def toml_string(text: str) -> str:
    """`text` as a TOML basic string: JSON's escapes, and DEL (raw in JSON, not in TOML)."""
    return quoted(text).replace("\x7f", "\\u007f")


def key_block(
    key_id: str,
    sha256: str,
    limits: dict[str, int],
    priority: int | str = "normal",
    weight: int = 1,
) -> str:
    """The `[[key]]` table of a key, as the config file takes it; 0 limits and the default
    priority and weight left out."""
    lines = ["[[key]]", f"id = {toml_string(key_id)}", f'sha256 = "{sha256}"']
    lines += [f"{name} = {n}" for name, n in limits.items() if n]
    if priority != "normal" and priority != 0:
        lines.append(
            f"priority = {priority}" if isinstance(priority, int) else f'priority = "{priority}"'
        )
    if weight != 1:
        lines.append(f"weight = {weight}")
    return "\n".join(lines) + "\n"


def _key_new(args: argparse.Namespace) -> int:
    """`relay key new`: the secret on stderr, once; its `[[key]]` block on stdout. A client
    sends the secret as it is (`Authorization: Bearer ...`): the relay hashes those bytes."""
    secret = "rk-" + secrets.token_urlsafe(32)
    digest = hashlib.sha256(secret.encode()).hexdigest()
    limits = {name: getattr(args, name) for name in LIMITS}
    print(key_block(args.id, digest, limits, args.priority, args.weight), end="")
    sys.stdout.flush()
    print(
        f"relay key new: the secret of key {quoted(args.id)}, shown once (the relay keeps "
        f"only its sha256):\n{secret}",
        file=sys.stderr,
    )
    return 0


def quiet_pipe(command: Callable[[], int]) -> int:
    """Run a command that prints; a reader that goes away early (`| head -1`) ends it
    quietly, with the status a shell gives a process that SIGPIPE ended (141)."""
    try:
        code = command()
        sys.stdout.flush()
    except BrokenPipeError:
        # What is still buffered would fail again at exit, with a message.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "sim":
        from relay.sim import cli as sim

        return sim.main(argv[1:])
    if argv and argv[0] == "report":
        from relay.report import summary as report

        return quiet_pipe(lambda: report.main(argv[1:]))
    from relay import __version__

    parser = _Parser(
        prog="relay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"relay {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    _check_parser(sub)
    _key_parser(sub)
    sub.add_parser("sim", help="run the built-in llama-server simulator (see `relay sim -h`)")
    sub.add_parser(
        "report",
        help="latency, throughput and benchmark figures (TTFT, TPOT, ITL, "
        "E2EL, goodput) of the stored request rows (see `relay report -h`)",
    )
    args = parser.parse_args(argv)
    if args.cmd == "key":
        return quiet_pipe(lambda: _key_new(args))
    _flag_rules(sub.choices[args.cmd], args)
    if args.cmd == "check":
        return quiet_pipe(lambda: _check(args))
    try:
        return run(_serve(args))
    except ConfigError as exc:
        from relay.observe.log import Log

        Log(fmt=LogFormat(args.log_format)).event("config_error", error=str(exc))
        return 2

"""A configuration checked as far as it can be without binding its address or opening its
store, and what it would serve, in words: `relay check` prints it (as `nginx -t`), `relay
serve` runs the same check before it starts, and SIGHUP before it reloads.

`check` reads what the configuration needs from outside the file: each upstream's key from
the environment (`auth_value_env`) and its CA file, the PostgreSQL password's variable
(`password_env`) and driver, OpenTelemetry's environment and extra. What only a start finds
out (the port in use, the store's file or server, an upstream's answer) is left to it.
`describe` and `pools` are pure.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from relay.app import worker_count
from relay.config import (
    Config,
    ConfigError,
    KeyConfig,
    UpstreamConfig,
    at_upstream,
    parse_target_url,
    store_connect,
)
from relay.observe.log import text_value
from relay.observe.otel_env import settings
from relay.observe.otel_start import available
from relay.policy.routing import Router
from relay.proxy.upstreams import upstream_auth, upstream_tls
from relay.store import POSTGRES_EXTRA_HINT
from relay.store.sqlite_file import is_memory

# The limits of a `[[key]]` (0: none), in the order the docs give them: its budgets, then
# the limits that act now.
LIMITS = (
    "requests_per_day",
    "tokens_per_day",
    "requests_per_month",
    "tokens_per_month",
    "max_concurrent",
    "requests_per_minute",
    "tokens_per_minute",
)


def _installed(module: str) -> bool:
    """Whether `module` can be imported (a finder that refuses it says no too)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def check(config: Config, environ: Mapping[str, str] = os.environ) -> None:
    """ConfigError naming the key whose outside part is missing or unreadable. The
    upstreams' keys are read from the process's environment, as the relay reads them."""
    for i, up in enumerate(config.upstream):
        with at_upstream(i, up):
            upstream_auth(up)
            upstream_tls(up, parse_target_url(up.url))
    if config.store.url is not None:
        if not _installed("psycopg"):
            raise ConfigError(
                f"store.url: PostgreSQL needs the 'postgres' extra ({POSTGRES_EXTRA_HINT})"
            )
        store_connect(config.store, environ)
    s = settings(config.otel, environ)
    if s is not None:
        available(s)


def pools(upstreams: list[UpstreamConfig]) -> dict[str, list[str]]:
    """Each pool of two or more upstreams, as requests are routed to it (`policy.routing`):
    its name and its members, in the order written."""
    return {p.name: list(p.members) for p in Router(upstreams).pools}


def _words(values: list[str]) -> str:
    return " ".join(map(text_value, values)) or "-"


def _listen(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _upstream(up: UpstreamConfig) -> str:
    return (
        f"{text_value(up.name)}: {text_value(up.url)}, parallel {up.parallel}, "
        f"queue {up.queue}, models {_words(up.models)}, aliases {_words(up.aliases)}, "
        f"fallback {_words(up.fallback)}"
    )


def _key(key: KeyConfig) -> str:
    limits = [f"{name} {getattr(key, name)}" for name in LIMITS if getattr(key, name)]
    share = [f"priority {key.priority}"] if key.rank else []
    share += [f"weight {key.weight}"] if key.weight != 1 else []
    return f"{text_value(key.id)}: {', '.join(limits) or 'no limits'}" + "".join(
        f", {s}" for s in share
    )


def _store(config: Config, cwd: str) -> str:
    s = config.store
    if s.url is not None:
        password = f"${s.password_env}" if s.password_env else "libpq's (PGPASSWORD, ~/.pgpass)"
        return f"PostgreSQL {text_value(s.url)}, password from {password}"
    if is_memory(s.path):
        return "SQLite in memory (rows and budgets end with the process)"
    return f"SQLite {text_value(os.path.normpath(os.path.join(cwd, s.path)))}"


def describe(config: Config, cwd: str, environ: Mapping[str, str] = os.environ) -> list[str]:
    """What a checked configuration would serve, one line per item: the listen address and
    workers, each upstream, each pool, a note for each catch-all past the first (it takes no
    name of its own), each key by its id with its limits (never its hash),
    whether an admin key is set, the store (a SQLite path resolved against `cwd`), and
    whether OpenTelemetry is on."""
    s = config.server
    workers = s.workers if s.workers != "auto" else f"auto ({worker_count('auto')} here)"
    lines = [f"listen    {_listen(s.host, s.port)}, workers {workers}"]
    lines += [f"upstream  {_upstream(up)}" for up in config.upstream]
    lines += [
        f"pool      {text_value(name)}: {', '.join(map(text_value, ups))}"
        for name, ups in pools(config.upstream).items()
    ]
    # Only the first catch-all takes the names no upstream lists (`policy.routing`).
    catchalls = [up.name for up in config.upstream if not up.models]
    lines += [
        f"note      {text_value(name)}: a catch-all after {text_value(catchalls[0])}, reached only"
        " as another upstream's fallback"
        for name in catchalls[1:]
    ]
    lines += [f"key       {_key(k)}" for k in config.key] or ["key       none: no key checked"]
    lines.append(f"admin key {'set' if config.admin_key_sha256 else 'not set'}")
    lines.append(f"store     {_store(config, cwd)}")
    otel = settings(config.otel, environ)
    lines.append(f"otel      {'on' if otel is not None and available(otel) else 'off'}")
    return lines

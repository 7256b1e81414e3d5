"""Typed configuration: TOML decoded by msgspec, unknown keys and out-of-range values rejected.

Structs built directly in Python (tests) skip the range checks on purpose, so tests can drive
time with small bounds; everything read from a file or the command line goes through
`load_config` / `parse_config`, which checks every constraint and names the offending key.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlsplit

import msgspec
from msgspec import Meta, Struct

from relay.http.to_upstream import check_header_name, check_static_headers
from relay.http.upstream_url import Target, TargetError, parse_target

Seconds = Annotated[float, Meta(ge=0.001, le=86400.0)]
Port = Annotated[int, Meta(ge=0, le=65535)]


class ServerConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Port = 8080
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] = 8 * 1024 * 1024
    max_header_bytes: Annotated[int, Meta(ge=1024, le=1 << 20)] = 16 * 1024
    # a chunked request body in more chunks than this is refused (413): each costs a parse step
    max_body_chunks: Annotated[int, Meta(ge=1, le=1 << 24)] = 8192
    # request-body bytes held at once over all connections; a body beyond it -> 503
    max_buffered_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 40)] = 64 * 1024 * 1024
    header_timeout_s: Seconds = 10.0
    keepalive_timeout_s: Seconds = 75.0
    drain_timeout_s: Annotated[float, Meta(ge=0.0, le=3600.0)] = 30.0
    # browser origins allowed to call the relay ("*" = any); empty = no CORS answers
    cors_origins: list[Annotated[str, Meta(min_length=1)]] = msgspec.field(default_factory=list)
    # worker processes serving the one listen address ("auto": the cores the process may
    # use); slots, queues, budgets, health, rows and metrics stay relay-wide (relay.workers)
    workers: Annotated[int, Meta(ge=1, le=512)] | Literal["auto"] = 1
    # workers: one that answers none of the parent's asks for this long is lost (killed, its
    # requests settled as crash rows, restarted)
    worker_timeout_s: Annotated[float, Meta(ge=1.0, le=3600.0)] = 5.0
    # workers: when none has served for this long (none can start), the parent exits 3
    no_workers_exit_s: Annotated[float, Meta(ge=1.0, le=86400.0)] = 60.0


class DispatcherConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    connect_timeout_s: Annotated[float, Meta(ge=0.01, le=600.0)] = 5.0
    write_timeout_s: Annotated[float, Meta(ge=0.01, le=3600.0)] = 10.0
    pool_timeout_s: Annotated[float, Meta(ge=0.0, le=3600.0)] = 5.0
    direct_read_timeout_s: Annotated[float, Meta(ge=30.0, le=600.0)] = 300.0
    stream_total_timeout_s: Annotated[float, Meta(ge=0.0, le=86400.0)] = 900.0
    stream_idle_timeout_s: Annotated[float, Meta(ge=0.0, le=86400.0)] = 300.0
    upstream_keepalive_s: Annotated[float, Meta(ge=0.0, le=3600.0)] = 4.0
    health_interval_s: Annotated[float, Meta(ge=0.0, le=3600.0)] = 5.0
    # while an upstream is down it is probed this often (and one request at a time tries it)
    down_probe_interval_s: Annotated[float, Meta(ge=0.05, le=3600.0)] = 0.5
    # keep one connected spare per upstream while it has traffic
    prewarm: bool = True
    # a streamed request's client gets a 200 event-stream head and a comment line when
    # nothing reached it for this long before the first content event; 0 = off
    heartbeat_s: Annotated[float, Meta(ge=0.0, le=3600.0)] = 15.0


class BalanceConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """`[balance]`: how a pool's members share its requests (docs/fleet.md). A pool is the
    upstreams listing one model name; `policy.affinity` holds the rules."""

    # Send a conversation to the member whose prompt cache holds its longest prefix; false:
    # the least-loaded member, ties broken by rendezvous hashing of the conversation's start.
    affinity: bool = True
    # The bounded-load slack: a member takes a request only while it holds at most
    # ceil((1 + epsilon) x the pool's mean load) requests.
    epsilon: Annotated[float, Meta(ge=0.0, le=10.0)] = 0.25
    # A waiting request is passed over for one whose conversation lives on the freed
    # member for at most this long, counted from the first time it is passed over.
    affinity_wait_s: Annotated[float, Meta(ge=0.0, le=60.0)] = 0.5
    # A request whose conversation lives on a busy member within the load bound waits for
    # that member at most this long from its arrival before it takes another member's slot;
    # "auto": twice the time the move's re-read would take, learnt from the pool's answers
    # (`policy.affinity.home_wait`), `affinity_wait_s` until an answer said.
    home_wait_s: Annotated[float, Meta(ge=0.0, le=600.0)] | Literal["auto"] = "auto"
    # The prefix table's bound (about 150 bytes an entry).
    prefix_entries: Annotated[int, Meta(ge=1, le=10_000_000)] = 100_000
    # A line of waiting requests of a lower priority class that has had no turn for this long
    # (since its oldest came, or since its last turn) takes turns with the highest class
    # waiting (docs/fairness.md): the bound on its wait under a flood.
    aging_s: Annotated[float, Meta(ge=0.0, le=3600.0)] = 5.0


class UpstreamConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    url: str
    models: list[str] = msgspec.field(default_factory=list)
    parallel: Annotated[int, Meta(ge=1, le=65536)] = 1
    queue: Annotated[int, Meta(ge=0, le=100000)] = 64
    aliases: list[str] = msgspec.field(default_factory=list)
    fallback: list[str] = msgspec.field(default_factory=list)
    # public name (model, alias, or one reaching it as a fallback; "*" for any other) -> the
    # name this upstream expects in the request body's "model"
    model_map: dict[Annotated[str, Meta(min_length=1)], Annotated[str, Meta(min_length=1)]] = (
        msgspec.field(default_factory=dict)
    )
    auth_header: str | None = None
    auth_value_env: str | None = None
    # https upstreams (`http.tls`): verify against the system store or ca_file (PEM)
    verify: bool = True
    ca_file: str | None = None
    # static headers, never secrets (`http.to_upstream`)
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    # how long an idle pooled connection is kept (unset: `proxy.upstreams.upstream_keepalive`)
    keepalive_s: Annotated[float, Meta(ge=0.0, le=3600.0)] | None = None


class KeyConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, Meta(min_length=1, max_length=128)]
    sha256: Annotated[str, Meta(pattern="^[0-9a-fA-F]{64}$")]
    requests_per_day: Annotated[int, Meta(ge=0)] = 0
    tokens_per_day: Annotated[int, Meta(ge=0)] = 0
    requests_per_month: Annotated[int, Meta(ge=0)] = 0
    tokens_per_month: Annotated[int, Meta(ge=0)] = 0
    # Limits that act now (`policy.limits`; 0: none): requests admitted and not settled (in
    # flight plus queued), and a sliding minute of requests and tokens.
    max_concurrent: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    requests_per_minute: Annotated[int, Meta(ge=0)] = 0
    tokens_per_minute: Annotated[int, Meta(ge=0)] = 0
    # The queue serves a higher class first (`high` 1, `normal` 0, `low` -1, or any integer
    # from -100 to 100); within a class, keys take turns by `weight`.
    priority: Annotated[int, Meta(ge=-100, le=100)] | Literal["high", "normal", "low"] = "normal"
    weight: Annotated[int, Meta(ge=1, le=1000)] = 1

    @property
    def rank(self) -> int:
        """The priority as a number: higher first."""
        if isinstance(self.priority, int):
            return self.priority
        return _RANKS[self.priority]


_RANKS = {"high": 1, "normal": 0, "low": -1}


class BudgetConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    # tokens reserved for the completion when a request names no max_tokens / n_predict
    default_max_tokens: Annotated[int, Meta(ge=1, le=10_000_000)] = 1024


class StoreConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    path: str = "relay.db"
    retention_days: Annotated[float, Meta(ge=0.0, le=36500.0)] = 30.0
    # PostgreSQL instead of `path` (docs/postgresql.md): several relays share the rows
    # and the budgets. The password comes from the environment variable named here, never
    # from the file; rows wait in `spill_path` while the server is unreachable.
    url: str | None = None
    password_env: Annotated[str, Meta(pattern="^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    # default: relay-spill.jsonl in the working directory
    spill_path: str | None = None
    # a reservation of a relay that stopped renewing it (died) expires after this long
    reservation_ttl_s: Annotated[float, Meta(ge=0.05, le=86400.0)] = 30.0


class OtelConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """`[otel]`: OpenTelemetry over OTLP (docs/otel.md, the `otel` extra). Each key is its
    standard OTEL_* environment variable's, which gives what the file leaves unset:
    `disabled` is OTEL_SDK_DISABLED; `endpoint` OTEL_EXPORTER_OTLP_ENDPOINT (the signals'
    paths appended), `traces_endpoint` and `metrics_endpoint` OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    and OTEL_EXPORTER_OTLP_METRICS_ENDPOINT (as they are), `protocol`
    OTEL_EXPORTER_OTLP_PROTOCOL, `timeout_ms` OTEL_EXPORTER_OTLP_TIMEOUT; `service_name`
    OTEL_SERVICE_NAME (default "relay"); `traces_sampler` OTEL_TRACES_SAMPLER; `traces` and
    `metrics` false are OTEL_TRACES_EXPORTER=none and OTEL_METRICS_EXPORTER=none."""

    disabled: bool = False
    endpoint: str | None = None
    traces_endpoint: str | None = None
    metrics_endpoint: str | None = None
    protocol: Literal["http/protobuf", "grpc"] | None = None
    timeout_ms: Annotated[int, Meta(ge=1, le=600_000)] | None = None
    service_name: str | None = None
    resource_attributes: dict[str, str] = msgspec.field(default_factory=dict)
    traces_sampler: (
        Literal[
            "always_on",
            "always_off",
            "traceidratio",
            "parentbased_always_on",
            "parentbased_always_off",
            "parentbased_traceidratio",
        ]
        | None
    ) = None
    traces_sampler_arg: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    metric_export_interval_ms: Annotated[int, Meta(ge=1, le=86_400_000)] | None = None
    bsp_schedule_delay_ms: Annotated[int, Meta(ge=1, le=86_400_000)] | None = None
    bsp_max_queue_size: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    traces: bool = True
    metrics: bool = True
    # gen_ai.provider.name; unset: the API's (openai, anthropic; llama.cpp's own routes)
    provider_name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None


class Config(Struct, forbid_unknown_fields=True, kw_only=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    dispatcher: DispatcherConfig = msgspec.field(default_factory=DispatcherConfig)
    upstream: list[UpstreamConfig] = msgspec.field(default_factory=list)
    key: list[KeyConfig] = msgspec.field(default_factory=list)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    budget: BudgetConfig = msgspec.field(default_factory=BudgetConfig)
    balance: BalanceConfig = msgspec.field(default_factory=BalanceConfig)
    admin_key_sha256: Annotated[str, Meta(pattern="^[0-9a-fA-F]{64}$")] | None = None
    # [otel]: OpenTelemetry on (the environment can also say so)
    otel: OtelConfig | None = None


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key."""


def parse_target_url(url: str) -> Target:
    """An `[[upstream]].url` -> Target (`http.upstream_url`); ConfigError naming the key."""
    try:
        return parse_target(url)
    except TargetError as exc:
        raise ConfigError(f"url: {exc}") from None


def parse_url(url: str) -> tuple[str, int]:
    """`http(s)://host[:port][/prefix]` -> (host, port)."""
    t = parse_target_url(url)
    return t.host, t.port


# ---- where an error is: every ConfigError names its key in one style. A key path is dotted
# from the document's top; an `[[array]]` item is named by its position and, when it has one,
# its name or id: `upstream[1] (name "b").fallback`, `key[0] (id "alice").tokens_per_day`. The
# command line puts the file in front (`relay.toml: server.port: ...`; `relay.cli`).


def quoted(text: str) -> str:
    """A name as an error message shows it: in double quotes, control characters escaped."""
    return msgspec.json.encode(text).decode()


def item_path(table: str, index: int, item: object) -> str:
    """`table[index]`, with the item's name (or id) when it has a usable one."""
    where = f"{table}[{index}]"
    if isinstance(item, Mapping):
        for label in ("name", "id"):
            value = item.get(label)
            if isinstance(value, str) and value:
                return f"{where} ({label} {quoted(value)})"
    return where


def upstream_path(index: int, up: UpstreamConfig) -> str:
    return item_path("upstream", index, {"name": up.name})


def key_path(index: int, key: KeyConfig) -> str:
    return item_path("key", index, {"id": key.id})


_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]|(\[\.\.\.\])")


def _steps(where: str) -> list[str | int]:
    """msgspec's `$.upstream[0].model_map[...]` -> ["upstream", 0, "model_map", "[...]"]."""
    return [
        name or (int(index) if index else any_key)
        for name, index, any_key in _STEP.findall(where.removeprefix("$"))
    ]


def _dotted(steps: list[str | int], data: object) -> str:
    """The key path of `steps` in `data`, each array item labelled by `item_path`."""
    out, node, table = "", data, ""
    for step in steps:
        if isinstance(step, int):
            node = node[step] if isinstance(node, list) and 0 <= step < len(node) else None
            out = out.removesuffix(table) + item_path(table, step, node)
        elif step == "[...]":
            out, node = out + step, None
        else:
            table = step
            node = node.get(step) if isinstance(node, Mapping) else None
            out += f".{step}" if out else step
    return out


def _struct_at(steps: list[str | int]) -> type[Struct] | None:
    """The struct a key path leads to in `Config` (None: not a struct)."""
    info: msgspec.inspect.Type = msgspec.inspect.type_info(Config)
    for step in [*steps, None]:
        while isinstance(info, msgspec.inspect.UnionType | msgspec.inspect.ListType):
            if isinstance(info, msgspec.inspect.ListType):
                info = info.item_type
            else:
                structs = [t for t in info.types if isinstance(t, msgspec.inspect.StructType)]
                if not structs:
                    return None
                info = structs[0]
        if not isinstance(info, msgspec.inspect.StructType):
            return None
        if step is None:
            return info.cls
        if isinstance(step, int):
            continue
        fields = {f.name: f.type for f in info.fields}
        if step not in fields:
            return None
        info = fields[step]
    return None


def did_you_mean(name: str, struct: type[Struct] | None) -> str:
    """The nearest of `struct`'s keys to an unknown `name`, as a hint to append (`prot` in
    ServerConfig: "; did you mean port?"); "" when none is near."""
    if struct is None:
        return ""
    near = difflib.get_close_matches(name, struct.__struct_fields__, n=1)
    return f"; did you mean {near[0]}?" if near else ""


def _key_error(msg: str, data: object) -> str:
    """msgspec's message with the key path it names first (`upstream[0] (name "a").parallel:
    Expected ...`); an unknown key is named itself, with the nearest known one."""
    text, sep, where = msg.rpartition(" - at `")
    if not sep:
        text, where = msg, "$"
    where = where.rstrip("`")
    if where.startswith("key` in `"):
        where, text = where.removeprefix("key` in `"), f"a key: {text}"
    steps = _steps(where)
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", text, re.S)
    if unknown:
        name = unknown.group(1)
        return (
            f"{_dotted([*steps, name], data)}: unknown key{did_you_mean(name, _struct_at(steps))}"
        )
    missing = re.fullmatch(r"Object missing required field `(.*)`", text, re.S)
    if missing:
        return f"{_dotted([*steps, missing.group(1)], data)}: required, missing"
    return f"{_dotted(steps, data) or '<top>'}: {text}"


def _unique(table: str, label: str, values: list[str], paths: list[str]) -> None:
    """ConfigError naming the first item whose `label` an earlier item has too."""
    first: dict[str, int] = {}
    for i, value in enumerate(values):
        if value in first:
            raise ConfigError(f"{paths[i]}.{label}: not unique, {table}[{first[value]}] has it too")
        first[value] = i


def check(cfg: Config) -> Config:
    """Cross-field rules msgspec constraints cannot express.

    A `max_buffered_body_bytes` below `max_body_bytes` would answer 503 forever to every
    body between them."""
    s = cfg.server
    if s.max_buffered_body_bytes < s.max_body_bytes:
        raise ConfigError(
            f"server.max_buffered_body_bytes ({s.max_buffered_body_bytes}) must be at least "
            f"server.max_body_bytes ({s.max_body_bytes}): a body the relay accepts must fit"
        )
    names = [u.name for u in cfg.upstream]
    _unique("upstream", "name", names, [upstream_path(i, u) for i, u in enumerate(cfg.upstream)])
    for i, up in enumerate(cfg.upstream):
        with at_upstream(i, up):
            check_upstream(up, names)
    ids = [k.id for k in cfg.key]
    _unique("key", "id", ids, [key_path(i, k) for i, k in enumerate(cfg.key)])
    return cfg


@contextmanager
def at_upstream(index: int, up: UpstreamConfig) -> Iterator[None]:
    """A ConfigError raised inside names its key under the upstream (`fallback: ...`,
    `relay.proxy.upstreams`); it leaves with the upstream's path in front."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{upstream_path(index, up)}.{exc}") from None


def check_upstream(up: UpstreamConfig, names: list[str]) -> None:
    """One `[[upstream]]`'s cross-field rules; `names`: every upstream's name, in order.
    Its `auth_header` is checked here, its value (from the environment) where the upstream
    reads it. An error names the key under the upstream (`at_upstream` puts it in place)."""
    target = parse_target_url(up.url)
    if not target.tls and (up.ca_file is not None or not up.verify):
        raise ConfigError(f"{'ca_file' if up.ca_file else 'verify'}: applies to https:// only")
    if up.ca_file is not None and not up.verify:
        raise ConfigError("ca_file: with verify = false it verifies nothing")
    try:
        check_static_headers(up.headers, up.auth_header)
    except ValueError as exc:
        raise ConfigError(f"headers: {exc}") from None
    for fb in up.fallback:
        if fb not in names or fb == up.name:
            raise ConfigError(f"fallback: unknown upstream {quoted(fb)}")
    if (up.auth_header is None) != (up.auth_value_env is None):
        given = "auth_header" if up.auth_value_env is None else "auth_value_env"
        raise ConfigError(f"{given}: auth_header and auth_value_env go together")
    if up.auth_header is not None:
        try:
            check_header_name(up.auth_header)
        except ValueError as exc:
            raise ConfigError(f"auth_header: {exc}") from None


def check_store(cfg: StoreConfig, raw: Mapping[str, object]) -> None:
    """`url` is the alternative to `path` (both set is an error); a password never in it."""
    if cfg.url is None:
        for name in ("password_env", "spill_path", "reservation_ttl_s"):
            if name in raw:
                raise ConfigError(f"store.{name}: applies to store.url (PostgreSQL) only")
        return
    if "path" in raw:
        raise ConfigError("store: give either path (SQLite) or url (PostgreSQL), not both")
    try:
        check_pg_url(cfg.url)
    except PgUrlError as exc:
        raise ConfigError(f"store.url: {exc}") from None


def in_file(path: str | None, exc: ConfigError) -> ConfigError:
    """A file's error with the file in front (`relay.toml: server.port: ...`)."""
    return ConfigError(f"{path}: {exc}") if path else exc


def parse_config(data: Mapping[str, object]) -> Config:
    """The checked configuration of a TOML document (`load_config`), or ConfigError."""
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_key_error(str(exc), data)) from None
    store = data.get("store")
    check_store(cfg.store, store if isinstance(store, dict) else {})
    return check(cfg)


def load_config(path: str) -> dict[str, Any]:
    """Read a TOML file into a plain dict (validated later by `parse_config`): a TOML
    document, whose values may be anything TOML holds."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not TOML: {exc}") from None


# ---- `[store].url`: a PostgreSQL URL checked before anything connects, and how it connects.
# The password never sits in the file: a URL carrying one (`user:secret@host` or
# `?password=`) is refused, and `[store].password_env` names the environment variable that
# holds it. Everything else is libpq's (host, port, dbname, sslmode, ... and the PG*
# environment variables), since psycopg hands the URL to libpq as it is.

PG_SCHEMES = ("postgresql", "postgres")


class PgUrlError(ValueError):
    """A `[store].url` that is not a PostgreSQL URL the relay connects with."""


def is_pg_url(text: str | None) -> bool:
    """Whether `text` names a PostgreSQL database (`postgresql://`, `postgres://`)."""
    return text is not None and "://" in text and text.split("://", 1)[0].lower() in PG_SCHEMES


def check_pg_url(url: str) -> None:
    """PgUrlError unless `url` is a postgresql:// URL without a password in it."""
    if not is_pg_url(url):
        raise PgUrlError("must be a postgresql:// (or postgres://) URL")
    # Reading the port checks it: a bad one raises ValueError.
    try:
        parts = urlsplit(url)
        _ = parts.port
    except ValueError as exc:
        raise PgUrlError(f"not a valid URL ({exc})") from None
    netloc = parts.netloc.rpartition("@")[0]
    if ":" in netloc:
        raise PgUrlError(
            "must not carry a password: name an environment variable in store.password_env instead"
        )
    if any(k.lower() == "password" for k, _ in parse_qsl(parts.query)):
        raise PgUrlError(
            "must not carry password=: name an environment variable in store.password_env instead"
        )


def pg_connect_kwargs(
    url: str, password_env: str | None, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """psycopg.connect(**kwargs): the URL, and the password read from the environment.
    KeyError naming the variable if it is not set."""
    kw = {"conninfo": url}
    if password_env:
        if password_env not in environ:
            raise KeyError(password_env)
        kw["password"] = environ[password_env]
    return kw


def store_connect(cfg: StoreConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`pg_connect_kwargs` of `[store]` (its `url` set): ConfigError naming
    `store.password_env` when the variable it names is not set."""
    try:
        return pg_connect_kwargs(cfg.url or "", cfg.password_env, environ)
    except KeyError as exc:
        raise ConfigError(
            f"store.password_env: environment variable {exc.args[0]} is not set"
        ) from None

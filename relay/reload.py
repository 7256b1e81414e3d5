"""A new configuration applied to a running relay (SIGHUP), as nginx reloads.

Everything is built and checked first; only then is anything swapped, in one synchronous
step, so a bad file changes nothing. What changes:

- keys and budgets: new keys, new limits; a window kept across the reload keeps its used and
  reserved figures, a new one is rebuilt from the rows of the requests settled before the
  reload (the store's writer reads them once they are committed, off the event loop: a
  locked database or a server that does not answer delays nothing else, and refuses the
  reload after RESTORE_WAIT_S), and the requests settled meanwhile and those in flight are
  charged to it when they settle (policy.budget);
- upstreams: added ones start; removed ones take no new request, and their pools are closed
  once their streams are done; one whose URL changed is a new upstream under the same name
  (its metrics carry on); otherwise slots, queue, models, fallback, auth, static headers,
  keep-alive and TLS settings (new connections: ca_file read again) change in place;
- timeouts and the rest of `[dispatcher]`, `[server]` bounds (the relay-wide body bound
  `max_buffered_body_bytes` included), `[budget]`, retention.

Streams in flight finish on what they started with (their exchange holds its own stall
policy, upstream and connection). The listen address and the store path need a restart:
a file that changes them is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ssl
import time
from dataclasses import dataclass
from typing import Protocol, TypedDict

import msgspec

from relay.config import Config, ConfigError, DispatcherConfig, UpstreamConfig, at_upstream
from relay.http.to_upstream import fixed_headers
from relay.observe.metrics import Registry
from relay.policy.budget import Budgets, window_bounds
from relay.policy.cors import Cors
from relay.policy.keys import Auth
from relay.policy.routing import Router
from relay.proxy.body_memory import BodyBytes
from relay.proxy.slots import Board
from relay.proxy.upstreams import (
    Upstream,
    upstream_auth,
    upstream_keepalive,
    upstream_tls,
)
from relay.store.interface import RowStore
from relay.stream.stall import StallPolicy

RESTORE_WAIT_S = 2.0


class Reloadable(Protocol):
    """What a reload reads and replaces of the relay process (relay.app.App)."""

    config: Config
    upstreams: dict[str, Upstream]
    board: Board
    retired: list[Upstream]
    router: Router
    auth: Auth
    cors: Cors
    policy: StallPolicy

    @property
    def budgets(self) -> Budgets: ...
    @property
    def store(self) -> RowStore: ...
    @property
    def registry(self) -> Registry: ...
    @property
    def bodies(self) -> BodyBytes: ...
    @property
    def draining(self) -> bool: ...

    def new_upstream(self, cfg: UpstreamConfig, d: DispatcherConfig) -> Upstream: ...

    def start_probes(self) -> None: ...


class UpstreamChanged(TypedDict):
    """An upstream kept across a reload, and the keys of its `[[upstream]]` that changed."""

    upstream: str
    changed: list[str]


class Summary(TypedDict):
    """What a reload changed: the upstreams now, those added and removed, each kept one
    whose keys changed (`url` among them: a new upstream under the same name), and how many
    keys."""

    upstreams: list[str]
    added: list[str]
    removed: list[str]
    changed: list[UpstreamChanged]
    keys: int


def changed_keys(old: UpstreamConfig, new: UpstreamConfig) -> list[str]:
    """The keys of an `[[upstream]]` that differ, in the schema's order: names only (a
    header's value is not for the log)."""
    return [path.removeprefix(".") for path in changed_paths("", old, new)]


# An upstream kept across the reload, with what it gets: its configuration, key and TLS.
_InPlace = tuple[Upstream, UpstreamConfig, tuple[bytes, bytes] | None, ssl.SSLContext | None]


@dataclass
class _Plan:
    """A new configuration built and checked, not applied yet."""

    old: Config
    new: Config
    # The budgets' generation when it was built.
    generation: int
    ups: dict[str, Upstream]
    in_place: list[_InPlace]
    added: list[str]
    changed: list[str]
    # Every kept upstream whose keys changed, and which.
    edits: list[UpstreamChanged]
    router: Router
    auth: Auth
    cors: Cors
    policy: StallPolicy
    # The (key, kind) windows it creates.
    fresh: list[tuple[str, str]]


def apply(app: Reloadable, new: Config) -> Summary:
    """Apply `new` to `app`, or raise ConfigError leaving it as it was; a summary. New
    windows' rows are waited for in the calling thread (`apply_async` waits off the loop:
    SIGHUP's way)."""
    plan = prepare(app, new)
    rebuilt: dict[tuple[str, str], tuple[int, int]] = {}
    if plan.fresh:
        asked = _ask_rows(app, plan)
        try:
            rebuilt = dict(zip(plan.fresh, asked.result(RESTORE_WAIT_S)))
        except Exception as exc:
            asked.cancel()
            app.budgets.unstage()
            raise _cannot(exc) from None
    return swap(app, plan, rebuilt)


async def apply_async(app: Reloadable, new: Config) -> Summary:
    """As `apply`; the event loop goes on while the store reads the rows of new windows
    (a locked database, a PostgreSQL that does not answer: the reload is refused after
    RESTORE_WAIT_S, and nothing else waited for it)."""
    plan = prepare(app, new)
    rebuilt: dict[tuple[str, str], tuple[int, int]] = {}
    if plan.fresh:
        asked = _ask_rows(app, plan)
        try:
            used = await asyncio.wait_for(asyncio.wrap_future(asked), RESTORE_WAIT_S)
        except asyncio.CancelledError:
            # The relay stops.
            app.budgets.unstage()
            raise
        except Exception as exc:
            # Waited for in vain: the read is cancelled.
            app.budgets.unstage()
            raise _cannot(exc) from None
        if app.draining or app.config is not plan.old or app.budgets.generation != plan.generation:
            app.budgets.unstage()
            raise ConfigError(
                "the relay changed while the store was read (stopping, or another reload);"
                " nothing changed"
            )
        rebuilt = dict(zip(plan.fresh, used))
    return swap(app, plan, rebuilt)


def _ask_rows(app: Reloadable, plan: _Plan) -> concurrent.futures.Future[list[tuple[int, int]]]:
    """The used figures of the windows the plan creates, in its order, from the rows of the
    requests settled until now: the store's writer reads them at this point of its queue,
    and a request settled meanwhile is charged by the budgets instead (`Budgets.stage`)."""
    now = time.time()
    app.budgets.stage()
    return app.store.usage_read([(k, window_bounds(kind, now)[0]) for k, kind in plan.fresh])


def _cannot(exc: BaseException) -> ConfigError:
    why = f"not read within {RESTORE_WAIT_S}s" if isinstance(exc, TimeoutError) else str(exc)
    return ConfigError(
        f"key: the usage of new limits cannot be rebuilt from the store ({why}); nothing changed"
    )


def changed_paths(what: str, a: object, b: object) -> list[str]:
    """The key paths under `what` whose values differ: a table's own keys when both sides
    are the same table (`otel.endpoint`), else `what` itself."""
    if isinstance(a, msgspec.Struct) and type(a) is type(b):
        return [
            path
            for name in a.__struct_fields__
            for path in changed_paths(f"{what}.{name}", getattr(a, name), getattr(b, name))
        ]
    return [] if a == b else [what]


def needs_restart(what: str, a: object, b: object) -> str:
    """Why a reload is refused: the keys that changed, with the values of a plain one (a
    table's contents are not printed)."""
    keys = changed_paths(what, a, b)
    if keys != [what]:
        return f"{', '.join(keys)}: changing {'it' if len(keys) == 1 else 'them'} needs a restart"
    if isinstance(a, msgspec.Struct) or isinstance(b, msgspec.Struct):
        return f"{what}: {'added' if a is None else 'removed'}, which needs a restart"
    return f"{what}: changing it needs a restart ({a!r} -> {b!r})"


def prepare(app: Reloadable, new: Config) -> _Plan:
    """Build and check everything `new` needs (ConfigError: nothing has changed)."""
    old = app.config
    for what, a, b in (
        ("server.host", old.server.host, new.server.host),
        ("server.port", old.server.port, new.server.port),
        ("store.path", old.store.path, new.store.path),
        ("store.url", old.store.url, new.store.url),
        ("store.spill_path", old.store.spill_path, new.store.spill_path),
        ("otel", old.otel, new.otel),
        ("server.workers", old.server.workers, new.server.workers),
    ):
        if a != b:
            raise ConfigError(needs_restart(what, a, b))
    if not new.upstream:
        raise ConfigError("upstream: at least one [[upstream]] is required")
    d = new.dispatcher
    ups: dict[str, Upstream] = {}
    in_place: list[_InPlace] = []
    added: list[str] = []
    changed: list[str] = []
    edits: list[UpstreamChanged] = []
    for i, cfg in enumerate(new.upstream):
        cur = app.upstreams.get(cfg.name)
        keys = changed_keys(cur.cfg, cfg) if cur is not None else []
        if keys:
            edits.append({"upstream": cfg.name, "changed": keys})
        if cur is not None and cur.cfg.url == cfg.url:
            with at_upstream(i, cfg):
                in_place.append((cur, cfg, upstream_auth(cfg), upstream_tls(cfg, cur.target)))
            ups[cfg.name] = cur
            continue
        with at_upstream(i, cfg):
            up = app.new_upstream(cfg, d)
        if cur is not None:
            # The same name: its counters carry on.
            up.metrics = cur.metrics
            up.metrics.parallel = cfg.parallel
            changed.append(cfg.name)
        else:
            added.append(cfg.name)
        ups[cfg.name] = up
    return _Plan(
        old,
        new,
        app.budgets.generation,
        ups,
        in_place,
        added,
        changed,
        edits,
        Router(new.upstream),
        Auth(new.key, new.admin_key_sha256),
        Cors(new.server.cors_origins),
        StallPolicy(d.stream_idle_timeout_s, d.stream_total_timeout_s, d.direct_read_timeout_s),
        app.budgets.fresh_windows(new.key),
    )


def swap(app: Reloadable, plan: _Plan, rebuilt: dict[tuple[str, str], tuple[int, int]]) -> Summary:
    """Apply a plan (cannot fail: one synchronous step); `rebuilt`: its new windows' used
    figures (`_ask_rows`)."""
    new, d, ups = plan.new, plan.new.dispatcher, plan.ups
    for up, cfg, up_auth, up_tls in plan.in_place:
        up.cfg, up.auth, up.static, up.tls = cfg, up_auth, fixed_headers(cfg.headers), up_tls
        up.health.probing = d.health_interval_s > 0
        up.slots.resize(cfg.parallel, cfg.queue)
        up.metrics.parallel = cfg.parallel
        pool = up.pool
        pool.keepalive_s = upstream_keepalive(cfg, up.target, d.upstream_keepalive_s)
        pool.connect_timeout_s = d.connect_timeout_s
        pool.prewarm = d.prewarm and pool.keepalive_s > 0
        pool.use_tls(up_tls)
    removed = [name for name in app.upstreams if name not in ups or name in plan.changed]
    app.retired.extend(up for name, up in app.upstreams.items() if ups.get(name) is not up)
    app.config = new
    app.upstreams = ups
    app.router = plan.router
    # The pools are looked up again; an upstream removed or replaced holds no prompt here.
    app.board.configure(new.balance, new.key)
    app.board.rebind()
    for name in removed:
        app.board.forget_member(name)
    app.auth = plan.auth
    app.cors = plan.cors
    app.policy = plan.policy
    # Bodies held stay held.
    app.bodies.limit = new.server.max_buffered_body_bytes
    app.registry.set_upstreams([up.metrics for up in ups.values()])
    app.store.retention_days = new.store.retention_days
    app.budgets.reload(new.key, rebuilt, time.time())
    app.start_probes()
    return {
        "upstreams": list(ups),
        "added": plan.added,
        "removed": [n for n in removed if n not in plan.changed],
        "changed": plan.edits,
        "keys": len(new.key),
    }

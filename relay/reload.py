"""A new configuration applied to a running relay (SIGHUP), as nginx reloads.

Everything is built and checked first; only then is anything swapped, in one synchronous
step, so a bad file changes nothing. What changes:

- keys and budgets: new keys, new limits; a window kept across the reload keeps its used and
  reserved figures, a new one is rebuilt from the rows (flushed first, read before the swap),
  and requests in flight then are charged to it when they settle;
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

import sqlite3
import time

from relay.config import Config, ConfigError
from relay.http.to_upstream import fixed_headers
from relay.policy.budget import window_bounds
from relay.policy.cors import Cors
from relay.policy.keys import Auth
from relay.policy.routing import Router
from relay.proxy.upstreams import (
    Upstream,
    upstream_auth,
    upstream_keepalive,
    upstream_tls,
)
from relay.stream.stall import StallPolicy

RESTORE_FLUSH_S = 2.0


def restored_usage(app, windows: list[tuple[str, str]], now: float) -> dict:
    """The used figures of the windows a reload creates, from the rows: every row put so far
    is committed first (a request that ended a moment ago counts; those still in flight are
    charged when they settle, policy.budget). ConfigError if the store cannot say: the
    reload then changes nothing."""
    if not windows:
        return {}
    try:
        app.store.flush(RESTORE_FLUSH_S)
        out = {}
        for key_id, kind in windows:
            start, _ = window_bounds(kind, now)
            out[key_id, kind] = app.store.usage_since(key_id, start, served_only=True)
        return out
    except (RuntimeError, TimeoutError, OSError, sqlite3.Error) as exc:  # (OSError: PostgreSQL)
        raise ConfigError(
            f"key: the usage of new limits cannot be rebuilt from the store "
            f"({exc}); nothing changed"
        ) from None


def apply(app, new: Config) -> dict:
    """Apply `new` to `app`, or raise ConfigError leaving it as it was; a summary."""

    old = app.config
    for what, a, b in (
        ("server.host", old.server.host, new.server.host),
        ("server.port", old.server.port, new.server.port),
        ("store.path", old.store.path, new.store.path),
        ("store.url", old.store.url, new.store.url),
        ("store.spill_path", old.store.spill_path, new.store.spill_path),
    ):
        if a != b:
            raise ConfigError(f"{what}: changing it needs a restart ({a!r} -> {b!r})")
    if not new.upstream:
        raise ConfigError("upstream: at least one [[upstream]] is required")
    d = new.dispatcher
    # ---- build (may raise: nothing has changed yet) ----
    ups: dict = {}
    in_place: list = []
    added, changed = [], []
    for cfg in new.upstream:
        cur = app.upstreams.get(cfg.name)
        if cur is not None and cur.cfg.url == cfg.url:
            in_place.append((cur, cfg, upstream_auth(cfg), upstream_tls(cfg, cur.target)))
            ups[cfg.name] = cur
            continue
        up = Upstream(cfg, d.upstream_keepalive_s, d.prewarm, d.connect_timeout_s)
        if cur is not None:
            up.metrics = cur.metrics  # same name: its counters carry on
            up.metrics.parallel = cfg.parallel
            changed.append(cfg.name)
        else:
            added.append(cfg.name)
        ups[cfg.name] = up
    router = Router(new.upstream)
    auth = Auth(new.key, new.admin_key_sha256)
    cors = Cors(new.server.cors_origins)
    policy = StallPolicy(d.stream_idle_timeout_s, d.stream_total_timeout_s, d.direct_read_timeout_s)
    restored = restored_usage(app, app.budgets.fresh_windows(new.key), time.time())
    # ---- swap (cannot fail) ----
    for up, cfg, up_auth, up_tls in in_place:
        up.cfg, up.auth, up.static, up.tls = cfg, up_auth, fixed_headers(cfg.headers), up_tls
        up.slots.resize(cfg.parallel, cfg.queue)
        up.metrics.parallel = cfg.parallel
        pool = up.pool
        pool.keepalive_s = upstream_keepalive(cfg, up.target, d.upstream_keepalive_s)
        pool.connect_timeout_s = d.connect_timeout_s
        pool.prewarm = d.prewarm and pool.keepalive_s > 0
        pool.use_tls(up_tls)
    removed = [name for name in app.upstreams if name not in ups or name in changed]
    app.retired.extend(up for name, up in app.upstreams.items() if ups.get(name) is not up)
    app.config = new
    app.upstreams = ups
    app.router = router
    app.auth = auth
    app.cors = cors
    app.policy = policy
    app.dispatcher.bodies.limit = new.server.max_buffered_body_bytes  # bodies held stay held
    app.registry.set_upstreams([up.metrics for up in ups.values()])
    app.store.retention_days = new.store.retention_days
    now = time.time()
    app.budgets.reload(new.key)
    for (key_id, kind), (requests, tokens) in restored.items():
        app.budgets.restore(key_id, kind, requests, tokens, now)
    app.start_probes()
    return {
        "upstreams": list(ups),
        "added": added,
        "removed": [n for n in removed if n not in changed],
        "changed": changed,
        "keys": len(new.key),
    }

"""One configured upstream as the relay holds it: address, TLS, pool, slots, health, metrics.

Built at start and again by a reload (a changed URL is a new upstream under the same name);
what it reads from the environment (its key) and from disk (its CA file) is read here, and a
failure names the configuration key under the upstream (`auth_value_env: ...`): the caller
puts the upstream's path in front (`config.at_upstream`).
"""

from __future__ import annotations

import asyncio
import os
import ssl

from relay.config import ConfigError, UpstreamConfig, parse_target_url
from relay.http.tls import client_context
from relay.http.to_upstream import check_header_value, fixed_headers
from relay.http.upstream_url import Target
from relay.observe.metrics import UpstreamMetrics, UpstreamState
from relay.proxy.health import Health
from relay.proxy.pool import Pool
from relay.proxy.slots import SlotPool, Slots

# An idle pooled connection to an https upstream (a hosted API keeps one open for minutes,
# and a new one costs a TLS handshake) is kept this long unless `keepalive_s` says otherwise.
TLS_KEEPALIVE_S = 60.0


def upstream_auth(cfg: UpstreamConfig) -> tuple[bytes, bytes] | None:
    """The header the upstream wants, its value read from the environment (never the file),
    at start and at each reload: a value that would not stay one header value (a CR or LF
    would add lines to every request) is refused naming the key, never quoting the value."""
    if not cfg.auth_header:
        return None
    where = f"auth_value_env: environment variable {cfg.auth_value_env}"
    value = os.environ.get(cfg.auth_value_env or "")
    if value is None:
        raise ConfigError(f"{where} is not set")
    try:
        check_header_value(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: the value has {exc}") from None
    # Its bytes as the environment holds them.
    return cfg.auth_header.encode(), os.fsencode(value)


def upstream_tls(cfg: UpstreamConfig, target: Target) -> ssl.SSLContext | None:
    """The TLS context of an https upstream (None for http); ConfigError naming ca_file."""
    if not target.tls:
        return None
    try:
        return client_context(cfg.verify, cfg.ca_file)
    except (OSError, ValueError) as exc:  # (ssl.SSLError is an OSError)
        raise ConfigError(
            f"ca_file: cannot load {cfg.ca_file!r}: {getattr(exc, 'strerror', None) or exc}"
        ) from None


def upstream_keepalive(cfg: UpstreamConfig, target: Target, keepalive_s: float) -> float:
    """How long an idle pooled connection is kept: `keepalive_s` of the upstream, else
    `[dispatcher].upstream_keepalive_s`, raised to TLS_KEEPALIVE_S for https (unless 0)."""
    if cfg.keepalive_s is not None:
        return cfg.keepalive_s
    if target.tls and keepalive_s > 0:
        return max(keepalive_s, TLS_KEEPALIVE_S)
    return keepalive_s


class Upstream:
    def __init__(
        self,
        cfg: UpstreamConfig,
        keepalive_s: float,
        prewarm: bool = False,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.target = parse_target_url(cfg.url)
        self.host, self.port = self.target.host, self.target.port
        self.host_header = self.target.host_header
        self.tls = upstream_tls(cfg, self.target)
        self.pool = Pool(
            self.host,
            self.port,
            upstream_keepalive(cfg, self.target, keepalive_s),
            prewarm,
            connect_timeout_s,
            self.tls,
        )
        self.health = Health()
        self.slots: Slots = SlotPool(cfg.parallel, cfg.queue, cfg.name, self.health)
        self.metrics = UpstreamMetrics(cfg.name, cfg.parallel)
        self.auth = upstream_auth(cfg)
        # Sent with every request.
        self.static = fixed_headers(cfg.headers)
        self.probe_task: asyncio.Task[None] | None = None

    @property
    def state(self) -> UpstreamState:
        return self.health.state(self.slots.in_flight)

    def refresh_metrics(self) -> None:
        m = self.metrics
        m.state, m.in_flight, m.queued = self.state, self.slots.in_flight, self.slots.queued

"""The relay process: listener, upstreams, background probes, shutdown."""

from __future__ import annotations

import asyncio
import os
import time

from relay.auth import Auth
from relay.budget import Budgets, window_bounds
from relay.client import ClientConn
from relay.config import Config, ConfigError, UpstreamConfig, parse_target_url
from relay.dispatch import Dispatcher
from relay.health import Health, probe_once
from relay.log import Log
from relay.metrics import Registry, UpstreamMetrics
from relay.routing import Router
from relay.slots import SlotPool
from relay.stall import StallPolicy
from relay.store import Store
from relay.tls import client_context
from relay.upstream import Pool
from relay.upstream_headers import fixed_headers

# An idle pooled connection to an https upstream (a hosted API keeps one open for minutes,
# and a new one costs a TLS handshake) is kept this long unless `keepalive_s` says otherwise.
TLS_KEEPALIVE_S = 60.0


class Upstream:
    def __init__(self, cfg: UpstreamConfig, keepalive_s: float, prewarm: bool = False,
                 connect_timeout_s: float = 5.0) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.target = parse_target_url(cfg.url)
        self.host, self.port = self.target.host, self.target.port
        self.host_header = self.target.host_header
        self.tls = None
        if self.target.tls:
            try:
                self.tls = client_context(cfg.verify, cfg.ca_file)
            except (OSError, ValueError) as exc:  # (ssl.SSLError is an OSError)
                raise ConfigError(f"upstream.{cfg.name}.ca_file: cannot load {cfg.ca_file!r}: "
                                  f"{getattr(exc, 'strerror', None) or exc}") from None
            if keepalive_s > 0:  # (0: no pooling at all, as chosen)
                keepalive_s = max(keepalive_s, TLS_KEEPALIVE_S)
        if cfg.keepalive_s is not None:
            keepalive_s = cfg.keepalive_s
        self.pool = Pool(self.host, self.port, keepalive_s, prewarm, connect_timeout_s, self.tls)
        self.slots = SlotPool(cfg.parallel, cfg.queue)
        self.health = Health()
        self.metrics = UpstreamMetrics(cfg.name, cfg.parallel)
        self.auth: tuple[bytes, bytes] | None = None
        if cfg.auth_header:
            value = os.environ.get(cfg.auth_value_env or "")
            if value is None:
                raise ConfigError(
                    f"upstream.{cfg.name}.auth_value_env: environment variable "
                    f"{cfg.auth_value_env} is not set")
            self.auth = (cfg.auth_header.encode(), value.encode())
        self.static = fixed_headers(cfg.headers)  # sent with every request

    @property
    def state(self) -> str:
        return self.health.state(self.slots.in_flight)

    def refresh_metrics(self) -> None:
        m = self.metrics
        m.state, m.in_flight, m.queued = self.state, self.slots.in_flight, self.slots.queued


class App:
    def __init__(self, config: Config, log: Log | None = None) -> None:
        if not config.upstream:
            raise ConfigError("upstream: at least one [[upstream]] is required")
        self.config = config
        self.log = log or Log()
        d = config.dispatcher
        self.policy = StallPolicy(d.stream_idle_timeout_s, d.stream_total_timeout_s,
                                  d.direct_read_timeout_s)
        self.upstreams = {u.name: Upstream(u, d.upstream_keepalive_s, d.prewarm,
                                           d.connect_timeout_s) for u in config.upstream}
        self.router = Router(config.upstream)
        self.auth = Auth(config.key, config.admin_key_sha256)
        self.budgets = Budgets(config.key)
        self.registry = Registry()
        for up in self.upstreams.values():
            self.registry.add(up.metrics)
        self.store = Store(config.store.path, retention_days=config.store.retention_days)
        self.dispatcher = Dispatcher(self)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.AbstractServer | None = None
        self.clients: set[ClientConn] = set()
        self.tasks: set[asyncio.Task] = set()
        self.background: list[asyncio.Task] = []
        self.draining = False
        self.port = 0

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.store.start()
        self._restore_budgets()
        s = self.config.server
        self.server = await self.loop.create_server(
            lambda: ClientConn(self), s.host, s.port, backlog=4096, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]
        if self.config.dispatcher.health_interval_s > 0:
            for up in self.upstreams.values():
                self.background.append(self.loop.create_task(self._probe(up)))
        self.background.append(self.loop.create_task(self._sample_tokens()))
        self.log.event("relay_listening", host=s.host, port=self.port,
                       upstreams=list(self.upstreams))
        for up in self.upstreams.values():
            if up.target.tls and not up.cfg.verify:
                self.log.event("upstream_tls_unverified", upstream=up.name, url=up.cfg.url,
                               note="verify = false: certificate and hostname are not checked")

    def _restore_budgets(self) -> None:
        """Budgets survive a restart: each window's usage is rebuilt from the rows."""
        now = time.time()
        for key_id in self.budgets.keys:
            for kind in self.budgets.windows_of(key_id):
                start, _ = window_bounds(kind, now)
                requests, tokens = self.store.usage_since(key_id, start, served_only=True)
                self.budgets.restore(key_id, kind, requests, tokens, now)

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish (bounded), flush rows, close."""
        if drain_timeout_s is None:
            drain_timeout_s = self.config.server.drain_timeout_s
        self.draining = True
        if self.server is not None:
            self.server.close()
        for client in list(self.clients):
            if not client.busy and not client.gone:
                client.gone = True
                client.transport.close()
        pending = {t for t in self.tasks if not t.done()}
        self.log.event("relay_draining", in_flight=len(pending), timeout_s=drain_timeout_s)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=drain_timeout_s)
        for client in list(self.clients):
            if client.exchange is not None:
                client.exchange.shutdown()
        if pending:
            _, pending = await asyncio.wait(pending, timeout=2.0)
        for task in pending:
            task.cancel()  # still waiting for a slot or a head: settled as shut down
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        for task in self.background:
            task.cancel()
        for up in self.upstreams.values():
            up.pool.close()
        for client in list(self.clients):
            if client.transport is not None:
                client.transport.close()
        await self.store.aclose()
        self.log.event("relay_stopped", unfinished=len([t for t in pending if not t.done()]),
                       rows_written=self.store.rows_written, rows_dropped=self.store.rows_dropped)
        self.log.flush()

    # ---- requests ----------------------------------------------------------------------
    async def handle(self, client: ClientConn, req) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        try:
            await self.dispatcher.handle(client, req)
        finally:
            self.tasks.discard(task)

    def rejected(self, client: ClientConn, err) -> None:
        self.dispatcher.rejected(client, err)

    # ---- background ----------------------------------------------------------------------
    async def _probe(self, up: Upstream) -> None:
        d = self.config.dispatcher
        while True:
            status, error = await probe_once(up.host, up.port, up.host_header,
                                             d.connect_timeout_s, up.tls,
                                             up.target.join(b"/health"))
            before = up.health.probe
            up.health.probed(status, error)
            if up.health.probe != before:
                self.log.event("upstream_state", upstream=up.name, state=up.state,
                               was=before, status=status)
            await asyncio.sleep(d.health_interval_s)

    async def _sample_tokens(self) -> None:
        """Once a second, move each live stream's new tokens into its upstream's rate window."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for client in list(self.clients):
                ex = client.exchange
                if ex is not None and ex.scanner is not None:
                    n = ex.scanner.content_events - ex.counted
                    if n:
                        ex.counted += n
                        self.upstreams[ex.upstream_name].metrics.add_tokens(n, now)

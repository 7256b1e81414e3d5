"""The relay process: listener, upstreams, background probes, shutdown.

The App holds what the proxy layer reads (`proxy.app_view.AppView`) and what a client
connection needs besides (`proxy.client.ConnHost`): the configuration and what is built from
it, the loop, the store, the metrics; the live client connections and the requests' tasks,
which its drain waits for. A worker process's App is its subclass (relay.workers.worker),
whose slots, budgets and store are its parent's.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import socket
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Protocol

from relay import reload
from relay.config import Config, ConfigError, DispatcherConfig, UpstreamConfig, at_upstream
from relay.observe import otel_start
from relay.observe.log import Log
from relay.observe.metrics import Registry, UpstreamMetrics
from relay.observe.record import Record
from relay.observe.ui_state import Recent, Trend, Trended
from relay.policy import admin_access
from relay.policy.budget import Budgets, window_bounds
from relay.policy.cors import Cors
from relay.policy.keys import Auth
from relay.policy.routing import Router
from relay.proxy.app_view import RemoteView
from relay.proxy.body_memory import BodyBytes
from relay.proxy.client import LINGER_S, ClientConn
from relay.proxy.deadlines import Deadlines
from relay.proxy.dispatch import Dispatcher
from relay.proxy.health import DOWN, Change, probe_once
from relay.proxy.slots import Balancer, Board, SlotPool
from relay.proxy.upstreams import Upstream
from relay.reload import Summary
from relay.store import POSTGRES_EXTRA_HINT
from relay.store.admissions import AdmissionId
from relay.store.interface import RowStore
from relay.store.sqlite import Store
from relay.stream.stall import StallPolicy

if TYPE_CHECKING:
    from relay.observe.otel import Telemetry


def run(coro: Coroutine[object, object, int]) -> int:
    """Run the relay's main coroutine on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def worker_count(setting: int | str) -> int:
    """`[server].workers`: a number, or "auto": the cores this process may run on (its CPU
    affinity, and a cgroup's CPU quota when it has one: a container's share, not the host's
    cores), at most 512."""
    if setting != "auto":
        return int(setting)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        # Not Linux.
        cores = os.cpu_count() or 1
    try:
        # cgroup v2: "<quota> <period>" or "max <period>".
        with open("/sys/fs/cgroup/cpu.max") as fh:
            quota, period = fh.read().split()[:2]
        if quota != "max":
            cores = min(cores, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, min(cores, 512))


def make_store(config: Config, log: Log) -> RowStore:
    """SQLite (`[store].path`), or PostgreSQL shared by several relays (`[store].url`)."""
    if config.store.url is None:
        return Store(config.store.path, retention_days=config.store.retention_days, log=log)
    try:
        from relay.store.postgres import PgStore
    except ImportError as exc:
        raise ConfigError(
            f"store.url: PostgreSQL needs the 'postgres' extra ({POSTGRES_EXTRA_HINT}): {exc}"
        ) from None

    return PgStore.configured(config.store, log)


_UNTRENDED, _GENERATING = Trended.NONE, Trended.GENERATING


class Listening(Protocol):
    """The listening side as the App starts and stops it: an asyncio.Server, or the socket a
    parent hands to its workers (relay.workers.parent)."""

    @property
    def sockets(self) -> Sequence[socket.socket]: ...

    async def start_serving(self) -> None: ...

    def close(self) -> None: ...


class App:
    # Its log events' prefix: relay_listening, relay_draining, relay_stopped.
    role = "relay"

    def __init__(self, config: Config, log: Log | None = None) -> None:
        if not config.upstream:
            raise ConfigError("upstream: at least one [[upstream]] is required")
        self.config = config
        self.log = log or Log()
        d = config.dispatcher
        self.policy = StallPolicy(
            d.stream_idle_timeout_s, d.stream_total_timeout_s, d.direct_read_timeout_s
        )
        # Every upstream's slots and every pool's queue (proxy.slots).
        self.board = Board(config.balance, self._slots_of, config.key)
        self.upstreams: dict[str, Upstream] = {}
        for i, u in enumerate(config.upstream):
            with at_upstream(i, u):
                self.upstreams[u.name] = self.new_upstream(u, d)
        self.router = Router(config.upstream)
        self.auth = Auth(config.key, config.admin_key_sha256)
        self.cors = Cors(config.server.cors_origins)
        self.budgets = self.make_budgets(config)
        self.registry = Registry()
        for up in self.upstreams.values():
            self.registry.add(up.metrics)
        self.store: RowStore = self.make_store(config)
        self.dispatcher = Dispatcher(self)
        # The relay-wide bound on request-body bytes held.
        self.bodies = BodyBytes(config.server.max_buffered_body_bytes)
        # The operator page's figures (observe.ui_state).
        self.ui_recent = Recent()
        self.ui_trend = Trend()
        # OpenTelemetry (observe.otel), when [otel] or OTEL_* say so: made at start.
        self.otel: Telemetry | None = None
        # A worker process answers the relay's own views from its parent (relay.workers).
        self.remote_view: RemoteView | None = None
        # The loop the relay runs on, and every stream's stall guard on one loop timer: both
        # from `start` (a test driving the App's state without starting it sets the loop).
        self.loop: asyncio.AbstractEventLoop
        self.deadlines: Deadlines
        self.server: Listening | None = None
        # The open client connections and the requests' tasks, as dicts (values None), not
        # sets: with thousands of streams open a set's table is up to four times their count
        # (at 5000, about 100 bytes a stream each), a dict's about 30 bytes.
        self.clients: dict[ClientConn, None] = {}
        self.tasks: dict[asyncio.Task[None], None] = {}
        # What a request's task calls as it ends, and the context it is called in: one for
        # all of them, not a bound method and a copy of the context made per request and
        # kept while its stream lasts (it reads no context variable).
        self._untrack = self._untracked
        self._untrack_in = contextvars.Context()
        self.background: list[asyncio.Task[None]] = []
        # Upstreams a reload removed: their pools are closed once idle.
        self.retired: list[Upstream] = []
        self.draining = False
        self._hurry = asyncio.Event()
        # One reload at a time (reload_async).
        self._reloading = asyncio.Lock()
        # Set when a client connection is lost.
        self._closed = asyncio.Event()
        self.port = 0

    # ---- what a worker process (relay.workers) holds in another way ----------------------
    def new_upstream(self, cfg: UpstreamConfig, d: DispatcherConfig) -> Upstream:
        """An upstream as this process holds it (at start and for a reload): its slots on the
        board; each change of its state logged and told to the board (`health_changed`)."""
        up = Upstream(cfg, d.upstream_keepalive_s, d.prewarm, d.connect_timeout_s)
        up.health.probing = d.health_interval_s > 0
        if isinstance(up.slots, SlotPool):
            self.board.adopt(up.slots)
        up.health.on_change = functools.partial(self.health_changed, up)
        return up

    def health_changed(self, up: Upstream, change: Change) -> None:
        """An upstream's state changed (a probe, or a request: found down, or answering
        again): one `upstream_state` line per change, not one per request. A member gone
        down holds no prompt any more (a restart empties its cache); one back hands its free
        slots to waiting requests."""
        line: dict[str, object] = {
            "upstream": up.name,
            "state": change.now,
            "was": change.was,
            "seen_by": change.by,
        }
        if change.status is not None:
            line["status"] = change.status
        if change.error:
            line["error"] = change.error
        self.log.record("upstream_state", line)
        if change.now is DOWN:
            self.board.forget_member(up.name)
        elif isinstance(up.slots, SlotPool):
            up.slots.kick()

    def _slots_of(self, name: str) -> SlotPool | None:
        """An upstream's slots by name: a configured one's, else (for a request routed before
        a reload removed it) the last retired one's."""
        up = self.upstreams.get(name)
        if up is None:
            up = next((u for u in reversed(self.retired) if u.name == name), None)
        slots = up.slots if up is not None else None
        return slots if isinstance(slots, SlotPool) else None

    @property
    def balancer(self) -> Balancer:
        """Where requests take their slots: this process's board."""
        return self.board

    def make_budgets(self, config: Config) -> Budgets:
        return Budgets(config.key)

    def make_store(self, config: Config) -> RowStore:
        return make_store(config, self.log)

    async def listen(self) -> Listening:
        """The listening server, not serving yet."""
        s = self.config.server
        return await self.loop.create_server(
            lambda: ClientConn(self),
            s.host,
            s.port,
            backlog=4096,
            reuse_address=True,
            start_serving=False,
        )

    def gauged(self) -> list[UpstreamMetrics]:
        """The upstreams' metrics with their live gauges (slots, queue, state) refreshed: for
        the relay's own views (`endpoints.admin_view`) and OpenTelemetry's reader (its
        thread). A worker has none to give: its parent answers both."""
        ups = list(self.upstreams.values())
        for up in ups:
            up.refresh_metrics()
        router = self.router
        # (Read in OpenTelemetry's thread too: the names copied in one step.)
        named = [router.named(name) for name in list(self.registry.pools)]
        pools = {p.name: p for p in (*router.pools, *named) if p is not None}
        board = self.board
        board.figures(self.registry, list(pools.values()))
        held, waiting = board.held_by_key, board.waiting_by_key()
        self.registry.key_live = {
            k.id: (held.get(k.id, 0), waiting.get(k.id, 0)) for k in self.config.key
        }
        return [up.metrics for up in ups]

    def probed(self, up: Upstream) -> None:
        """An upstream's probe result is in (`up.health`): a parent tells its workers."""

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        loop = self.loop = asyncio.get_running_loop()
        # Without the `otel` extra, [otel] fails here, before anything is bound or opened.
        self.otel = otel_start.start(self.config.otel, self.log, self.gauged, os.environ)
        self.deadlines = Deadlines(loop)
        s = self.config.server
        # Bind first: a relay that cannot listen (the address is in use: another relay?)
        # fails before it touches the database; serving starts once budgets are rebuilt.
        server = self.server = await self.listen()
        self.port = server.sockets[0].getsockname()[1]
        try:
            # The database's lock, then recovery (StoreLocked: in use).
            self.store.start()
            if self.store.recovered:
                # The relay died mid-request: those requests are charged.
                self.log.event("admissions_recovered", rows=self.store.recovered)
            self._restore_budgets()
        except BaseException:
            server.close()
            raise
        await server.start_serving()
        self.start_probes()
        self.background.append(loop.create_task(self._sample_tokens()))
        self.background.append(loop.create_task(self.store.maintain(self.budgets)))
        self.log.event(
            f"{self.role}_listening", host=s.host, port=self.port, upstreams=list(self.upstreams)
        )
        self.opened()
        for up in self.upstreams.values():
            if up.target.tls and not up.cfg.verify:
                self.log.event(
                    "upstream_tls_unverified",
                    upstream=up.name,
                    url=up.cfg.url,
                    note="verify = false: certificate and hostname are not checked",
                )

    def opened(self) -> None:
        """A warning at start when anyone who can reach the relay may do anything
        (`admin_access.open_to_network`): what is exposed, and what closes it."""
        s = self.config.server
        if admin_access.open_to_network(self.auth, s.host):
            self.log.event(
                "relay_open",
                host=s.host,
                port=self.port,
                exposed=list(admin_access.OPEN_EXPOSES),
                fix="add [[key]] and admin_key_sha256 (docs/security.md), or listen on 127.0.0.1",
            )

    def start_probes(self) -> None:
        """One /health probe task per upstream (again after a reload: the old ones end)."""
        for up in self.all_upstreams():
            if up.probe_task is not None:
                up.probe_task.cancel()
                up.probe_task = None
        if self.config.dispatcher.health_interval_s > 0:
            loop = asyncio.get_running_loop()
            for up in self.upstreams.values():
                up.probe_task = loop.create_task(self._probe(up))

    def _restore_budgets(self, windows: list[tuple[str, str]] | None = None) -> None:
        """Budgets survive a restart: each window's usage is rebuilt from the rows (those of
        requests a crash cut included: store.admissions). `windows`: only those."""
        now = time.time()
        if windows is None:
            windows = [(k, kind) for k in self.budgets.keys for kind in self.budgets.windows_of(k)]
        for key_id, kind in windows:
            start, _ = window_bounds(kind, now)
            requests, tokens = self.store.usage_since(key_id, start, served_only=True)
            self.budgets.restore(key_id, kind, requests, tokens, now)

    def reload(self, config: Config) -> Summary:
        """Apply a new configuration: see `relay.reload` (the store read in this thread)."""
        return reload.apply(self, config)

    async def reload_async(self, config: Config) -> Summary:
        """Apply a new configuration (SIGHUP), the store read off the event loop."""
        async with self._reloading:
            return await reload.apply_async(self, config)

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Stop accepting, refuse the queue, let in-flight requests finish (bounded), flush
        rows, close. `hurry()` (a second SIGTERM/SIGINT) skips what is left of the waits."""
        if drain_timeout_s is None:
            drain_timeout_s = self.config.server.drain_timeout_s
        self.draining = True
        if self.server is not None:
            self.server.close()
        # A request whose last bytes came in this same loop pass is dispatched by a callback
        # already queued: it runs first, so the drain counts (and answers) it.
        await asyncio.sleep(0)
        for client in list(self.clients):
            client.stop_idle()
        for up in self.all_upstreams():
            # Queued requests are answered 503 shutting_down now.
            up.slots.close()
        pending = self._live_tasks()
        self.log.event(f"{self.role}_draining", in_flight=len(pending), timeout_s=drain_timeout_s)
        pending = await self._drain_wait(pending, drain_timeout_s)
        for client in list(self.clients):
            client.cut()
        pending = await self._drain_wait(pending, 2.0)
        pending |= await self._cancel_the_rest()
        self._stop_background()
        # Refused clients read their answer first.
        await self._linger_wait(LINGER_S + 0.5)
        for client in list(self.clients):
            client.close()
        # None should be left: their rows go in before the store closes.
        pending |= await self._cancel_the_rest()
        await self.store.aclose()
        if self.otel is not None:
            # The last spans and points, waited for a bounded time.
            await self.otel.aclose()
        self.log.event(
            f"{self.role}_stopped",
            unfinished=len([t for t in pending if not t.done()]),
            rows_written=self.store.rows_written,
            rows_dropped=self.store.rows_dropped,
        )
        self.log.flush()

    async def _cancel_the_rest(self) -> set[asyncio.Task[None]]:
        """Requests still running (waiting for a head, a slow client, or begun despite the
        drain) are cancelled, settled as shut down; waited for a bounded time."""
        left = self._live_tasks()
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=2.0)
        return left

    def _stop_background(self) -> None:
        for task in self.background:
            task.cancel()
        for up in self.all_upstreams():
            if up.probe_task is not None:
                up.probe_task.cancel()
        for up in self.all_upstreams():
            up.pool.close()

    def _live_tasks(self) -> set[asyncio.Task[None]]:
        return {t for t in self.tasks if not t.done()}

    async def _linger_wait(self, timeout: float) -> None:
        """Let refused clients read their answer: wait until each lingering connection is
        closed by its own timer (bounded; `hurry()` skips it)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while (
            any(c.lingering for c in self.clients)
            and not self._hurry.is_set()
            and (remaining := end - loop.time()) > 0
        ):
            self._closed.clear()
            waiters = [loop.create_task(self._closed.wait()), loop.create_task(self._hurry.wait())]
            try:
                await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()

    def hurry(self) -> None:
        """End a drain now (the rows are still settled and flushed)."""
        self._hurry.set()

    async def _drain_wait(
        self, pending: set[asyncio.Task[None]], timeout: float
    ) -> set[asyncio.Task[None]]:
        """Wait until the tasks are done, `timeout` ran out, or `hurry()`; the tasks left."""
        left = {t for t in pending if not t.done()}
        if not left or self._hurry.is_set():
            return left
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        hurry = loop.create_task(self._hurry.wait())
        try:
            while left and not hurry.done() and (remaining := end - loop.time()) > 0:
                await asyncio.wait(
                    left | {hurry}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                left = {t for t in left if not t.done()}
        finally:
            hurry.cancel()
        return left

    def all_upstreams(self) -> list[Upstream]:
        """The configured upstreams and those a reload removed whose streams still run."""
        return list(self.upstreams.values()) + self.retired

    # ---- connections and requests (proxy.client.ConnHost) ------------------------------
    def connected(self, client: ClientConn) -> None:
        self.clients[client] = None

    def forget(self, client: ClientConn) -> None:
        """A client connection is lost."""
        self.clients.pop(client, None)
        self._closed.set()

    def track(self, task: asyncio.Task[None]) -> None:
        """A request's task, counted by the drain from the moment it is created (a task
        cancelled before its first step still ends, and leaves the count)."""
        self.tasks[task] = None
        task.add_done_callback(self._untrack, context=self._untrack_in)

    def _untracked(self, task: asyncio.Task[None]) -> None:
        self.tasks.pop(task, None)

    def put_row(
        self, rec: Record, admission: AdmissionId | None = None, trend: Trended = Trended.NONE
    ) -> None:
        """A settled request's row: into the page's recent rows and its trend (`trend`: as
        what, if at all), and into the store (replacing its admission record). A worker
        process sends it to its parent, which keeps it here."""
        if trend is not _UNTRENDED:
            self.ui_trend.add(rec, trend is _GENERATING)
        self.ui_recent.add(rec)
        self.store.put_record(rec, admission)

    # ---- background ----------------------------------------------------------------------
    async def _probe(self, up: Upstream) -> None:
        wake = asyncio.Event()
        # A request saw it down: probed now, then often.
        up.health.on_down = wake.set
        while True:
            d = self.config.dispatcher
            wake.clear()
            status, error = await probe_once(
                up.host,
                up.port,
                up.host_header,
                d.connect_timeout_s,
                up.tls,
                up.target.join(b"/health"),
            )
            # A new state is logged (`health_changed`).
            up.health.probed(status, error)
            self.probed(up)
            try:
                await asyncio.wait_for(
                    wake.wait(), up.health.probe_delay(d.health_interval_s, d.down_probe_interval_s)
                )
            except TimeoutError:
                pass

    async def _sample_tokens(self) -> None:
        """Once a second, move each live stream's new tokens into its upstream's rate window."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for client in list(self.clients):
                ex = client.exchange
                if ex is None:
                    continue
                n = ex.new_tokens()
                up = self.upstreams.get(ex.hop.upstream)
                if n and up is not None:
                    up.metrics.add_tokens(n, now)
            self.ui_trend.sample(time.time(), now, self.registry)
            self._close_retired()

    def _close_retired(self) -> None:
        """Pools of upstreams a reload removed are closed once their streams are done."""
        for up in list(self.retired):
            # Idle connections now; the one a finishing stream frees, later.
            up.pool.close()
            if up.slots.in_flight == 0 and not up.slots.queued:
                self.retired.remove(up)

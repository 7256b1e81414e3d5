"""`relay serve --workers N`: the parent process, which holds what is relay-wide.

The parent binds the listen address once and hands the socket to N worker processes
(`relay.workers.worker`): one accept queue, spread by the kernel to whichever worker is
waiting in accept; a worker that dies leaves the connections it had not accepted to the
others (with SO_REUSEPORT each worker would have its own queue, and a dead worker's queued
connections would be reset).

It is the one process holding, exactly as one relay process does and with the same code:
- every upstream's `SlotPool` (`parallel` and the FIFO queue across all workers), its
  health (one probe per upstream; every verdict is told to every worker);
- the `Budgets` and the store (its single writer): a keyed request's reservation and
  admission record, every row, crash rows for the admissions of a worker that died;
- the figures of the whole relay: the workers' metrics added up (observe.metrics_merge) for
  `/metrics`, `/api/slots/metrics` and `/api/ui/state` whichever worker is asked, and the
  page's recent rows and trend; a dead worker's last figures stay in, so counters never go
  back.
It restarts a worker that dies (its slots freed, its admitted requests settled as
`relay_crashed` rows charged their reservation), and one that stops answering the way it
restarts one that dies, once it has killed it (relay.workers.liveness); restarts of workers
that cannot start back off, and when none has served for `[server].no_workers_exit_s` the
parent exits 3 (`NO_WORKERS_EXIT`). SIGHUP: the parent applies the file, then every worker
does (a bad file changes none); SIGTERM/SIGINT: every worker drains, the rows are flushed,
exit 0; a second signal ends the drains at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Coroutine, Mapping
from typing import assert_never

import relay
from relay import reload
from relay.app import App
from relay.config import Config
from relay.errors import Code, RelayError
from relay.observe import metrics_merge
from relay.observe.log import Log
from relay.observe.metrics import Registry
from relay.proxy.client_writer import JSON
from relay.proxy.endpoints import admin_view
from relay.proxy.upstreams import Upstream
from relay.reload import Summary
from relay.workers import holdings, wire
from relay.workers.holdings import Worker
from relay.workers.liveness import Awake, Restarts, Vacancy, stall_slack

# A worker that does not serve by then fails the relay's start.
START_WAIT_S = 30.0
# A worker that does not answer in time: its last figures are used.
FIGURES_WAIT_S = 1.0
RELOAD_WAIT_S = 10.0
# How often the parent looks at its workers' lives (and at its own loop's).
WATCH_S = 0.25
# A worker killed for its silence whose socket has not ended by then is cut off from here.
KILL_WAIT_S = 5.0
# The parent's exit status when no worker has served for `[server].no_workers_exit_s`.
NO_WORKERS_EXIT = 3


class WorkersFailed(OSError):
    """The workers could not be started (the relay does not start)."""


class _Listener:
    """The listening socket, which the workers serve (App.start's server stand-in)."""

    def __init__(self, parent: ParentApp, sock: socket.socket) -> None:
        self.parent, self.sock = parent, sock
        self.sockets = [sock]

    async def start_serving(self) -> None:
        await self.parent.spawn_all()

    def close(self) -> None:
        self.sock.close()


class ParentApp(App):
    """The relay-wide state of `workers` worker processes. `lost_figures`: the figures of
    the workers that died; `budget_generations`: (wall time, budgets' generation) after each
    reload, for a keyed row without limits, charged to the windows made since its request
    began (holdings.unlimited)."""

    def __init__(self, config: Config, log: Log, workers: int) -> None:
        super().__init__(config, log)
        self.size = workers
        self.workers: dict[int, Worker] = {}
        self.readers: set[asyncio.Task[None]] = set()
        self.lost_figures: Registry | None = None
        self._listen_sock: socket.socket | None = None
        self._gathering: asyncio.Task[None] | None = None
        # Every worker served once: from then on, one that dies is restarted.
        self.all_served = False
        self.budget_generations: list[tuple[float, int]] = [(0.0, self.budgets.generation)]
        # Each worker slot's restarts, and its last worker's exit status.
        self.restarts: dict[int, Restarts] = {}
        self.exit_codes: dict[int, int] = {}
        self.vacancy = Vacancy()
        # Set when the relay stops: a restart waiting out its backoff ends at once.
        self.stopping = asyncio.Event()
        self._stopped: asyncio.Task[None] | None = None
        self._giving_up: asyncio.Task[None] | None = None

    # ---- start -----------------------------------------------------------------------
    async def listen(self) -> _Listener:
        """One listening socket for every worker: the host's first address (a name is
        resolved as one process resolves it); "" or "::" is every interface, IPv4 and IPv6."""
        s = self.config.server
        if s.host in ("", "::") and socket.has_dualstack_ipv6():
            sock = socket.create_server(
                ("", s.port), family=socket.AF_INET6, backlog=4096, dualstack_ipv6=True
            )
        else:
            info = await asyncio.get_running_loop().getaddrinfo(
                s.host or None, s.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            family, addr = info[0][0], info[0][4]
            sock = socket.create_server((addr[0], addr[1]), family=family, backlog=4096)
        sock.setblocking(False)
        self._listen_sock = sock
        return _Listener(self, sock)

    async def spawn_all(self) -> None:
        """Start every worker; each must serve (`Ready`) or the start fails, none left."""
        spawned: list[Worker] = []
        try:
            for index in range(self.size):
                spawned.append(await self.spawn(index))
            for w in spawned:
                await _serving(w)
        except BaseException:
            # No restart: every worker started is ended.
            self.draining = True
            for w in spawned:
                _signal(w, signal.SIGKILL)
            raise
        self.all_served = True
        self.background.append(asyncio.get_running_loop().create_task(self._watch()))
        self.log.event(
            "workers_serving", workers=self.size, pids=[w.pid for w in self.workers.values()]
        )

    async def spawn(self, index: int) -> Worker:
        """Start worker `index`. It runs with -P: not the working directory first on its path,
        but the parent's code (`worker_environ`); in its own session, since a terminal's
        Ctrl-C is the parent's to pass on."""
        assert self._listen_sock is not None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        lfd = self._listen_sock.fileno()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-P",
                "-m",
                "relay.workers.worker",
                "--listen-fd",
                str(lfd),
                "--link-fd",
                str(theirs.fileno()),
                "--index",
                str(index),
                "--log-format",
                self.log.format,
                pass_fds=(lfd, theirs.fileno()),
                start_new_session=True,
                env=worker_environ(os.environ, index),
            )
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        w = Worker(index, proc, writer, time.monotonic(), pid=proc.pid)
        self.workers[index] = w
        w.send(wire.Configure(self.config))
        # What the probes said so far.
        for up in self.upstreams.values():
            w.send(_health(up))
        task = asyncio.get_running_loop().create_task(self._serve_worker(w, reader))
        self.readers.add(task)
        task.add_done_callback(self.readers.discard)
        return w

    def probed(self, up: Upstream) -> None:
        for w in self.workers.values():
            w.send(_health(up))

    # ---- one worker's messages -------------------------------------------------------
    async def _serve_worker(self, w: Worker, reader: asyncio.StreamReader) -> None:
        """Every frame a worker sends is a sign of its life (`liveness.Hearing`)."""
        hearing = w.hearing
        try:
            while (message := await wire.read(reader, wire.FROM_WORKER)) is not None:
                hearing.heard(time.monotonic())
                self._heard(w, message)
        finally:
            await self._lost(w)

    def _heard(self, w: Worker, message: wire.ToParent) -> None:
        """One message of a worker, taken in the order they came: an admission's reservation
        is taken before the next message (its row) is read."""
        match message:
            case wire.Row():
                holdings.row(self, w, message)
            case wire.SlotAsk():
                holdings.ask_slot(self, w, message)
            case wire.Free(id=i, reuse=reuse):
                w.free(i, reuse)
            case wire.Unslot(id=i):
                w.unslot(i)
            case wire.Admit():
                holdings.admit(self, w, message)
            case wire.ViewAsk():
                self._task(self._answer_view(w, message))
            case wire.Down() | wire.Up():
                self._found(message)
            case wire.Figures(id=i):
                w.figures_asked.answered(i, message)
            case wire.Reloaded(id=i):
                w.reloads.answered(i, message)
            case wire.Ready():
                w.ready.set()
            case _:
                assert_never(message)

    def _found(self, message: wire.Down | wire.Up) -> None:
        """What a request found of an upstream: the one health follows (as one process's
        `Health`), and every worker is told."""
        up = self.upstreams.get(message.upstream)
        if up is None:
            return
        if isinstance(message, wire.Down):
            up.health.connect_failed(message.error)
        else:
            up.health.answered()
        self.probed(up)

    def _task(self, coro: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.track(task)
        return task

    async def _answer_view(self, w: Worker, ask: wire.ViewAsk) -> None:
        try:
            await self.gather()
            status, body, ctype, extra = admin_view(self, ask.path)
        except RelayError as err:
            status, body, ctype, extra = err.status, err.body(), JSON, list(err.headers)
        except Exception as exc:
            # A bug: the worker's client still gets an answer.
            self.log.event("internal_error", error=f"{type(exc).__name__}: {exc}"[:300])
            bug = RelayError(Code.INTERNAL_ERROR, "internal relay error")
            status, body, ctype, extra = bug.status, bug.body(), JSON, []
        w.send(wire.ViewAnswer(ask.id, status, body, ctype, extra))

    async def _lost(self, w: Worker) -> None:
        """A worker's socket ended: it exited (drained) or died. What it held is given back;
        its admitted requests become crash rows; its last figures stay in the relay's. It is
        taken out of the live workers first, so that none of its figures is summed twice."""
        if self.workers.get(w.index) is w:
            del self.workers[w.index]
        crashed = holdings.reclaim(self, w)
        w.writer.close()
        if w.figures is not None:
            parts = [w.figures] if self.lost_figures is None else [self.lost_figures, w.figures]
            self.lost_figures = self._sum(parts)
        code = await w.proc.wait()
        if self.draining or not self.all_served:
            return
        self.exit_codes[w.index] = code
        restarts = self.restarts.setdefault(w.index, Restarts())
        delay = restarts.lost(time.monotonic() - w.started_at, w.ready.is_set())
        self.log.event(
            "worker_lost",
            worker=w.index,
            pid=w.pid,
            exit_code=code,
            crash_rows=crashed,
            restart_in_s=delay,
        )
        await self._restart(w.index, restarts, delay)

    async def _restart(self, index: int, restarts: Restarts, delay: float) -> None:
        """A new worker in slot `index`, after `delay` (`Restarts`: a worker that cannot start
        is restarted ever less often); none once the relay stops, even mid-wait."""
        while await self._waited(delay):
            try:
                new = await self.spawn(index)
            except OSError as exc:
                # Out of descriptors, no fork: again, later.
                delay = restarts.failed()
                self.log.event(
                    "worker_restart_failed", worker=index, error=str(exc)[:300], restart_in_s=delay
                )
                continue
            self.log.event("worker_restarted", worker=index, pid=new.pid)
            return

    async def _waited(self, delay: float) -> bool:
        """`delay` seconds gone by, the relay still running (False: it stops)."""
        if delay > 0 and not self.draining:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
        return not self.draining

    # ---- the workers' lives ------------------------------------------------------------
    async def _watch(self) -> None:
        """Every `WATCH_S`: a serving worker that has not answered an ask for
        `worker_timeout_s` is lost (`_unresponsive`); when none has served for
        `no_workers_exit_s`, the relay gives up (`_give_up`). Neither counts a time the
        parent's own loop did not run (`liveness.Awake`)."""
        awake = Awake(time.monotonic())
        while not self.draining:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            s = self.config.server
            awake.tick(now, WATCH_S, stall_slack(s.worker_timeout_s))
            if self.draining:
                return
            for w in list(self.workers.values()):
                if w.serving and w.hearing.silent_s(now, awake.since) >= s.worker_timeout_s:
                    self._unresponsive(w, now)
            self.vacancy.seen(any(w.serving for w in self.workers.values()), now)
            if self.vacancy.empty_s(now, awake.since) >= s.no_workers_exit_s:
                self._give_up()
                return

    def _unresponsive(self, w: Worker, now: float) -> None:
        """`w` answers nothing: killed, so that it never comes back to write; its socket then
        ends, and it is lost as a worker that died is (`_lost`: what it held given back, its
        admitted requests settled, a restart). What it sent before is read first."""
        w.lost_at = now
        self.log.event(
            "worker_unresponsive",
            worker=w.index,
            pid=w.pid,
            silent_s=round(now - w.hearing.heard_at, 3),
            timeout_s=self.config.server.worker_timeout_s,
        )
        _signal(w, signal.SIGKILL)
        # A process that does not die (stuck in the kernel) still gives its holdings back.
        asyncio.get_running_loop().call_later(KILL_WAIT_S, w.writer.close)

    def _give_up(self) -> None:
        """No worker serves, and none could be started for the bound: the relay stops (its
        rows flushed, the port closed) and exits `NO_WORKERS_EXIT`, for a supervisor to
        restart it and say so."""
        bound = self.config.server.no_workers_exit_s
        self.log.event(
            "relay_no_workers",
            reason=f"no worker has served for {bound:g} s",
            last_exit_codes=dict(self.exit_codes),
            exit_code=NO_WORKERS_EXIT,
        )
        self._giving_up = asyncio.get_running_loop().create_task(self._exit(NO_WORKERS_EXIT))

    async def _exit(self, code: int) -> None:
        try:
            await self.stop()
        finally:
            self.log.flush()
            os._exit(code)

    # ---- the whole relay's figures ---------------------------------------------------
    def _sum(self, parts: list[Registry]) -> Registry:
        names = {m.name: m.parallel for part in parts for m in part}
        for up in self.upstreams.values():
            names[up.name] = up.cfg.parallel
        return metrics_merge.merged(parts, names)

    async def gather(self) -> None:
        """Every live worker's figures, added up into this process's registry (the parent's
        own slots and health give the live gauges: `Upstream.refresh_metrics`). Views asked
        for meanwhile share the one gathering under way."""
        if self._gathering is None or self._gathering.done():
            self._gathering = asyncio.get_running_loop().create_task(self._gather())
        await asyncio.shield(self._gathering)

    async def _gather(self) -> None:
        awaited: list[tuple[Worker, asyncio.Future[wire.Figures]]] = []
        now = time.monotonic()
        for w in list(self.workers.values()):
            if not w.serving:
                continue
            i, fut = w.figures_asked.expect()
            w.send(wire.FiguresAsk(i))
            w.hearing.asked(now)
            awaited.append((w, fut))
        if awaited:
            await asyncio.wait([f for _, f in awaited], timeout=FIGURES_WAIT_S)
        for w, fut in awaited:
            if fut.done() and not fut.cancelled() and not w.gone:
                w.figures = pickle.loads(fut.result().registry)
        # The dead workers' first, the live ones' after: a last-seen figure is a live one's.
        parts = [] if self.lost_figures is None else [self.lost_figures]
        parts += [w.figures for w in self.workers.values() if w.figures is not None]
        registry = metrics_merge.merged(
            parts, {up.name: up.cfg.parallel for up in self.upstreams.values()}
        )
        for up in self.upstreams.values():
            up.metrics = registry.get(up.name)
        self.registry = registry

    async def _sample_tokens(self) -> None:
        """Once a second: the workers' figures (the page's trend, and what a worker that dies
        leaves behind is at most a second old)."""
        while True:
            await asyncio.sleep(1.0)
            await self.gather()
            self.ui_trend.sample(time.time(), time.monotonic(), self.registry)
            self._close_retired()

    # ---- reload and stop -------------------------------------------------------------
    async def reload_async(self, config: Config) -> Summary:
        """The parent applies the file (a bad one: ConfigError, nothing changed anywhere),
        then every worker does; a worker that cannot drains (its streams finish) and is
        restarted on the new configuration."""
        async with self._reloading:
            summary = await reload.apply_async(self, config)
            self.budget_generations.append((time.time(), self.budgets.generation))
            awaited: list[tuple[Worker, asyncio.Future[wire.Reloaded]]] = []
            for w in list(self.workers.values()):
                i, fut = w.reloads.expect()
                w.send(wire.Reload(i, config))
                awaited.append((w, fut))
            if awaited:
                await asyncio.wait([f for _, f in awaited], timeout=RELOAD_WAIT_S)
            for w, fut in awaited:
                if w.gone or fut.cancelled():
                    continue
                error = (
                    fut.result().error if fut.done() else f"no answer within {RELOAD_WAIT_S:g} s"
                )
                if error is not None:
                    self.log.event("worker_reload_failed", worker=w.index, error=error)
                    w.send(wire.Drain())
            return summary

    def hurry(self) -> None:
        """A message to every worker, not a signal: one sent to every process of the tree is
        one drain."""
        super().hurry()
        for w in self.workers.values():
            w.send(wire.Hurry())

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Every worker drains, bounded by `drain_timeout_s` (and a margin for its last rows);
        then the parent's own tasks end and the store is flushed. Once: a stop asked for
        while one is under way (a signal while the relay gives up) waits for that one."""
        if self._stopped is None:
            self._stopped = asyncio.get_running_loop().create_task(self._stop(drain_timeout_s))
        await asyncio.shield(self._stopped)

    async def _stop(self, drain_timeout_s: float | None) -> None:
        if drain_timeout_s is None:
            drain_timeout_s = self.config.server.drain_timeout_s
        self.draining = True
        self.stopping.set()
        # The workers' copies of the socket still accept until they stop.
        if self._listen_sock is not None:
            self._listen_sock.close()
        # Queued requests are answered 503 shutting_down.
        for up in self.all_upstreams():
            up.slots.close()
        await self._drain_workers(drain_timeout_s)
        await self._end_tasks()
        await self.store.aclose()
        # The parent's own gauges, their last export.
        if self.otel is not None:
            await self.otel.aclose()
        self.log.event(
            "relay_stopped",
            rows_written=self.store.rows_written,
            rows_dropped=self.store.rows_dropped,
        )
        self.log.flush()

    async def _drain_workers(self, timeout: float) -> None:
        """Every worker drains; each reader ends once its worker's last rows are in. One not
        done in time is killed."""
        workers = list(self.workers.values())
        self.log.event("relay_draining", workers=len(workers), timeout_s=timeout)
        for w in workers:
            w.send(wire.Drain())
        readers = set(self.readers)
        if not readers:
            return
        _, late = await asyncio.wait(readers, timeout=timeout + 15.0)
        for w in workers:
            if not w.gone or w.proc.returncode is None:
                _signal(w, signal.SIGKILL)
        if late:
            await asyncio.wait(late, timeout=5.0)

    async def _end_tasks(self) -> None:
        """The probes, the background loops and the parent's answers end; the upstreams'
        pools close."""
        for task in self.background:
            task.cancel()
        for up in self.all_upstreams():
            if up.probe_task is not None:
                up.probe_task.cancel()
            up.pool.close()
        pending = {t for t in self.tasks if not t.done()}
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=2.0)


async def _serving(w: Worker) -> None:
    """Wait until `w` serves (WorkersFailed when it exits first, or is silent too long)."""
    ready = asyncio.ensure_future(w.ready.wait())
    ended = asyncio.ensure_future(w.proc.wait())
    done, _ = await asyncio.wait(
        {ready, ended}, timeout=START_WAIT_S, return_when=asyncio.FIRST_COMPLETED
    )
    ready.cancel()
    ended.cancel()
    if not w.ready.is_set():
        why = f"exit code {w.proc.returncode}" if ended in done else "no answer"
        raise WorkersFailed(f"worker {w.index} did not start ({why})")


def _health(up: Upstream) -> wire.Health:
    return wire.Health(up.name, up.health.probe, up.health.last_error)


def worker_environ(environ: Mapping[str, str], index: int) -> dict[str, str]:
    """A worker's environment: the parent's; the folder the parent's `relay` came from first
    on its path (the worker runs with -P: the same code, never a module of the working
    directory); each process its own OpenTelemetry instance (`service.instance.id`: every
    worker's metric streams are its own, not one series written by N processes), after what
    the operator gave (OTEL_RESOURCE_ATTRIBUTES: the last wins)."""
    env = dict(environ)
    home = os.path.dirname(os.path.dirname(os.path.abspath(relay.__file__)))
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = home + (os.pathsep + path if path else "")
    given = env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    instance = f"{socket.gethostname()}:{os.getpid()}:worker-{index}"
    env["OTEL_RESOURCE_ATTRIBUTES"] = (
        f"{given},service.instance.id={instance}" if given else f"service.instance.id={instance}"
    )
    return env


def _signal(w: Worker, sig: int) -> None:
    try:
        w.proc.send_signal(sig)
    except ProcessLookupError:
        pass

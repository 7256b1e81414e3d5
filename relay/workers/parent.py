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
`relay_crashed` rows charged their reservation); SIGHUP: the parent applies the file, then
every worker does (a bad file changes none); SIGTERM/SIGINT: every worker drains, the rows
are flushed, exit 0; a second signal ends the drains at once.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import socket
import sys
import time

import msgspec

import relay
from relay import reload
from relay.app import App
from relay.config import Config
from relay.errors import RelayError
from relay.observe import metrics_merge
from relay.observe.metrics import Registry
from relay.proxy.endpoints import JSON, admin_view
from relay.workers import holdings, wire
from relay.workers.holdings import Worker

START_WAIT_S = 30.0  # a worker that does not serve by then fails the relay's start
FIGURES_WAIT_S = 1.0  # a worker that does not answer in time: its last figures are used
RESTART_BACKOFF_S = 1.0  # a worker that dies within this of its start waits this long


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
    def __init__(self, config: Config, log, workers: int) -> None:
        super().__init__(config, log)
        self.n = workers
        self.workers: dict[int, Worker] = {}
        self.readers: set[asyncio.Task] = set()
        self.base: Registry | None = None  # the figures of workers that died
        self._ids = 0
        self._listen_sock: socket.socket | None = None
        self._gathering: asyncio.Task | None = None
        self.started = False  # every worker served once: from then on one that dies restarts
        # (wall time, budgets' generation) after each reload: a keyed row without limits is
        # charged to the windows made since its request began (holdings.unlimited)
        self.budget_generations: list[tuple[float, int]] = [(0.0, self.budgets.generation)]

    # ---- start -----------------------------------------------------------------------
    async def listen(self):
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
            sock = socket.create_server(addr[:2], family=family, backlog=4096)
        sock.setblocking(False)
        self._listen_sock = sock
        return _Listener(self, sock)

    async def spawn_all(self) -> None:
        """Start every worker; each must serve (`ready`) or the start fails, none left."""
        started = []
        try:
            for i in range(self.n):
                started.append(await self.spawn(i))
            for w in started:
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
        except BaseException:
            self.draining = True  # (no restart)
            for w in started:
                _signal(w, signal.SIGKILL)
            raise
        self.started = True
        self.log.event(
            "workers_serving", workers=self.n, pids=[w.pid for w in self.workers.values()]
        )

    async def spawn(self, index: int) -> Worker:
        assert self._listen_sock is not None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        lfd = self._listen_sock.fileno()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-P",  # (not the working directory first: the parent's code, `worker_environ`)
                "-m",
                "relay.workers.worker",
                "--listen-fd",
                str(lfd),
                "--link-fd",
                str(theirs.fileno()),
                "--index",
                str(index),
                pass_fds=(lfd, theirs.fileno()),
                start_new_session=True,  # a terminal's Ctrl-C is the parent's to pass on
                env=worker_environ(os.environ, index),
            )
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        w = Worker(index, proc, writer, time.monotonic(), pid=proc.pid)
        self.workers[index] = w
        w.send(["config", msgspec.msgpack.encode(self.config)])
        for up in self.upstreams.values():  # what the probes said so far
            w.send(["health", up.name, up.health.probe, up.health.last_error])
        task = asyncio.get_running_loop().create_task(self._serve_worker(w, reader))
        self.readers.add(task)
        task.add_done_callback(self.readers.discard)
        return w

    def probed(self, up) -> None:
        for w in self.workers.values():
            w.send(["health", up.name, up.health.probe, up.health.last_error])

    # ---- one worker's messages -------------------------------------------------------
    async def _serve_worker(self, w: Worker, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                message = await wire.read(reader)
                if message is None:
                    break
                kind, body = message[0], message[1:]
                if kind == "row":
                    holdings.row(self, w, *body)
                elif kind == "slot":
                    i, name, timeout = body
                    w.waiting[i] = loop.create_task(holdings.slot(self, w, i, name, timeout))
                elif kind == "free":
                    slot = w.held.pop(body[0], None)
                    if slot is not None:
                        slot.release()
                elif kind == "unslot":
                    holdings.unslot(w, body[0])
                elif kind == "admit":
                    adm = holdings.admit(self, w, *body)  # (before the next message: its row)
                    if adm is not None:
                        adm.written = self._task(holdings.record(self, w, body[0], body[1], adm))
                elif kind == "view":
                    self._task(self._view(w, *body))
                elif kind in ("down", "up"):  # what a request found: one health, every
                    up = self.upstreams.get(body[0])  # worker told (as one process's Health)
                    if up is not None:
                        if kind == "down":
                            up.health.connect_failed(body[1])
                        else:
                            up.health.answered()
                        self.probed(up)
                elif kind in ("figures", "reloaded"):
                    fut = w.answers.pop(body[0], None)
                    if fut is not None and not fut.done():
                        fut.set_result(body[1])
                elif kind == "ready":
                    w.ready.set()
        finally:
            await self._lost(w)

    def _task(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _view(self, w: Worker, i: int, path: str, target: bytes) -> None:
        try:
            await self.gather()
            status, body, ctype, extra = admin_view(self, path, target)
        except RelayError as err:
            status, body, ctype, extra = err.status, err.body(), JSON, list(err.headers)
        except Exception as exc:  # a bug: the worker's client still gets an answer
            self.log.event("internal_error", error=f"{type(exc).__name__}: {exc}"[:300])
            bug = RelayError("internal_error", "internal relay error")
            status, body, ctype, extra = bug.status, bug.body(), JSON, []
        w.send(["view", i, status, body, ctype, [list(h) for h in extra]])

    async def _lost(self, w: Worker) -> None:
        """A worker's socket ended: it exited (drained) or died. What it held is given back;
        its admitted requests become crash rows; its last figures stay in the relay's."""
        if self.workers.get(w.index) is w:  # (first: no figure of it is summed twice)
            del self.workers[w.index]
        crashed = holdings.give_back(self, w)
        w.writer.close()
        if w.figures is not None:
            self.base = self._sum([w.figures] if self.base is None else [self.base, w.figures])
        code = await w.proc.wait()
        if self.draining or not self.started:
            return
        self.log.event("worker_lost", worker=w.index, pid=w.pid, exit_code=code, crash_rows=crashed)
        delay = RESTART_BACKOFF_S if time.monotonic() - w.started < RESTART_BACKOFF_S else 0.0
        while not self.draining:
            await asyncio.sleep(delay)  # (one that cannot start is not restarted in a loop)
            try:
                new = await self.spawn(w.index)
            except OSError as exc:  # (out of descriptors, no fork): again, a second later
                self.log.event("worker_restart_failed", worker=w.index, error=str(exc)[:300])
                delay = RESTART_BACKOFF_S
                continue
            self.log.event("worker_restarted", worker=w.index, pid=new.pid)
            return

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
        loop = asyncio.get_running_loop()
        asked = []
        for w in list(self.workers.values()):
            if w.gone or not w.ready.is_set():
                continue
            self._ids += 1
            fut = loop.create_future()
            w.answers[self._ids] = fut
            w.send(["figures", self._ids])
            asked.append((w, fut))
        if asked:
            await asyncio.wait([f for _, f in asked], timeout=FIGURES_WAIT_S)
        for w, fut in asked:
            if fut.done() and fut.result() is not None and not w.gone:
                w.figures = pickle.loads(fut.result())
        # the dead workers' first, the live ones' after: a last-seen figure is a live one's
        parts = [] if self.base is None else [self.base]
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
    async def reload_async(self, config: Config) -> dict:
        """The parent applies the file (a bad one: ConfigError, nothing changed anywhere),
        then every worker does; a worker that cannot is restarted on the new one."""
        async with self._reloading:
            summary = await reload.apply_async(self, config)
            self.budget_generations.append((time.time(), self.budgets.generation))
            raw = msgspec.msgpack.encode(config)
            loop = asyncio.get_running_loop()
            asked = []
            for w in list(self.workers.values()):
                self._ids += 1
                fut = loop.create_future()
                w.answers[self._ids] = fut
                w.send(["reload", self._ids, raw])
                asked.append((w, fut))
            if asked:
                await asyncio.wait([f for _, f in asked], timeout=10.0)
            for w, fut in asked:
                error = fut.result() if fut.done() else "no answer within 10 s"
                if error is not None and not w.gone:
                    self.log.event("worker_reload_failed", worker=w.index, error=str(error))
                    # it drains (its streams finish) and is restarted on the new configuration
                    w.send(["drain"])
            return summary

    def hurry(self) -> None:
        super().hurry()
        for w in self.workers.values():
            w.send(["hurry"])  # (a message: a signal to every process of the tree is one drain)

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        if drain_timeout_s is None:
            drain_timeout_s = self.config.server.drain_timeout_s
        self.draining = True
        if self._listen_sock is not None:
            self._listen_sock.close()  # (the workers' copies still accept until they stop)
        for up in self.all_upstreams():
            up.slots.close()  # queued requests are answered 503 shutting_down
        workers = list(self.workers.values())
        self.log.event("relay_draining", workers=len(workers), timeout_s=drain_timeout_s)
        for w in workers:
            w.send(["drain"])
        readers = set(self.readers)
        if readers:  # each ends once its worker's last rows are in
            _, late = await asyncio.wait(readers, timeout=drain_timeout_s + 15.0)
            for w in workers:
                if not w.gone or w.proc.returncode is None:
                    _signal(w, signal.SIGKILL)
            if late:
                await asyncio.wait(late, timeout=5.0)
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
        await self.store.aclose()
        if self.otel is not None:  # the parent's own gauges, their last export
            await self.otel.aclose()
        self.log.event(
            "relay_stopped",
            rows_written=self.store.rows_written,
            rows_dropped=self.store.rows_dropped,
        )
        self.log.flush()


def worker_environ(environ, index: int) -> dict:
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

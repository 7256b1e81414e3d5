"""One worker process of `relay serve --workers N`: a whole relay on the shared listening
socket, whose relay-wide state is its parent's (relay.workers.parent).

The per-event path is this process's alone; what crosses to the parent is per request:
- a slot (`RemoteBoard`): one round trip when a generating request takes one, a message
  when it gives it back; the parent's `Board` keeps each upstream's `parallel`, each pool's
  queue and the prefix table relay-wide;
- a keyed request's budget and admission record (`RemoteStore.admit`): one round trip,
  the parent reserving in its `Budgets` and writing the record, as one process does, with
  the slot of its first upstream asked for in the same message (relay.workers.ahead);
- the row (`WorkerApp.put_row`): a message, never awaited;
- the relay's own views (`/metrics`, `/api/slots/metrics`, `/api/ui/state`): answered by
  the parent from every worker's figures.
The parent probes the upstreams and tells every worker each verdict. A worker whose parent
is gone (its socket ends, or the kernel's parent-death signal) exits at once: no orphan
keeps the port.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import pickle
import signal
import socket
import sys

import msgspec

from relay.app import App, run
from relay.config import Config, ConfigError, DispatcherConfig, UpstreamConfig
from relay.errors import Code, RelayError
from relay.observe.log import Log, LogFormat, shared_stderr
from relay.observe.metrics import UpstreamMetrics
from relay.observe.record import Record
from relay.observe.ui_state import Trended
from relay.policy.budget import Budgets
from relay.proxy.app_view import ViewAnswer
from relay.proxy.client import ClientConn
from relay.proxy.client_writer import JSON
from relay.proxy.health import DOWN, READY, Change
from relay.proxy.upstreams import Upstream
from relay.store.admissions import AdmissionId
from relay.workers import wire
from relay.workers.remote import (
    ANSWER_GRACE_S,
    PARENT_GONE_EXIT,
    Link,
    LooseBudgets,
    RemoteBoard,
    RemoteSlots,
    RemoteStore,
)


class WorkerApp(App):
    """A relay whose slots, budgets, store and own views are its parent's, over its `Link`.
    Its log events are worker_listening, worker_draining and worker_stopped."""

    role = "worker"

    def __init__(self, config: Config, log: Log, link: Link, sock: socket.socket) -> None:
        self.link, self.sock = link, sock
        self.remote_store = RemoteStore(link, config.store.retention_days, self._slot_wait)
        self.remote_board = RemoteBoard(link, self._remote_slots)
        super().__init__(config, log)
        self.remote_view = self._ask_view
        # Set: drain and exit (`_main`).
        self.stopping = asyncio.Event()

    def _slot_wait(self) -> float:
        return self.config.dispatcher.pool_timeout_s

    def new_upstream(self, cfg: UpstreamConfig, d: DispatcherConfig) -> Upstream:
        """An upstream whose slots are the parent's."""
        up = super().new_upstream(cfg, d)
        up.slots = RemoteSlots(self.link, cfg.name, cfg.parallel, cfg.queue)
        return up

    @property
    def balancer(self) -> RemoteBoard:
        """Slots come from the parent's board."""
        return self.remote_board

    def _remote_slots(self, name: str) -> RemoteSlots | None:
        up = self.upstreams.get(name)
        slots = up.slots if up is not None else None
        return slots if isinstance(slots, RemoteSlots) else None

    def health_changed(self, up: Upstream, change: Change) -> None:
        """A request found an upstream down, or answering again: the parent is told (it
        probes a down one now, logs the change once for the relay, and tells every worker)."""
        if change.now is DOWN:
            self.link.send(wire.Down(up.name, change.error))
        elif change.now is READY:
            self.link.send(wire.Up(up.name))

    def opened(self) -> None:
        """The parent warns of an open relay, once."""

    def make_budgets(self, config: Config) -> Budgets:
        return LooseBudgets(config.key)

    def make_store(self, config: Config) -> RemoteStore:
        return self.remote_store

    async def listen(self) -> asyncio.Server:
        assert self.loop is not None
        return await self.loop.create_server(
            lambda: ClientConn(self), sock=self.sock, backlog=4096, start_serving=False
        )

    def put_row(
        self, rec: Record, admission: AdmissionId | None = None, trend: Trended = Trended.NONE
    ) -> None:
        """The row goes to the parent, which keeps it (App.put_row) and charges its key."""
        self.remote_store.send_row(rec, admission, trend)

    def gauged(self) -> list[UpstreamMetrics]:
        """Nothing: the relay-wide slots and queues are the parent's to report."""
        return []

    def start_probes(self) -> None:
        """The parent probes, once for the relay (`told` a `Health`)."""

    def _restore_budgets(self, windows: list[tuple[str, str]] | None = None) -> None:
        """The parent's budgets are rebuilt from the rows; this process keeps none."""

    async def _ask_view(self, path: str, target: bytes) -> ViewAnswer:
        """One of the relay's own views, answered by the parent from every worker's figures."""
        i, fut = self.link.view_answers.expect()
        self.link.send(wire.ViewAsk(i, path, target))
        try:
            answer = await asyncio.wait_for(fut, ANSWER_GRACE_S)
        except TimeoutError:
            err = RelayError(Code.SERVER_BUSY, "the relay's figures did not come in time")
            return ViewAnswer(err.status, err.body(), JSON, [])
        finally:
            self.link.view_answers.forget(i)
        return ViewAnswer(answer.status, answer.body, answer.content_type, answer.headers)

    def told(self, message: wire.Told) -> None:
        """A message from the parent that is not an answer. `Drain` is SIGTERM to the parent
        (or to the whole tree: one drain); `Hurry`, a second one: the drain ends now."""
        match message:
            case wire.Health(upstream=name):
                up = self.upstreams.get(name)
                if up is not None:
                    up.health.probe, up.health.last_error = message.probe, message.error
            case wire.FiguresAsk(id=i):
                # Pickled: the parent, this same program, adds them up.
                self.link.send(wire.Figures(i, pickle.dumps(self.registry)))
            case wire.Drain():
                self.stopping.set()
            case wire.Hurry():
                self.hurry()
                self.stopping.set()
            case wire.Reload(id=i, config=config):
                try:
                    self.reload(config)
                except ConfigError as exc:
                    self.link.send(wire.Reloaded(i, str(exc)))
                else:
                    self.link.send(wire.Reloaded(i, None))


_PR_SET_PDEATHSIG = 1


def _close_inherited(given: set[int]) -> None:
    """Close the descriptors this process inherited but the two it was `given` (the parent's
    launcher may have left some open without close-on-exec)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd > 2 and fd not in given:
            try:
                os.close(fd)
            except OSError:
                pass


def _die_with_parent() -> None:
    """The kernel ends this process when its parent dies (Linux: PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


async def _main(listen_fd: int, link_fd: int, index: int, fmt: LogFormat) -> int:
    log = Log(sink=shared_stderr, fmt=fmt)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(
        lambda _loop, ctx: log.event(
            "loop_error", message=str(ctx.get("message")), error=repr(ctx.get("exception"))[:300]
        )
    )
    sock = socket.socket(fileno=listen_fd)
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=link_fd))
    link = Link(reader, writer)
    try:
        first = await wire.read(reader, wire.FIRST)
    except msgspec.DecodeError:
        first = None
    if first is None:
        return PARENT_GONE_EXIT
    app = WorkerApp(first.config, log, link, sock)
    # SIGTERM here (sent to every process of the tree, as systemd does) is a drain, never a
    # hurry: the parent's `Drain` and `Hurry` say the rest (`told`). SIGINT and SIGHUP are
    # the parent's to act on.
    loop.add_signal_handler(signal.SIGTERM, app.stopping.set)
    for sig in (signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, lambda: None)
    await app.start()
    reading = loop.create_task(link.run(app))
    link.send(wire.Ready(os.getpid(), index))
    await app.stopping.wait()
    await app.stop()
    reading.cancel()
    writer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relay-worker")
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--link-fd", type=int, required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--log-format", type=LogFormat, default=LogFormat.JSON)
    args = p.parse_args(argv)
    _die_with_parent()
    _close_inherited({args.listen_fd, args.link_fd})
    if os.getppid() == 1:
        # The parent died before the line above.
        return PARENT_GONE_EXIT
    return run(_main(args.listen_fd, args.link_fd, args.index, args.log_format))


if __name__ == "__main__":
    sys.exit(main())

"""One worker process of `relay serve --workers N`: a whole relay on the shared listening
socket, whose relay-wide state is its parent's (relay.workers.parent).

The per-event path is this process's alone; what crosses to the parent is per request:
- a slot (`RemoteSlots`): one round trip when a generating request takes one, a message
  when it gives it back; the parent's `SlotPool` keeps `parallel` and the FIFO queue
  relay-wide;
- a keyed request's budget and admission record (`RemoteStore.admit`): one round trip,
  the parent reserving in its `Budgets` and writing the record, as one process does, with
  the slot of its first upstream asked for in the same message;
- the row (`WorkerApp.keep`): a message, never awaited;
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
from relay.config import Config, ConfigError
from relay.errors import RelayError
from relay.observe.log import Log, shared_stderr
from relay.observe.record import field_values
from relay.policy.budget import Budgets
from relay.proxy.client import ClientConn
from relay.proxy.endpoints import JSON
from relay.workers import wire
from relay.workers.remote import (
    ANSWER_GRACE_S,
    PARENT_GONE_EXIT,
    Link,
    LooseBudgets,
    RemoteSlots,
    RemoteStore,
)


class WorkerApp(App):
    role = "worker"  # worker_listening, worker_draining, worker_stopped

    def __init__(self, config: Config, log: Log, link: Link, sock: socket.socket) -> None:
        self.link, self.sock = link, sock
        super().__init__(config, log)
        self.remote_view = self._view
        self.stopping = asyncio.Event()  # set: drain and exit (`_main`)

    def new_upstream(self, cfg, d):
        up = super().new_upstream(cfg, d)
        up.slots = RemoteSlots(self.link, cfg.name, cfg.parallel, cfg.queue)
        # a request that finds it down tells the parent (which probes it now), and one that
        # gets an answer from it again, that it is up
        up.health.on_down = lambda up=up: self.link.send(["down", up.name, up.health.last_error])
        up.health.on_up = lambda up=up: self.link.send(["up", up.name])
        return up

    def make_budgets(self, config: Config) -> Budgets:
        return LooseBudgets(config.key)

    def make_store(self, config: Config):
        return RemoteStore(self.link, config.store.retention_days, self)

    async def listen(self) -> asyncio.Server:
        assert self.loop is not None
        return await self.loop.create_server(
            lambda: ClientConn(self), sock=self.sock, backlog=4096, start_serving=False
        )

    def keep(self, rec, admission=None, trend: bool | None = None) -> None:
        """The row goes to the parent, which keeps it (App.keep) and charges its key (and
        gives back a slot asked for with the admission that the request did not take)."""
        if admission is not None:
            self.link.drop_ahead(admission)
        self.link.send(["row", field_values(rec), admission, trend])

    def gauged(self) -> list:
        return []  # (the relay-wide slots and queues are the parent's to report)

    def start_probes(self) -> None:
        """The parent probes, once for the relay (`told("health")`)."""

    def _restore_budgets(self, windows=None) -> None:
        """The parent's budgets are rebuilt from the rows; this process keeps none."""

    async def _view(self, client, req, rid: bytes, cors, path: str) -> None:
        i, fut = self.link.ask("view", path, req.target)
        try:
            status, body, ctype, extra = await asyncio.wait_for(fut, ANSWER_GRACE_S)
        except TimeoutError:
            err = RelayError("server_busy", "the relay's figures did not come in time")
            status, body, ctype, extra = err.status, err.body(), JSON, []
        finally:
            self.link.forget(i)
        headers = [(bytes(k), bytes(v)) for k, v in extra]
        client.respond(status, body, rid, req.keep_alive, cors + headers, content_type=ctype)

    def told(self, kind: str, body: list) -> None:
        """A message from the parent that is not an answer."""
        if kind == "health":
            name, probe, error = body
            up = self.upstreams.get(name)
            if up is not None:
                up.health.probe, up.health.last_error = probe, error
        elif kind == "figures":
            self.link.send(["figures", body[0], pickle.dumps(self.registry)])  # (summed there)
        elif kind == "drain":  # SIGTERM to the parent (or the whole tree: one drain)
            self.stopping.set()
        elif kind == "hurry":  # a second one: the drain ends now
            self.hurry()
            self.stopping.set()
        elif kind == "reload":
            i, raw = body
            try:
                self.reload(msgspec.msgpack.decode(raw, type=Config))
                self.link.send(["reloaded", i, None])
            except ConfigError as exc:
                self.link.send(["reloaded", i, str(exc)])


def _close_inherited(keep: set[int]) -> None:
    """Close the descriptors this process inherited but the two it was given (the parent's
    launcher may have left some open without close-on-exec)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd > 2 and fd not in keep:
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
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


async def _main(listen_fd: int, link_fd: int, index: int) -> int:
    log = Log(sink=shared_stderr)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(
        lambda _loop, ctx: log.event(
            "loop_error", message=str(ctx.get("message")), error=repr(ctx.get("exception"))[:300]
        )
    )
    sock = socket.socket(fileno=listen_fd)
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=link_fd))
    link = Link(reader, writer)
    first = await wire.read(reader)
    if first is None or first[0] != "config":
        return PARENT_GONE_EXIT
    config = msgspec.msgpack.decode(first[1], type=Config)
    app = WorkerApp(config, log, link, sock)
    link.app = app
    stop = app.stopping
    # SIGTERM here (sent to every process of the tree, as systemd does): drain, never hurry;
    # the parent's "drain" and "hurry" messages say the rest (`told`)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    for sig in (signal.SIGINT, signal.SIGHUP):  # the parent's to act on
        loop.add_signal_handler(sig, lambda: None)
    await app.start()
    reading = loop.create_task(link.run())
    link.send(["ready", os.getpid(), index])
    await stop.wait()
    await app.stop()
    reading.cancel()
    writer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relay-worker")
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--link-fd", type=int, required=True)
    p.add_argument("--index", type=int, default=0)
    args = p.parse_args(argv)
    _die_with_parent()
    _close_inherited({args.listen_fd, args.link_fd})
    if os.getppid() == 1:  # the parent died before the line above
        return PARENT_GONE_EXIT
    return run(_main(args.listen_fd, args.link_fd, args.index))


if __name__ == "__main__":
    sys.exit(main())

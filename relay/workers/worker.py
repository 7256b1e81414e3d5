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
import concurrent.futures
import ctypes
import itertools
import os
import pickle
import signal
import socket
import sys
import time
from dataclasses import fields
from operator import attrgetter

import msgspec

from relay.app import App, run
from relay.config import Config, ConfigError
from relay.errors import RelayError
from relay.observe.log import Log, shared_stderr
from relay.observe.record import Record
from relay.observe.ui_state import generating
from relay.policy.budget import BudgetExceeded, Budgets, Reservation
from relay.proxy.client import ClientConn
from relay.proxy.dispatch import ADMIT_WAIT_S
from relay.proxy.slots import Busy, SlotsClosed
from relay.workers import wire

RECORD_FIELDS = tuple(f.name for f in fields(Record))
record_values = attrgetter(*RECORD_FIELDS)  # a Record's fields in order: Record(*values)
PARENT_GONE_EXIT = 3
ANSWER_GRACE_S = 10.0  # past its own bound, a parent that has not answered is not answering


class Link:
    """The worker's end of its socket to the parent: requests with answers, and messages."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.app: WorkerApp | None = None
        self.outbox = wire.Outbox(writer)
        self.send = self.outbox.send
        # slots asked for with a keyed request's admission (one round trip for both), by its
        # admission id: (upstream, the slot's exchange id, its answer)
        self.ahead: dict[int, tuple[str, int, asyncio.Future]] = {}

    def ask_later(self) -> tuple[int, asyncio.Future]:
        """An id and the future of an answer asked for inside another message."""
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[i] = fut
        return i, fut

    def ask(self, kind: str, *body) -> tuple[int, asyncio.Future]:
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[i] = fut
        self.send([kind, i, *body])
        return i, fut

    def forget(self, i: int) -> None:
        self.pending.pop(i, None)

    async def run(self) -> None:
        """Read the parent's messages until it is gone; then this process ends at once (a
        worker that cannot hear its parent must not go on taking connections)."""
        try:
            while True:
                message = await wire.read(self.reader)
                if message is None:
                    break
                kind, body = message[0], message[1:]
                if kind in ("slot", "admit", "view"):
                    fut = self.pending.pop(body[0], None)
                    if fut is not None and not fut.done():
                        fut.set_result(body[1:])
                elif self.app is not None:
                    try:
                        self.app.told(kind, body)
                    except Exception as exc:  # a bug: said, and the link goes on
                        self.app.log.event(
                            "internal_error", error=f"{type(exc).__name__}: {exc}"[:300]
                        )
        except asyncio.CancelledError:
            raise
        except BaseException:
            pass
        os._exit(PARENT_GONE_EXIT)  # its streams cannot settle anywhere now


class RemoteSlot:
    __slots__ = ("i", "pool", "released")

    def __init__(self, pool: RemoteSlots, i: int) -> None:
        self.pool, self.i, self.released = pool, i, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool.in_flight -= 1
            self.pool.link.send(["free", self.i])


class RemoteSlots:
    """An upstream's slots as a worker takes them: from the parent's pool (`SlotPool`'s
    interface; `in_flight` and `queued` are this worker's share)."""

    def __init__(self, link: Link, name: str, parallel: int, queue: int) -> None:
        self.link, self.name = link, name
        self.parallel, self.queue = parallel, queue
        self.in_flight = 0
        self.waiters: set[asyncio.Future] = set()
        self.closed = False

    @property
    def queued(self) -> int:
        return len(self.waiters)

    def close(self) -> None:
        self.closed = True
        for fut in list(self.waiters):
            if not fut.done():
                fut.set_exception(SlotsClosed())

    def resize(self, parallel: int, queue: int) -> None:
        self.parallel, self.queue = parallel, queue  # (the parent's pool is resized there)

    async def acquire(self, timeout: float, admission=None) -> RemoteSlot:
        if self.closed:
            raise SlotsClosed()
        ahead = self.link.ahead.pop(admission, None) if admission is not None else None
        if ahead is not None and ahead[0] == self.name:
            _, i, fut = ahead  # asked for with the admission: its answer is on its way, or in
        else:
            if ahead is not None:  # (asked on another upstream: given back)
                self.link.forget(ahead[1])
                self.link.send(["unslot", ahead[1]])
            i, fut = self.link.ask("slot", self.name, timeout)
        self.waiters.add(fut)
        try:
            try:  # (the parent answers within `timeout`; beyond, it is not answering)
                answer, why = await asyncio.wait_for(fut, timeout + ANSWER_GRACE_S)
            except TimeoutError:  # (a grant that comes after all goes back)
                self.link.forget(i)
                self.link.send(["unslot", i])
                answer, why = "busy", "the relay's slots did not answer"
        except BaseException:  # cancelled, or closed here: a slot granted meanwhile goes back
            self.link.forget(i)
            self.link.send(["unslot", i])
            raise
        finally:
            self.waiters.discard(fut)
        if answer == "ok":
            self.in_flight += 1
            return RemoteSlot(self, i)
        if answer == "closed":
            raise SlotsClosed()
        raise Busy(why)


class LooseBudgets(Budgets):
    """A worker's budgets: the keys and limits of its configuration, every check and every
    figure the parent's. `reserve` only says whether the request must be admitted there (a
    key with limits: `RemoteStore.admit`)."""

    def reserve(self, key_id: str, tokens: int, now: float) -> Reservation:
        kb = self.keys.get(key_id)
        limited = kb is not None and bool(kb.windows)
        return Reservation(key_id, tokens, settled=not limited, admitted_at=now)

    def settle(self, res: Reservation, requests: int, tokens: int, now: float) -> None:
        res.done = res.settled = True  # (charged by the parent, from the row)

    def restore(self, key_id: str, kind: str, requests: int, tokens: int, now: float) -> None:
        pass

    def usage(self, key_id: str, now: float) -> dict:
        return {}


class RemoteStore:
    """The store as a worker writes to it: rows and admissions go to the parent's."""

    rows_dropped = 0
    rows_written = 0
    recovered = 0
    pending = 0

    def __init__(self, link: Link, retention_days: float, app=None) -> None:
        self.link = link
        self.retention_days = retention_days
        self.app = app  # (its configuration's slot wait)
        self._ids = itertools.count(1)

    def start(self) -> None:
        pass

    @property
    def slot_timeout_s(self) -> float:
        return self.app.config.dispatcher.pool_timeout_s if self.app is not None else 0.0

    def next_admission_id(self) -> int:
        return next(self._ids)  # (this worker's: the parent keeps its own for the record)

    async def admit(
        self,
        admission_id,
        rec,
        prompt_tokens: int,
        completion_tokens: int,
        timeout: float | None = None,
        res=None,
    ) -> None:
        ahead = None  # a request that takes a slot asks for it now: one round trip for both
        if generating(rec) and rec.upstream_requested is not None:
            j, answer_fut = self.link.ask_later()
            ahead = [rec.upstream_requested, self.slot_timeout_s, j]
            self.link.ahead[admission_id] = (rec.upstream_requested, j, answer_fut)
        i, fut = self.link.ask(
            "admit", admission_id, record_values(rec), prompt_tokens, completion_tokens, ahead
        )
        try:
            answer, details = await asyncio.wait_for(fut, ADMIT_WAIT_S + ANSWER_GRACE_S)
        finally:
            self.link.forget(i)
        if answer == "exceeded" and ahead is not None:  # (no slot was taken for it)
            self.link.ahead.pop(admission_id, None)
            self.link.forget(ahead[2])
        if answer == "exceeded":
            limit, used, limit_value, resets_at = details
            raise BudgetExceeded(limit, used, limit_value, resets_at, time.time())
        if answer == "timeout":
            raise TimeoutError(details)
        if answer != "ok":
            raise RuntimeError(details)

    def usage_read(self, windows: list) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result([(0, 0) for _ in windows])  # (the parent rebuilds its budgets)
        return fut

    def usage_since(self, key_id, since_ts: float, served_only: bool = False):
        return 0, 0

    async def maintain(self, app) -> None:
        pass

    async def aclose(self) -> None:
        writer = self.link.writer
        self.link.outbox.flush()
        if not writer.is_closing():
            await writer.drain()  # every row is with the parent before this process ends


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
        ahead = self.link.ahead.pop(admission, None) if admission is not None else None
        if ahead is not None:
            self.link.forget(ahead[1])
        self.link.send(["row", record_values(rec), admission, trend])

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
            status, body, ctype, extra = err.status, err.body(), b"application/json", []
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
            self.link.send(["figures", body[0], pickle.dumps(self.figures())])
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

    def figures(self):
        """This worker's metrics, for the parent to add up (observe.metrics_merge)."""
        return self.registry


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

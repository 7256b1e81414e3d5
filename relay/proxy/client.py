"""The client side: an asyncio.Protocol reading requests with h11, one at a time.

h11 parses each request head and body; responses are written as raw bytes by the exchange or
by the relay itself. Once a request is read whole its h11 connection is dropped (whatever the
client sent past it waits in the inbox: pipelining), and the next request's first byte makes
a fresh one, so h11 never has to be told about a body it did not frame.

Received bytes wait in an inbox and are handed to h11 in bounded slices, a bounded number of
events per loop turn, so one client sending a body in tiny chunks cannot hold the event loop;
the head deadline runs until the body is whole. The head is judged before any body byte is
read (`policy.request_head`): size, ambiguous framing, the caller's key and the relay-wide
body memory bound (`body_memory`).
"""

from __future__ import annotations

import asyncio

import h11

from relay.errors import RelayError, reason_phrase
from relay.http import fields, request_framing
from relay.http.to_client import relay_response
from relay.policy import request_head
from relay.proxy.request import Request

_READ_BUFFER_LIMIT = 64 * 1024  # bytes received but not parsed before reading pauses
WRITE_HIGH_WATER = 64 * 1024
_SLICE = 16 * 1024  # bytes handed to h11 at a time
_TURN_EVENTS = 256  # h11 events handled for one connection per loop turn
_TURN_BYTES = 128 * 1024  # bytes handed to h11 for one connection per loop turn
LINGER_S = 2.0  # how long a refused client's input is read and discarded before the close
_NEED, _STOP, _MORE = 0, 1, 2  # what _process leaves: wants bytes / stopped / out of turn


class ClientConn(asyncio.Protocol):
    # One per open client connection, alive as long as it: no instance dict.
    # fmt: off
    __slots__ = (
        "app", "awaiting_head", "body", "body_size", "busy", "chunks", "drain_waiter",
        "exchange", "gone", "h11", "head", "head_bytes", "held", "http11", "inbox", "key_id",
        "lingering", "loop", "path", "peer_host", "raw", "task", "timer", "timer_kind",
        "transport", "turn", "wants_keep_alive",
    )
    # fmt: on
    transport: asyncio.Transport  # set by connection_made, before anything reads it

    def __init__(self, app) -> None:
        self.app = app
        self.loop = app.loop
        # The h11 connection parsing the next request: made when its first byte arrives and
        # dropped once the request is read whole (a stream being relayed, or a connection
        # idle between requests, holds none: about 1 KB each).
        self.h11: h11.Connection | None = None
        self.busy = False  # a request is being served
        self.inbox = bytearray()  # bytes received and not yet handed to h11
        self.turn: asyncio.Handle | None = None  # a scheduled continuation of the parsing
        self.gone = False
        self.lingering = False  # answered an error mid-request: discard input, then close
        self.exchange = None  # the Exchange relaying to us, for flow control and close
        self.drain_waiter: asyncio.Future | None = None
        self.task: asyncio.Task | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_kind = ""
        self.head: h11.Request | None = None
        self.raw: list = []  # the head's headers (headers.HeaderList)
        self.head_bytes = bytearray()  # bytes handed to h11 since the last head (obs-fold check)
        self.awaiting_head = True
        self.key_id: str | None = None
        self.peer_host: str | None = None  # the client's address (admin access: relay.access)
        self.path = ""
        self.body = bytearray()
        self.body_size = 0
        self.chunks = 0
        self.held = 0  # body bytes taken from the relay-wide bound
        self.http11 = True
        self.wants_keep_alive = True

    def _new_h11(self) -> h11.Connection:
        return h11.Connection(
            h11.SERVER, max_incomplete_event_size=self.app.config.server.max_header_bytes
        )

    # ---- asyncio callbacks -----------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        self.peer_host = peer[0] if isinstance(peer, tuple) and peer else None
        self.app.clients.add(self)
        if self.app.draining:
            self.gone = True
            transport.close()
            return
        self._arm("head", self.app.config.server.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        if not (self.busy or self.inbox or self.turn) and len(data) <= _SLICE:
            # the common case: a small read while idle goes to h11 without a copy
            if self.timer_kind == "idle":
                self._arm("head", self.app.config.server.header_timeout_s)
            self._give(data)
            self._pump()
            return
        self.inbox += data
        if len(self.inbox) > _READ_BUFFER_LIMIT:
            self.transport.pause_reading()
        if self.busy or self.turn is not None:
            return
        if self.timer_kind == "idle":  # first byte of a next request: its head is now due
            self._arm("head", self.app.config.server.header_timeout_s)
        self._pump()

    def eof_received(self):
        # A client that closes its end is gone: stop the upstream at once.
        return False

    def connection_lost(self, exc) -> None:
        self.gone = True
        self.app.forget(self)
        self._disarm()
        self._cancel_turn()
        self.inbox = bytearray()
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_result(None)
        if self.exchange is not None:
            self.exchange.client_gone()
        elif self.task is not None and not self.task.done():
            self.task.cancel()
        if self.busy and self.task is not None and not self.task.done():
            # the request being served gives its body back when it ends (even if its task is
            # cancelled before it ever ran); no next request can start on this connection
            self.task.add_done_callback(lambda _t: self._release_body())
        else:
            self._release_body()

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.client_paused()

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.client_resumed()
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_result(None)

    async def drained(self, timeout: float) -> str:
        """Wait until everything written has left for the client (or it is gone / too slow).

        With the low-water mark at 0 the transport calls resume_writing only once its buffer
        is empty; the slot is held until then, as llama-server's client has not read it all.
        """
        if self.gone:
            return "gone"
        if self.transport.get_write_buffer_size() == 0:
            return "drained"
        self.drain_waiter = self.loop.create_future()
        self.transport.set_write_buffer_limits(high=1, low=0)
        try:
            await asyncio.wait_for(self.drain_waiter, timeout)
        except TimeoutError:
            self.gone = True
            self.transport.abort()
            return "timeout"
        finally:
            self.drain_waiter = None
            if not self.gone:
                self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        return "gone" if self.gone else "drained"

    # ---- request reading ---------------------------------------------------------------
    def _pump(self) -> None:
        """Parse what the inbox holds, within one turn's bounds; continue in a later turn."""
        self.turn = None
        budget, fed, state = _TURN_EVENTS, 0, _NEED
        while not (self.busy or self.gone or self.lingering):
            state, budget = self._process(budget)
            if state != _NEED or not self.inbox or fed >= _TURN_BYTES:
                break
            fed += self._feed()
        if self.busy or self.gone or self.lingering:
            return
        if state == _MORE or (state == _NEED and self.inbox):
            self.turn = self.loop.call_soon(self._pump)
        elif len(self.inbox) <= _READ_BUFFER_LIMIT:
            self.transport.resume_reading()

    def _feed(self) -> int:
        piece = bytes(self.inbox[:_SLICE])
        del self.inbox[:_SLICE]
        self._give(piece)
        return len(piece)

    def _give(self, piece: bytes) -> None:
        if self.awaiting_head:
            self.head_bytes += piece
        if self.h11 is None:
            self.h11 = self._new_h11()
        self.h11.receive_data(piece)

    def _cancel_turn(self) -> None:
        if self.turn is not None:
            self.turn.cancel()
            self.turn = None

    def _process(self, budget: int) -> tuple[int, int]:
        conn = self.h11
        if conn is None:  # no byte of a next request yet
            return _NEED, budget
        try:
            while budget > 0:
                ev = conn.next_event()
                budget -= 1
                if ev is h11.NEED_DATA:
                    return _NEED, budget
                if isinstance(ev, h11.Request):
                    self._on_head(conn, ev)
                    if self.busy or self.gone:
                        return _STOP, budget
                elif isinstance(ev, h11.Data):
                    if not self._on_data(ev):
                        return _STOP, budget
                elif isinstance(ev, h11.EndOfMessage):
                    self._dispatch(conn)
                    return _STOP, budget
                else:  # PAUSED or ConnectionClosed: nothing more to read on this connection
                    return _STOP, budget
            return _MORE, 0
        except h11.RemoteProtocolError as exc:
            self._reject(request_head.malformed(exc.error_status_hint, str(exc)))
            return _STOP, budget

    def _on_head(self, conn: h11.Connection, ev: h11.Request) -> None:
        self.head = ev
        self.awaiting_head = False
        folded = request_framing.has_obs_fold(self.head_bytes)
        self.head_bytes = bytearray()
        self.body = bytearray()
        self.body_size = self.chunks = 0
        raw = self.raw = fields.request_headers(ev.headers)
        app = self.app
        verdict = request_head.judge(
            app.config.server,
            app.auth,
            ev.method,
            ev.target,
            ev.http_version,
            raw,
            folded,
            self.peer_host,
            app.dispatcher.bodies,
        )
        self.http11, self.wants_keep_alive = verdict.http11, verdict.keep_alive
        self.path, self.key_id = verdict.path, verdict.key_id
        if verdict.refusal is not None:
            self._reject(verdict.refusal)
            return
        if conn.they_are_waiting_for_100_continue:
            self.transport.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))

    def _on_data(self, ev: h11.Data) -> bool:
        """Buffer one piece of body; False when the request was refused instead."""
        cfg = self.app.config.server
        n = len(ev.data)
        if ev.chunk_start:
            self.chunks += 1
            if self.chunks > cfg.max_body_chunks:
                self._reject(request_head.too_many_chunks(cfg.max_body_chunks))
                return False
        self.body_size += n
        if self.body_size > cfg.max_body_bytes:
            self._reject(request_head.too_large(cfg.max_body_bytes))
            return False
        bodies = self.app.dispatcher.bodies
        if not bodies.take(n):
            self._reject(request_head.busy(bodies.limit))
            return False
        self.held += n
        self.body += ev.data
        return True

    def _release_body(self) -> None:
        self.body = bytearray()
        if self.held:
            self.app.dispatcher.bodies.give(self.held)
            self.held = 0

    def _dispatch(self, conn: h11.Connection) -> None:
        self._disarm()
        ev = self.head
        assert ev is not None  # (the head came before its end: `_on_head`)
        body = bytes(self.body)
        self.body = bytearray()
        req = Request(
            ev.method,
            ev.target,
            self.raw,
            body,
            self.http11,
            self.wants_keep_alive,
            self.key_id,
            self.path,
        )
        self.head = None
        self.raw = []
        self.busy = True
        # The request is read whole: what h11 holds past it (a pipelined next request) waits
        # in the inbox with what arrives meanwhile, and h11 itself is dropped (see __init__).
        self.inbox[:0] = conn.trailing_data[0]
        self.h11 = None
        self.task = self.loop.create_task(self.app.dispatcher.handle(self, req))
        self.app.track(self.task)  # in the drain's count from now, not from its first step

    def _reject(self, err: RelayError) -> None:
        """An error before the request could be read whole: answer and close."""
        self._disarm()
        self._cancel_turn()
        self.busy = True
        self.inbox = bytearray()
        self._release_body()
        self.app.rejected(self, err)
        self.respond(err.status, err.body(), None, keep_alive=False, extra=err.headers)
        self.exchange = None
        self.task = None
        if self.gone:
            return
        # Lingering close: the client may still be sending; closing with its bytes unread
        # would reset the connection and could destroy the answer before it is read.
        self.lingering = True
        self.transport.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.timer = self.loop.call_later(LINGER_S, self.transport.close)

    # ---- responding --------------------------------------------------------------------
    def respond(
        self,
        status: int,
        body: bytes,
        request_id: bytes | None,
        keep_alive: bool,
        extra=(),
        content_type: bytes = b"application/json",
    ) -> None:
        if self.gone:
            return
        self.transport.write(
            relay_response(
                status, reason_phrase(status), body, request_id, keep_alive, extra, content_type
            )
        )

    def finish(self, keep_alive: bool) -> None:
        """The response is written: read the next request, or close."""
        self.exchange = None
        self.task = None
        self._release_body()
        if self.gone:
            return
        if not keep_alive or self.app.draining:
            self.gone = True
            self.transport.close()
            return
        self.h11 = None  # (already, unless the request was answered before it was read whole)
        self.awaiting_head = True
        self.head_bytes = bytearray()
        self.busy = False
        self.transport.resume_reading()
        self._arm("idle", self.app.config.server.keepalive_timeout_s)
        if self.inbox:
            self._arm("head", self.app.config.server.header_timeout_s)
            self._pump()

    # ---- timers --------------------------------------------------------------------
    def _arm(self, kind: str, delay: float) -> None:
        self._disarm()
        self.timer_kind = kind
        self.timer = self.loop.call_later(delay, self._timeout)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.timer_kind = ""

    def _timeout(self) -> None:
        kind = self.timer_kind
        self.timer = None
        self.timer_kind = ""
        if self.gone or self.busy:
            return
        if kind == "idle":
            self.gone = True
            self.transport.close()
            return
        self._reject(RelayError("request_timeout", "request head/body not received in time"))

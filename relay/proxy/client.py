"""The client side: an asyncio.Protocol reading requests with h11, one at a time.

h11 parses each request head and body; every byte the client gets goes through the
connection's one writer (`client_writer.ClientWriter`), made with the connection. Once a
request is read whole its h11 connection is dropped (whatever the client sent past it waits
in the inbox: pipelining), and the next request's first byte makes a fresh one, so h11
never has to be told about a body it did not frame.

Received bytes wait in an inbox and are handed to h11 in bounded slices, a bounded number of
events per loop turn, so one client sending a body in tiny chunks cannot hold the event loop;
the head deadline runs until the body is whole. The head is judged before any body byte is
read (`policy.request_head`): size, ambiguous framing, the caller's key and the relay-wide
body memory bound (`body_memory`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from enum import Enum, auto
from typing import TYPE_CHECKING, Protocol

import h11

from relay.errors import Code, RelayError, shutting_down
from relay.http import fields, request_framing, usual_head
from relay.policy import request_head
from relay.proxy import settle
from relay.proxy.app_view import AppView
from relay.proxy.client_writer import ClientWriter
from relay.proxy.request import Request

if TYPE_CHECKING:
    from relay.proxy.exchange import Exchange

# Bytes received but not parsed before reading pauses.
_READ_BUFFER_LIMIT = 64 * 1024
# Bytes handed to h11 at a time, h11 events handled for one connection per loop turn, and
# bytes handed to h11 for one connection per loop turn.
_SLICE = 16 * 1024
_TURN_EVENTS = 256
_TURN_BYTES = 128 * 1024
# How long a refused client's input is read and discarded before the close.
LINGER_S = 2.0


class _Parse(Enum):
    """What one pass of the parser leaves: it wants bytes, it stopped, or its turn ran out."""

    NEED = auto()
    STOP = auto()
    MORE = auto()


class _Wait(Enum):
    """What the connection's timer bounds: nothing, a request's head and body, or the idle
    time between requests."""

    NONE = auto()
    HEAD = auto()
    IDLE = auto()


# Module-level names for the members the per-request code compares: an enum member looked up
# on its class costs Python 3.11 a lookup through the class's metaclass each time.
_NEED, _STOP, _MORE = _Parse
_NO_WAIT, _HEAD, _IDLE = _Wait


class RequestHandler(Protocol):
    """What serves a request read whole (`dispatch.Dispatcher`)."""

    def handle(self, client: ClientConn, req: Request) -> Coroutine[object, object, None]:
        """The request's life, as a task."""
        ...

    def request_id(self, headers: fields.Headers) -> bytes: ...


class ConnHost(AppView, Protocol):
    """What a client connection needs of the relay: the App's figures, what serves its
    requests, and the relay's own bookkeeping of connections."""

    @property
    def dispatcher(self) -> RequestHandler: ...

    def connected(self, client: ClientConn) -> None: ...

    def forget(self, client: ClientConn) -> None: ...


class ClientConn(asyncio.Protocol):
    # One per open client connection, alive as long as it: no instance dict.
    __slots__ = (
        "app",
        "awaiting_head",
        "body",
        "body_size",
        "busy",
        "chunks",
        "exchange",
        "h11",
        "head",
        "head_bytes",
        "held",
        "http11",
        "inbox",
        "key_id",
        "lingering",
        "loop",
        "out",
        "path",
        "peer_host",
        "task",
        "timer",
        "transport",
        "turn",
        "wait",
        "wants_keep_alive",
    )
    # Set by connection_made, before anything reads them.
    transport: asyncio.Transport
    out: ClientWriter

    def __init__(self, app: ConnHost) -> None:
        self.app = app
        self.loop = app.loop
        # The h11 connection parsing the next request: made when its first byte arrives and
        # dropped once the request is read whole (a stream being relayed, or a connection
        # idle between requests, holds none: about 1 KB each).
        self.h11: h11.Connection | None = None
        # A request is being served.
        self.busy = False
        # Bytes received and not yet handed to h11 (b"" while none: an open connection keeps
        # no buffer; a bytearray once it held any), and a scheduled continuation of the
        # parsing.
        self.inbox: bytes | bytearray = b""
        self.turn: asyncio.Handle | None = None
        # Answered an error mid-request: input is read and discarded, then the close.
        self.lingering = False
        # The exchange relaying to this connection (flow control, the client leaving).
        self.exchange: Exchange | None = None
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.wait = _NO_WAIT
        self.head: fields.RequestHead | None = None
        # Bytes handed to h11 since the last head (the obs-fold check), and the body read
        # so far: b"" between requests (a stream being relayed keeps no buffer), the piece
        # itself while there is one, a bytearray from the second piece on.
        self.head_bytes: bytes | bytearray = b""
        self.awaiting_head = True
        self.key_id: str | None = None
        # The client's address (the admin rule reads it).
        self.peer_host: str | None = None
        self.path = ""
        self.body: bytes | bytearray = b""
        self.body_size = 0
        self.chunks = 0
        # Body bytes taken from the relay-wide bound.
        self.held = 0
        self.http11 = True
        self.wants_keep_alive = True

    def _new_h11(self) -> h11.Connection:
        return h11.Connection(
            h11.SERVER, max_incomplete_event_size=self.app.config.server.max_header_bytes
        )

    # ---- asyncio callbacks -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if TYPE_CHECKING:
            # A stream transport: uvloop's is not an asyncio.Transport subclass, but offers
            # all it does (so this is for the type checker only).
            assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.out = ClientWriter(self.loop, self.transport)
        peer = transport.get_extra_info("peername")
        self.peer_host = peer[0] if isinstance(peer, tuple) and peer else None
        self.app.connected(self)
        if self.app.draining:
            self._close()
            return
        self._arm(_HEAD, self.app.config.server.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        if not (self.busy or self.inbox or self.turn) and len(data) <= _SLICE:
            # The common case: a small read while idle, a whole request (`usual_head`) or
            # the start of one for h11, without a copy.
            if self.wait is _IDLE:
                self._arm(_HEAD, self.app.config.server.header_timeout_s)
            if self.h11 is None and self._whole(data):
                return
            self._give(data)
            self._pump()
            return
        inbox = self.inbox
        if inbox:
            inbox += data
        else:
            inbox = self.inbox = bytearray(data)
        if len(inbox) > _READ_BUFFER_LIMIT:
            self.transport.pause_reading()
        if self.busy or self.turn is not None:
            return
        if self.wait is _IDLE:
            # The first byte of a next request: its head is due now.
            self._arm(_HEAD, self.app.config.server.header_timeout_s)
        self._pump()

    def eof_received(self) -> bool:
        # A client that closes its end is gone: the upstream stops at once.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.out.closed()
        self.app.forget(self)
        self._disarm()
        self._cancel_turn()
        self.inbox = b""
        if self.exchange is not None:
            self.exchange.client_gone()
        elif self.task is not None and not self.task.done():
            self.task.cancel()
        if self.busy and self.task is not None and not self.task.done():
            # The request being served gives its body back when it ends (even if its task is
            # cancelled before it ever ran); no next request can start on this connection.
            self.task.add_done_callback(lambda _t: self._release_body())
        else:
            self._release_body()

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.client_paused()

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.client_resumed()
        self.out.resumed()

    # ---- request reading ---------------------------------------------------------------
    def _pump(self) -> None:
        """Parse what the inbox holds, within one turn's bounds; continue in a later turn."""
        self.turn = None
        budget, fed, state = _TURN_EVENTS, 0, _NEED
        while not (self.busy or self.out.gone or self.lingering):
            state, budget = self._process(budget)
            if state is not _NEED or not self.inbox or fed >= _TURN_BYTES:
                break
            fed += self._feed()
        if self.busy or self.out.gone or self.lingering:
            return
        if state is _MORE or (state is _NEED and self.inbox):
            self.turn = self.loop.call_soon(self._pump)
        elif len(self.inbox) <= _READ_BUFFER_LIMIT:
            self.transport.resume_reading()

    def _feed(self) -> int:
        inbox = self.inbox
        # (Called only while the inbox holds bytes: a bytearray then.)
        assert isinstance(inbox, bytearray)
        piece = bytes(inbox[:_SLICE])
        del inbox[:_SLICE]
        self._give(piece)
        return len(piece)

    def _give(self, piece: bytes) -> None:
        if self.awaiting_head:
            head = self.head_bytes
            if not head:
                self.head_bytes = piece
            else:
                if not isinstance(head, bytearray):
                    head = self.head_bytes = bytearray(head)
                head += piece
        if self.h11 is None:
            self.h11 = self._new_h11()
        self.h11.receive_data(piece)

    def _cancel_turn(self) -> None:
        if self.turn is not None:
            self.turn.cancel()
            self.turn = None

    def _process(self, budget: int) -> tuple[_Parse, int]:
        conn = self.h11
        if conn is None:
            # No byte of a next request yet.
            return _NEED, budget
        try:
            while budget > 0:
                ev = conn.next_event()
                budget -= 1
                if ev is h11.NEED_DATA:
                    return _NEED, budget
                if isinstance(ev, h11.Request):
                    folded = request_framing.has_obs_fold(self.head_bytes)
                    self._on_head(fields.request_head(ev), folded, conn)
                    if self.busy or self.out.gone:
                        return _STOP, budget
                elif isinstance(ev, h11.Data):
                    if not self._take_body(ev.data, ev.chunk_start):
                        return _STOP, budget
                elif isinstance(ev, h11.EndOfMessage):
                    self._dispatch(conn.trailing_data[0])
                    return _STOP, budget
                else:
                    # PAUSED or ConnectionClosed: nothing more to read on this connection.
                    return _STOP, budget
            return _MORE, 0
        except h11.RemoteProtocolError as exc:
            self._reject(request_head.malformed(exc.error_status_hint, str(exc)))
            return _STOP, budget

    def _whole(self, data: bytes) -> bool:
        """A whole request of the usual kind in one read (`http.usual_head`), served
        without h11: whether it was (False: h11 reads the bytes)."""
        head = usual_head.read(data, self.app.config.server.max_header_bytes)
        if head is None:
            return False
        end = head.body_at + head.length
        if end > len(data):
            return False
        self.awaiting_head = True
        self._on_head(head.request, False, None)
        if self.busy or self.out.gone:
            return True
        if head.length and not self._take_body(data[head.body_at : end], False):
            return True
        self._dispatch(data[end:])
        return True

    def _on_head(self, ev: fields.RequestHead, folded: bool, conn: h11.Connection | None) -> None:
        """A request head read (by h11, which `conn` is, or whole by `usual_head`): judged
        before any body byte; `folded`: it held an obs-fold."""
        self.head = ev
        self.awaiting_head = False
        self.head_bytes = self.body = b""
        self.body_size = self.chunks = 0
        app = self.app
        verdict = request_head.judge(
            app.config.server,
            app.auth,
            ev.method,
            ev.target,
            ev.http_version,
            ev.headers,
            folded,
            self.peer_host,
            app.bodies,
        )
        self.http11, self.wants_keep_alive = verdict.http11, verdict.keep_alive
        self.path, self.key_id = verdict.path, verdict.key_id
        if verdict.refusal is not None:
            self._reject(verdict.refusal)
            return
        if conn is not None and conn.they_are_waiting_for_100_continue:
            continue_ = conn.send(h11.InformationalResponse(status_code=100, headers=[]))
            if continue_ is not None:
                self.out.send_answer(continue_)

    def _take_body(self, data: bytes, chunk_start: bool) -> bool:
        """Buffer one piece of body (`chunk_start`: the first piece of a chunk); False when
        the request was refused instead."""
        cfg = self.app.config.server
        n = len(data)
        if chunk_start:
            self.chunks += 1
            if self.chunks > cfg.max_body_chunks:
                self._reject(request_head.too_many_chunks(cfg.max_body_chunks))
                return False
        self.body_size += n
        if self.body_size > cfg.max_body_bytes:
            self._reject(request_head.too_large(cfg.max_body_bytes))
            return False
        bodies = self.app.bodies
        if not bodies.take(n):
            self._reject(request_head.busy(bodies.limit))
            return False
        self.held += n
        body = self.body
        if not body:
            # The usual body is one piece: kept as read, not copied (nor by `_dispatch`).
            self.body = data
        else:
            if not isinstance(body, bytearray):
                body = self.body = bytearray(body)
            body += data
        return True

    def _release_body(self) -> None:
        self.body = b""
        if self.held:
            self.app.bodies.give(self.held)
            self.held = 0

    def _dispatch(self, trailing: bytes) -> None:
        """The request is read whole: its task starts; `trailing`, what came after it."""
        self._disarm()
        ev = self.head
        assert ev is not None
        body = bytes(self.body)
        self.body = b""
        req = Request(
            ev.method,
            ev.target,
            ev.headers,
            body,
            self.http11,
            self.wants_keep_alive,
            self.key_id,
            self.path,
        )
        self.head = None
        self.busy = True
        # The request is read whole: what came past it (a pipelined next request) waits in
        # the inbox with what arrives meanwhile, and h11 itself is dropped (see __init__).
        if trailing:
            self.inbox = bytearray(trailing) + self.inbox
        self.h11 = None
        self.out.begin()
        self.task = self.loop.create_task(self.app.dispatcher.handle(self, req))
        # In the drain's count from now, not from its first step.
        self.app.track(self.task)

    def _reject(self, err: RelayError) -> None:
        """An error before the request could be read whole: answer and close."""
        self._disarm()
        self._cancel_turn()
        self.busy = True
        self.inbox = b""
        self._release_body()
        head = self.head
        headers = head.headers if head is not None else []
        rid = self.app.dispatcher.request_id(headers)
        self.out.begin()
        cors = self.app.cors.headers(headers) if head is not None else []
        self.out.answer(err.status, err.body(), None, False, err.headers + cors)
        settle.rejected(self.app, self.out, head, rid, self.peer_host, err)
        self.exchange = None
        self.task = None
        if self.out.gone:
            return
        # A lingering close: the client may still be sending, and closing with its bytes
        # unread would reset the connection and could destroy the answer before it is read.
        self.lingering = True
        self.transport.resume_reading()
        self.out.end_output()
        self.timer = self.loop.call_later(LINGER_S, self.transport.close)

    # ---- the end of a request ----------------------------------------------------------
    def finish(self, keep_alive: bool) -> None:
        """The response is written: read the next request, or close."""
        self.exchange = None
        self.task = None
        self._release_body()
        if self.out.gone:
            return
        if not keep_alive or self.app.draining:
            self._close()
            return
        # (Already None, unless the request was answered before it was read whole.)
        self.h11 = None
        self.awaiting_head = True
        self.head_bytes = b""
        self.busy = False
        self.transport.resume_reading()
        self._arm(_IDLE, self.app.config.server.keepalive_timeout_s)
        if self.inbox:
            self._arm(_HEAD, self.app.config.server.header_timeout_s)
            self._pump()

    def _close(self) -> None:
        self.out.closed()
        self.transport.close()

    # ---- the relay's drain ---------------------------------------------------------------
    def stop_idle(self) -> None:
        """The drain began: a connection between requests closes; a request half read is
        answered 503 with a lingering close (the client may still be sending: a plain close
        would reset the connection and destroy the answer)."""
        if self.busy or self.out.gone:
            return
        if self.head is not None or (self.h11 is not None and self.h11.trailing_data[0]):
            self._reject(shutting_down())
            return
        self._close()

    def cut(self) -> None:
        """The drain's time is up: the stream being relayed is cut (the client sees the
        truncation)."""
        if self.exchange is not None:
            self.exchange.shutdown()

    def close(self) -> None:
        """The relay stops: the connection closes, whatever it was doing."""
        self._close()

    # ---- timers --------------------------------------------------------------------
    def _arm(self, wait: _Wait, delay: float) -> None:
        self._disarm()
        self.wait = wait
        self.timer = self.loop.call_later(delay, self._timeout)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.wait = _NO_WAIT

    def _timeout(self) -> None:
        wait = self.wait
        self.timer = None
        self.wait = _NO_WAIT
        if self.out.gone or self.busy:
            return
        if wait is _IDLE:
            self._close()
            return
        self._reject(RelayError(Code.REQUEST_TIMEOUT, "request head/body not received in time"))

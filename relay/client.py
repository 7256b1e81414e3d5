"""The client side: an asyncio.Protocol reading requests with h11, one at a time.

h11 parses each request head and body; responses are written as raw bytes by the exchange or
by the relay itself. After each response a fresh h11 connection takes over whatever the client
already sent (pipelining) so h11 never has to be told about a body it did not frame.
"""

from __future__ import annotations

import asyncio

import h11

from relay import headers as hdr
from relay.errors import RelayError, reason_phrase

_READ_BUFFER_LIMIT = 64 * 1024  # bytes of a next request buffered while one is served
WRITE_HIGH_WATER = 64 * 1024


class Request:
    __slots__ = ("method", "target", "headers", "body", "http11", "keep_alive")

    def __init__(self, method, target, headers, body, http11, keep_alive) -> None:
        self.method: bytes = method
        self.target: bytes = target
        self.headers: list[tuple[bytes, bytes]] = headers
        self.body: bytes = body
        self.http11: bool = http11
        self.keep_alive: bool = keep_alive


class ClientConn(asyncio.Protocol):
    def __init__(self, app) -> None:
        self.app = app
        self.loop = app.loop
        self.transport: asyncio.Transport | None = None
        self.h11 = self._new_h11()
        self.busy = False  # a request is being served
        self.pending = b""  # bytes that arrived while busy
        self.gone = False
        self.lingering = False  # answered an error mid-request: discard input, then close
        self.exchange = None  # the Exchange relaying to us, for flow control and close
        self.drain_waiter: asyncio.Future | None = None
        self.task: asyncio.Task | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_kind = ""
        self.head: h11.Request | None = None
        self.body: list[bytes] = []
        self.body_size = 0
        self.http11 = True
        self.wants_keep_alive = True

    def _new_h11(self) -> h11.Connection:
        return h11.Connection(h11.SERVER,
                              max_incomplete_event_size=self.app.config.server.max_header_bytes)

    # ---- asyncio callbacks -----------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self.app.clients.add(self)
        if self.app.draining:
            self.gone = True
            transport.close()
            return
        self._arm("head", self.app.config.server.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        if self.busy:
            self.pending += data
            if len(self.pending) > _READ_BUFFER_LIMIT:
                self.transport.pause_reading()
            return
        if self.timer_kind == "idle":  # first byte of a next request: its head is now due
            self._arm("head", self.app.config.server.header_timeout_s)
        self.h11.receive_data(data)
        self._process()

    def eof_received(self):
        # A client that closes its end is gone: stop the upstream at once.
        return False

    def connection_lost(self, exc) -> None:
        self.gone = True
        self.app.clients.discard(self)
        self._disarm()
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_result(None)
        if self.exchange is not None:
            self.exchange.client_gone()
        elif self.task is not None and not self.task.done():
            self.task.cancel()

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
        except (TimeoutError, asyncio.TimeoutError):
            self.gone = True
            self.transport.abort()
            return "timeout"
        finally:
            self.drain_waiter = None
            if not self.gone:
                self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        return "gone" if self.gone else "drained"

    # ---- request reading ---------------------------------------------------------------
    def _process(self) -> None:
        conn = self.h11
        try:
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA or ev is h11.PAUSED:
                    return
                if isinstance(ev, h11.Request):
                    self._on_head(ev)
                    if self.busy or self.gone:
                        return
                elif isinstance(ev, h11.Data):
                    self.body_size += len(ev.data)
                    if self.body_size > self.app.config.server.max_body_bytes:
                        self._reject(self._too_large())
                        return
                    self.body.append(ev.data)
                elif isinstance(ev, h11.EndOfMessage):
                    self._dispatch()
                    return
                elif isinstance(ev, h11.ConnectionClosed):
                    self.transport.close()
                    return
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == 431:
                err = RelayError("headers_too_large", "request head is too large")
            else:
                err = RelayError("bad_request", f"malformed HTTP request: {exc}")
            self._reject(err)

    def _too_large(self) -> RelayError:
        limit = self.app.config.server.max_body_bytes
        return RelayError("request_too_large", f"request body is over {limit} bytes",
                          {"limit_bytes": limit})

    def _on_head(self, ev: h11.Request) -> None:
        self.head = ev
        self.body = []
        self.body_size = 0
        raw = ev.headers.raw_items()
        # h11 bounds only a head still incomplete; one that came whole in a read is measured here
        size = len(ev.method) + len(ev.target) + sum(len(k) + len(v) + 4 for k, v in raw)
        if size > self.app.config.server.max_header_bytes:
            self._reject(RelayError("headers_too_large", "request head is too large"))
            return
        self.http11 = ev.http_version == b"1.1"
        self.wants_keep_alive = self.http11 and not hdr.has_token(raw, b"connection", b"close")
        cl = hdr.get(raw, b"content-length")
        if cl is not None and int(cl) > self.app.config.server.max_body_bytes:
            self._reject(self._too_large())
            return
        if self.h11.they_are_waiting_for_100_continue:
            self.transport.write(
                self.h11.send(h11.InformationalResponse(status_code=100, headers=[])))

    def _dispatch(self) -> None:
        self._disarm()
        ev = self.head
        req = Request(ev.method, ev.target, ev.headers.raw_items(), b"".join(self.body),
                      self.http11, self.wants_keep_alive)
        self.head = None
        self.body = []
        self.busy = True
        self.task = self.loop.create_task(self.app.handle(self, req))

    def _reject(self, err: RelayError) -> None:
        """An error before the request could be read whole: answer and close."""
        self._disarm()
        self.busy = True
        self.app.rejected(self, err)
        self.respond(err.status, err.body(), None, keep_alive=False, extra=err.headers)
        self.exchange = None
        self.task = None
        if self.gone:
            return
        # Lingering close: the client may still be sending; closing with its bytes unread
        # would reset the connection and could destroy the answer before it is read.
        self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.timer = self.loop.call_later(2.0, self.transport.close)

    # ---- responding --------------------------------------------------------------------
    def respond(self, status: int, body: bytes, request_id: bytes | None, keep_alive: bool,
                extra=(), content_type: bytes = b"application/json") -> None:
        if self.gone:
            return
        self.transport.write(hdr.relay_response(status, reason_phrase(status), body,
                                                request_id, keep_alive, extra, content_type))

    def finish(self, keep_alive: bool) -> None:
        """The response is written: read the next request, or close."""
        self.exchange = None
        self.task = None
        if self.gone:
            return
        if not keep_alive or self.app.draining:
            self.gone = True
            self.transport.close()
            return
        leftover = self.h11.trailing_data[0] + self.pending
        self.pending = b""
        self.h11 = self._new_h11()
        self.busy = False
        self.transport.resume_reading()
        self._arm("idle", self.app.config.server.keepalive_timeout_s)
        if leftover:
            self._arm("head", self.app.config.server.header_timeout_s)
            self.h11.receive_data(leftover)
            self._process()

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
        self._reject(RelayError("request_timeout", "request not received in time"))

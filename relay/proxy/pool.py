"""Upstream TCP connections and their keep-alive pool.

A connection is handed to one exchange at a time (`conn.handler`); the exchange receives the
bytes and the close. A connection goes back to the pool only after a cleanly finished
response; llama-server closes after every stream although it says Keep-Alive, so a pooled
connection may be dead by the time it is reused (the caller retries once on a fresh one).

A connection on which the upstream sent anything it was not asked for is never reused: bytes
read while no exchange holds it retire it at once (`data_received`), and since the loop reads
them only at its next poll - a connection can be released and taken again within one pass of
ready callbacks - the pool also looks at the socket's receive queue before handing one out.
(Bytes that arrive only after the next request went out cannot be told from its response.)
"""

from __future__ import annotations

import asyncio
import fcntl
import ssl
import struct
import termios
from typing import TYPE_CHECKING, Protocol

from relay.http.tls import describe


class Handler(Protocol):
    """The exchange using a connection: it receives the bytes and the close."""

    def upstream_data(self, data: bytes) -> None: ...

    def upstream_closed(self, exc: BaseException | None) -> None: ...


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes waiting in the socket's receive queue, not yet read by the loop (FIONREAD).

    (On a TLS connection these are TLS records: application bytes, or the rare post-handshake
    message such as a session ticket the loop has not read yet; either retires a pooled
    connection, which costs at most a handshake.)"""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    # A writable buffer: ioctl takes it at its first try, with no error built.
    buf = bytearray(4)
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
        n: int = struct.unpack("i", buf)[0]
        return n
    except OSError:
        # A socket that cannot say is not trusted with a request.
        return 1


class UpstreamConn(asyncio.Protocol):
    __slots__ = ("alive", "handler", "idle_timer", "pool", "transport", "used")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        # (asyncio and uvloop both set TCP_NODELAY on TCP sockets.)
        self.transport: asyncio.Transport | None = None
        self.handler: Handler | None = None
        self.alive = True
        self.idle_timer: asyncio.TimerHandle | None = None
        # It carried a request (a spare that never did is not replaced).
        self.used = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if TYPE_CHECKING:
            # A stream transport: uvloop's is not an asyncio.Transport subclass, but offers
            # all it does (so this is for the type checker only).
            assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        handler = self.handler
        if handler is not None:
            handler.upstream_data(data)
        else:
            # Bytes on an idle pooled connection: it cannot be trusted any more.
            self.alive = False
            self.abort()

    def eof_received(self) -> bool:
        self._closed(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed(exc)
        self.pool.forget(self, replace=self.used)

    def _closed(self, exc: BaseException | None) -> None:
        self.alive = False
        handler, self.handler = self.handler, None
        if handler is not None:
            handler.upstream_closed(exc)

    def abort(self) -> None:
        """Close now, discarding buffers: llama-server stops generating when its socket closes."""
        self.alive = False
        self.handler = None
        if self.transport is not None:
            self.transport.abort()


class ConnectError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)


class Pool:
    """Idle keep-alive connections to one upstream address."""

    def __init__(
        self,
        host: str,
        port: int,
        keepalive_s: float,
        prewarm: bool = False,
        connect_timeout_s: float = 5.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        # TLS (an https upstream): SNI and the name checked are the URL's host. The handshake
        # is part of the connect (and of its timeout); pooled connections skip it.
        self.use_tls(tls)
        self.keepalive_s = keepalive_s
        self.prewarm = prewarm and keepalive_s > 0
        self.connect_timeout_s = connect_timeout_s
        self.idle: list[UpstreamConn] = []
        # New connections opened, TLS handshakes included (tests, metrics).
        self.connects = 0
        # The upstream closes its connections after use (llama-server after a stream).
        self.burns = False
        self.closed = False
        self._warming = False

    def use_tls(self, tls: ssl.SSLContext | None) -> None:
        """New connections use this context (a reload); pooled ones keep theirs. SNI and the
        hostname checked are the URL's host."""
        self.ssl = tls

    async def acquire(self, timeout: float, fresh: bool = False) -> tuple[UpstreamConn, bool]:
        """(connection, reused). Raises ConnectError."""
        if not fresh and self.burns:
            # This request takes the spare: the next one is readied.
            self._warm_spare(taking=True)
        while self.idle and not fresh:
            # The most recently used first: the likeliest alive.
            conn = self.idle.pop()
            if conn.idle_timer is not None:
                conn.idle_timer.cancel()
                conn.idle_timer = None
            transport = conn.transport
            if conn.alive and transport is not None and not transport.is_closing():
                if not unread_bytes(transport):
                    return conn, True
                # Unsolicited bytes, not read yet: out of step with us.
                conn.abort()
        loop = asyncio.get_running_loop()
        # The deadline cancels this task, as asyncio.timeout would, at a third of its cost
        # (no extra task either, unlike wait_for in 3.11).
        task = asyncio.current_task()
        expired: list[bool] = []
        assert task is not None
        timer = loop.call_later(timeout, lambda: expired.append(task.cancel()))
        try:
            _, conn = await loop.create_connection(
                lambda: UpstreamConn(self),
                self.host,
                self.port,
                ssl=self.ssl,
                server_hostname=self.host if self.ssl is not None else None,
            )
        except asyncio.CancelledError:
            if not expired or task.uncancel() > 0:
                # Cancelled from outside: not ours to swallow.
                raise
            raise ConnectError(f"connect timed out after {timeout}s") from None
        except ssl.SSLError as exc:
            # (An OSError too.) A refused certificate, a bad handshake.
            raise ConnectError(f"TLS handshake failed: {describe(exc)}") from None
        except OSError as exc:
            raise ConnectError(f"connect failed: {exc.strerror or exc}") from None
        finally:
            timer.cancel()
        self.connects += 1
        return conn, False

    def release(self, conn: UpstreamConn, reusable: bool) -> None:
        conn.handler = None
        transport = conn.transport
        if (
            not reusable
            or not conn.alive
            or self.keepalive_s <= 0
            or transport is None
            or transport.is_closing()
        ):
            conn.abort()
            self.burns = self.burns or conn.used
            self._warm_spare()
            return
        if conn.used:
            self.burns = False
        conn.idle_timer = asyncio.get_running_loop().call_later(
            self.keepalive_s, self._expire, conn
        )
        self.idle.append(conn)

    def _warm_spare(self, taking: bool = False) -> None:
        """After a connection is used up (llama-server closes after every stream), and when a
        request takes the spare of such an upstream, open the next one in the background, so
        the next request does not wait for a TCP connect (a request that arrives while the
        last one still waits for its head - a long prompt - finds it ready too). One spare at
        most; it expires like any idle connection when no request comes."""
        spares = len(self.idle) - (1 if taking else 0)
        if self.prewarm and spares <= 0 and not self._warming and not self.closed:
            self._warming = True
            asyncio.get_running_loop().create_task(self._warm())

    async def _warm(self) -> None:
        try:
            conn, _ = await self.acquire(self.connect_timeout_s, fresh=True)
        except ConnectError:
            # The request path reports it, and marks the upstream down.
            return
        finally:
            self._warming = False
        if self.closed:
            conn.abort()
            return
        self.release(conn, True)

    def _expire(self, conn: UpstreamConn) -> None:
        conn.idle_timer = None
        self.forget(conn)
        conn.abort()

    def forget(self, conn: UpstreamConn, replace: bool = False) -> None:
        if conn in self.idle:
            self.idle.remove(conn)
            if conn.idle_timer is not None:
                conn.idle_timer.cancel()
                conn.idle_timer = None
            # The upstream closed it after a response (llama-server after a stream).
            if replace:
                self.burns = True
                self._warm_spare()

    def close(self) -> None:
        self.closed = True
        for conn in list(self.idle):
            self.forget(conn)
            conn.abort()

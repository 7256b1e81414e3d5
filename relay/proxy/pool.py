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

from relay.http.tls import describe


def unread_bytes(transport) -> int:
    """Bytes waiting in the socket's receive queue, not yet read by the loop (FIONREAD).

    (On a TLS connection these are TLS records: application bytes, or the rare post-handshake
    message such as a session ticket the loop has not read yet; either retires a pooled
    connection, which costs at most a handshake.)"""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    buf = bytearray(4)  # (a writable buffer: ioctl takes it at its first try, no error built)
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
        return struct.unpack("i", buf)[0]
    except OSError:
        return 1  # a socket that cannot say is not trusted with a request


class UpstreamConn(asyncio.Protocol):
    __slots__ = ("alive", "handler", "idle_timer", "pool", "transport", "used")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.handler = None  # the exchange using this connection
        self.alive = True
        self.idle_timer: asyncio.TimerHandle | None = None
        self.used = False  # carried a request (a spare that never did is not replaced)

    def connection_made(self, transport) -> None:
        self.transport = transport  # (asyncio and uvloop both set TCP_NODELAY on TCP sockets)

    def data_received(self, data: bytes) -> None:
        handler = self.handler
        if handler is not None:
            handler.upstream_data(data)
        else:  # bytes on an idle pooled connection: it cannot be trusted any more
            self.alive = False
            self.abort()

    def eof_received(self):
        self._closed(None)
        return False

    def connection_lost(self, exc) -> None:
        self._closed(exc)
        self.pool.forget(self, replace=self.used)

    def _closed(self, exc) -> None:
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
        self.connects = 0  # new connections opened, TLS handshakes included (tests, metrics)
        self.burns = False  # the upstream closes connections after use (llama-server streams)
        self.closed = False
        self._warming = False

    def use_tls(self, tls: ssl.SSLContext | None) -> None:
        """New connections use this context (a reload); pooled ones keep theirs."""
        self.ssl = tls  # (SNI and the hostname checked: the URL's host)

    async def acquire(self, timeout: float, fresh: bool = False) -> tuple[UpstreamConn, bool]:
        """(connection, reused). Raises ConnectError."""
        if not fresh and self.burns:
            self._warm_spare(taking=True)  # this request takes the spare: ready the next one
        while self.idle and not fresh:
            conn = self.idle.pop()  # most recently used first: the likeliest alive
            if conn.idle_timer is not None:
                conn.idle_timer.cancel()
                conn.idle_timer = None
            transport = conn.transport
            if conn.alive and transport is not None and not transport.is_closing():
                if not unread_bytes(transport):
                    return conn, True
                conn.abort()  # unsolicited bytes, not read yet: out of step with us
        loop = asyncio.get_running_loop()
        # The deadline cancels this task, as asyncio.timeout would, at a third of its cost
        # (no extra task either, unlike wait_for in 3.11).
        task = asyncio.current_task()
        expired = []
        assert task is not None  # (acquire runs in the request's task)
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
                raise  # cancelled from outside: not ours to swallow
            raise ConnectError(f"connect timed out after {timeout}s") from None
        except ssl.SSLError as exc:  # (an OSError too) a refused certificate, a bad handshake
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
            return  # the request path reports it, and marks the upstream down
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
            if replace:  # the upstream closed it after a response (llama-server after a stream)
                self.burns = True
                self._warm_spare()

    def close(self) -> None:
        self.closed = True
        for conn in list(self.idle):
            self.forget(conn)
            conn.abort()

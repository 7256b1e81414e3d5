"""Upstream TCP connections and their keep-alive pool.

A connection is handed to one exchange at a time (`conn.handler`); the exchange receives the
bytes and the close. A connection goes back to the pool only after a cleanly finished
response; llama-server closes after every stream although it says Keep-Alive, so a pooled
connection may be dead by the time it is reused (the caller retries once on a fresh one).
"""

from __future__ import annotations

import asyncio


class UpstreamConn(asyncio.Protocol):
    __slots__ = ("pool", "transport", "handler", "alive", "idle_timer")

    def __init__(self, pool: "Pool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.handler = None  # the exchange using this connection
        self.alive = True
        self.idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport  # (asyncio and uvloop both set TCP_NODELAY on TCP sockets)

    def data_received(self, data: bytes) -> None:
        handler = self.handler
        if handler is not None:
            handler.upstream_data(data)
        else:  # bytes on an idle pooled connection: it cannot be trusted any more
            self.alive = False
            self.transport.abort()

    def eof_received(self):
        self._closed(None)
        return False

    def connection_lost(self, exc) -> None:
        self._closed(exc)
        self.pool.forget(self)

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

    def __init__(self, host: str, port: int, keepalive_s: float) -> None:
        self.host = host
        self.port = port
        self.keepalive_s = keepalive_s
        self.idle: list[UpstreamConn] = []
        self.connects = 0  # new TCP connections opened (tests and metrics)

    async def acquire(self, timeout: float, fresh: bool = False) -> tuple[UpstreamConn, bool]:
        """(connection, reused). Raises ConnectError."""
        while self.idle and not fresh:
            conn = self.idle.pop()  # most recently used first: the likeliest alive
            if conn.idle_timer is not None:
                conn.idle_timer.cancel()
                conn.idle_timer = None
            if conn.alive and not conn.transport.is_closing():
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):  # (no extra task, unlike wait_for in 3.11)
                _, conn = await loop.create_connection(
                    lambda: UpstreamConn(self), self.host, self.port)
        except (TimeoutError, asyncio.TimeoutError):
            raise ConnectError(f"connect timed out after {timeout}s") from None
        except OSError as exc:
            raise ConnectError(f"connect failed: {exc.strerror or exc}") from None
        self.connects += 1
        return conn, False

    def release(self, conn: UpstreamConn, reusable: bool) -> None:
        conn.handler = None
        if not reusable or not conn.alive or self.keepalive_s <= 0 or conn.transport.is_closing():
            conn.abort()
            return
        conn.idle_timer = asyncio.get_running_loop().call_later(
            self.keepalive_s, self._expire, conn
        )
        self.idle.append(conn)

    def _expire(self, conn: UpstreamConn) -> None:
        conn.idle_timer = None
        self.forget(conn)
        conn.abort()

    def forget(self, conn: UpstreamConn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)
            if conn.idle_timer is not None:
                conn.idle_timer.cancel()
                conn.idle_timer = None

    def close(self) -> None:
        for conn in list(self.idle):
            self.forget(conn)
            conn.abort()

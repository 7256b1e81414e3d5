"""The built-in llama-server simulator as an object: `Simulator`, started and stopped in-process.

A Simulator is its state (state.SimState: knobs, switches, counters, requests) plus a listening
asyncio server whose connections (conn.py) parse with h11 and answer with raw bytes in the real
llama-server's wire shape (wire.py, frames.py). Streams are paced with loop.call_at chains
(gen.py: token i due at t0 + i*interval, no drift), one transport.write per event, and
production stops while the transport is paused. Per-request knobs come from an optional
``"sim": {...}`` object in the JSON request body (plan.py). The command line is cli.py.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from relay.sim.conn import SimConnection
from relay.sim.state import SimDefaults, SimState

if TYPE_CHECKING:
    from ssl import SSLContext


class Simulator(SimState):
    """In-process fake llama-server. ``await start()``; ``port`` is the bound port afterwards."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        defaults: SimDefaults | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        super().__init__(defaults)
        self.host, self.port = host, port
        # Served over TLS when set (connections_opened then counts handshakes).
        self.ssl = ssl
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: SimConnection(self, loop),
            self.host,
            self.port,
            reuse_address=True,
            backlog=4096,
            ssl=self.ssl,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.abort()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except (TimeoutError, Exception):
                pass
            self._server = None

    async def __aenter__(self) -> Simulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

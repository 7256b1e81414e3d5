"""A scripted upstream that answers with exact bytes: for byte-identity and odd-peer tests."""

from __future__ import annotations

import asyncio


class Scripted:
    """Each accepted connection runs `script(conn_index, request_head, reader, writer)`."""

    def __init__(self, script, ssl=None) -> None:
        self.script = script
        self.ssl = ssl  # an ssl.SSLContext: served over TLS (`connections` = handshakes done)
        self.server = None
        self.port = 0
        self.heads: list[bytes] = []  # every request head received, in order
        self.bodies: list[bytes] = []
        self.connections = 0
        self.closed_at: list[float] = []  # loop.time() when a connection ended (peer gone)

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl else 'http'}://127.0.0.1:{self.port}"

    async def start(self) -> Scripted:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0, ssl=self.ssl)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def read_request(self, reader) -> bytes | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length) if length else b""
        self.heads.append(head)
        self.bodies.append(body)
        return head

    async def _conn(self, reader, writer) -> None:
        index = self.connections
        self.connections += 1
        try:
            await self.script(self, index, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed_at.append(asyncio.get_running_loop().time())
            writer.close()

    async def stop(self) -> None:
        self.server.close()


def response_of(fixture_text: bytes) -> bytes:
    """The raw response part of a capture (tests/support/captures/, llama-server/ under it)."""
    return fixture_text.split(b"======== RESPONSE (raw bytes) ========\n", 1)[1]

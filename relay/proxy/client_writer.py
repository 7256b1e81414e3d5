"""The one writer of a client connection: every byte the client gets goes through here.

One `ClientWriter` per client connection, made with it (`ClientConn.connection_made`): the
relay's own whole answers, interim responses (`100 Continue`), a relayed response's head,
its body pieces and its end. Where the relay frames the client's body itself (a
close-delimited upstream to an HTTP/1.1 client, a body continuing a head the relay committed
early: `http.response_framing.relay_frames`), each piece is written as a chunk of its own
and the end as the last chunk; otherwise pieces go as they are (an upstream's own chunks
included). It counts what a response's body took on the wire (`sent`, chunk framing
included; the body of an answer of the relay's own too) and notes when a relayed response's first byte went out (`first_at`,
perf_counter) and its last before the first content event (`last_at`, the loop's clock: the
heartbeat is re-armed from it).

It also owns the write side's flow: the transport's buffer limits, and the wait for it to
drain before a slot is given back (`drained`).
"""

from __future__ import annotations

import asyncio
import time
from enum import Enum, auto

from relay.errors import reason_phrase
from relay.http.chunked import LAST_CHUNK, frame
from relay.http.fields import HeaderPairs
from relay.http.to_client import relay_response
from relay.stream.content_hold import Out

# The transport's buffer over this pauses the upstream's reads (`ClientConn.pause_writing`).
WRITE_HIGH_WATER = 64 * 1024
JSON = b"application/json"


class Drain(Enum):
    """How the wait for the client to read what was written ended."""

    DRAINED = auto()
    GONE = auto()
    TIMEOUT = auto()


_DRAINED = Drain.DRAINED


class ClientWriter:
    __slots__ = (
        "_drain_waiter",
        "_write",
        "first_at",
        "frames",
        "gone",
        "last_at",
        "loop",
        "sent",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport) -> None:
        self.loop = loop
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self._write = transport.write
        # The connection is closed, or closing: nothing more is written.
        self.gone = False
        # The response being written: whether the relay frames its body as chunks, the bytes
        # its body took on the wire, when its first byte went out (perf_counter) and its last
        # (the loop's clock).
        self.frames = False
        self.sent = 0
        self.first_at: float | None = None
        self.last_at = 0.0
        self._drain_waiter: asyncio.Future[None] | None = None

    def begin(self) -> None:
        """A new response on this connection: its figures start from nothing."""
        self.frames = False
        self.sent = 0
        self.first_at = None

    # ---- whole answers -----------------------------------------------------------------
    def answer(
        self,
        status: int,
        body: bytes,
        request_id: bytes | None,
        keep_alive: bool,
        extra: HeaderPairs = (),
        content_type: bytes = JSON,
    ) -> None:
        """A whole response of the relay's own (an error, a view, a page file): its body
        counts in `sent` (a row's `bytes_out`), as a relayed body does."""
        if not self.gone:
            self.sent += len(body)
        self.send_answer(
            relay_response(
                status, reason_phrase(status), body, request_id, keep_alive, extra, content_type
            )
        )

    def send_answer(self, data: bytes) -> None:
        """Bytes that are a whole answer or an interim response (`100 Continue`, a CORS
        preflight's 204): none of it counts as a relayed response's first byte (a row's
        `first_byte_ms` is then the settlement's)."""
        if not self.gone:
            self._write(data)

    # ---- a relayed response ------------------------------------------------------------
    def write(self, out: Out) -> None:
        """What a step of the response before its first content event gives (its head, body
        pieces, its end: `stream.content_hold.Out`), in one write."""
        if self.gone:
            return
        parts = []
        if out.head:
            self.frames = out.frames
            parts.append(out.head)
        frames = self.frames
        body = 0
        for piece in out.pieces:
            if piece:
                data = frame(piece) if frames else piece
                body += len(data)
                parts.append(data)
        if out.end and frames:
            body += len(LAST_CHUNK)
            parts.append(LAST_CHUNK)
        if parts:
            self.sent += body
            self._out(b"".join(parts) if len(parts) > 1 else parts[0])

    def body(self, piece: bytes) -> None:
        """A body piece (a chunk of its own when the relay frames the body)."""
        if piece and not self.gone:
            data = frame(piece) if self.frames else piece
            self.sent += len(data)
            self._write(data)

    def relay(self, data: bytes) -> None:
        """Bytes that go as they are (the upstream's own chunks): the usual read, once the
        response is out."""
        self.sent += len(data)
        self._write(data)

    def end(self) -> None:
        """The body is whole: the last chunk when the relay frames it."""
        if self.frames and not self.gone:
            self.sent += len(LAST_CHUNK)
            self._write(LAST_CHUNK)

    def close_with(self, tail: bytes) -> None:
        """Bytes that end the body early, framing included (`response_framing.closing_bytes`)."""
        if tail and not self.gone:
            self.sent += len(tail)
            self._write(tail)

    def pass_upstream_chunks(self) -> None:
        """From here the upstream's own chunks pass as they are (both sides stand between
        chunks)."""
        self.frames = False

    def _out(self, data: bytes) -> None:
        self._write(data)
        self.last_at = self.loop.time()
        if self.first_at is None:
            self.first_at = time.perf_counter()

    # ---- the end of the output ---------------------------------------------------------
    def end_output(self) -> None:
        """No more bytes from the relay on this connection (a lingering close)."""
        if self.transport.can_write_eof():
            self.transport.write_eof()

    def closed(self) -> None:
        """The connection is lost or closing: what waits for a drain wakes."""
        self.gone = True
        self._wake()

    def resumed(self) -> None:
        """The transport's buffer went below its low-water mark."""
        self._wake()

    def _wake(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drained(self, timeout: float) -> Drain:
        """Wait until everything written has left for the client (or it is gone, or too slow:
        the connection is then cut).

        With the low-water mark at 0 the transport calls resume_writing only once its buffer
        is empty; the slot is held until then, as llama-server's client has not read it all.
        """
        if self.gone:
            return Drain.GONE
        if self.transport.get_write_buffer_size() == 0:
            return _DRAINED
        self._drain_waiter = self.loop.create_future()
        self.transport.set_write_buffer_limits(high=1, low=0)
        try:
            await asyncio.wait_for(self._drain_waiter, timeout)
        except TimeoutError:
            self.gone = True
            self.transport.abort()
            return Drain.TIMEOUT
        finally:
            self._drain_waiter = None
            if not self.gone:
                self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        return Drain.GONE if self.gone else Drain.DRAINED

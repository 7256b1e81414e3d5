"""Readers of an upstream response body, one per framing, sans-I/O as h11's readers are.

`reader_for(kind, length)` picks one from the response head, once (`response_framing.plan`):
a declared length, chunked coding (`chunked.ChunkTracker`), or a body that ends when the
upstream closes. Each takes the bytes of one read and says what of them may go on to the
client now with the framing kept (`wire`), where the payloads lie in them (`spans`:
[a0, b0, a1, b1, ...], so a scanner reads them in place), whether the body is whole, and
whether the read was whole chunks (`chunks`: the usual read of a stream, one token event a
chunk as a rule).
`eof` says whether an upstream's close ends the body or cuts it.
"""

from __future__ import annotations

from relay.http.chunked import DONE, ChunkError, ChunkTracker
from relay.http.response_framing import CHUNKED, LENGTH, UNTIL_CLOSE, BodyKind

# What one read holds of a body: (wire, spans, whole, chunks).
BodyRead = tuple[bytes, list[int], bool, bool]

__all__ = ["BodyRead", "ChunkError", "ChunkedReader", "LengthReader", "UntilCloseReader"]


class LengthReader:
    """A body of a declared Content-Length: bytes past it are not the body's (the upstream
    is out of step: its connection is not reused)."""

    __slots__ = ("remaining", "reusable")
    kind = BodyKind.LENGTH
    tracker = None
    between_chunks = False

    def __init__(self, length: int) -> None:
        self.remaining = length
        self.reusable = True

    def read(self, data: bytes) -> BodyRead:
        n = len(data)
        if n >= self.remaining:
            if n > self.remaining:
                data = data[: self.remaining]
                self.reusable = False
            n = self.remaining
        self.remaining -= n
        return data, [0, n], not self.remaining, False

    def payload(self, wire: bytes, spans: list[int]) -> bytes:
        return wire

    def eof(self) -> bool:
        """The upstream closed before the declared length: the body is cut."""
        return False


class ChunkedReader(ChunkTracker):
    """A chunked body, its framing followed as it passes (a `ChunkTracker` with the readers'
    interface): whole chunks are read in place; anything else (a chunk split across reads,
    the last chunk) is tracked, a half-sent size line or chunk end held back until it is
    whole."""

    __slots__ = ()
    kind = BodyKind.CHUNKED

    @property
    def tracker(self) -> ChunkTracker:
        """Where the client stands in the framing (a stall frame is added from there)."""
        return self

    def read(self, data: bytes) -> BodyRead:
        """ChunkError when the framing is broken."""
        spans, ended = self.whole_chunks(data)
        if spans is not None:
            if ended:
                # The usual end of a stream: whole chunks, then the last chunk, no trailer.
                self.state = DONE
            return data, spans, ended, True
        wire, spans = self.feed_spans(data)
        return wire, spans, self.done, False

    def payload(self, wire: bytes, spans: list[int]) -> bytes:
        """The payloads of a read, joined (a client whose body the relay frames, or an
        HTTP/1.0 one)."""
        if len(spans) == 2:
            return wire[spans[0] : spans[1]]
        return b"".join(wire[spans[i] : spans[i + 1]] for i in range(0, len(spans), 2))

    @property
    def reusable(self) -> bool:
        """Nothing came after the body's end."""
        return not self.extra

    def eof(self) -> bool:
        """The upstream closed before the last chunk: the body is cut."""
        return False


class UntilCloseReader:
    """A body that ends when the upstream closes (no length, no chunks)."""

    __slots__ = ()
    kind = BodyKind.UNTIL_CLOSE
    tracker = None
    between_chunks = False
    reusable = False

    def read(self, data: bytes) -> BodyRead:
        return data, [0, len(data)], False, False

    def payload(self, wire: bytes, spans: list[int]) -> bytes:
        return wire

    def eof(self) -> bool:
        """The close is the body's end."""
        return True


BodyReader = LengthReader | ChunkedReader | UntilCloseReader


def reader_for(kind: BodyKind, length: int) -> BodyReader | None:
    """The reader of a body of `kind` (`length`: a LENGTH body's); None for an empty body."""
    if kind is CHUNKED:
        return ChunkedReader()
    if kind is LENGTH:
        return LengthReader(length)
    if kind is UNTIL_CLOSE:
        return UntilCloseReader()
    return None

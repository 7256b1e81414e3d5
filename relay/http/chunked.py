"""Follow HTTP/1.1 chunked framing of bytes passing through, without re-framing them.

The relay forwards an upstream's chunked body to a chunked client as raw bytes. This tracker
watches the chunk sizes go by so that the relay knows (a) the chunk payloads, for the SSE
scanner, (b) where the body ends, and (c) where the client stands inside the framing, so a
synthetic frame can still be added and the body ended cleanly. It never lets a chunk-size line,
a chunk's closing CRLF or the last-chunk/trailer section out half-sent: such bytes are held
back until complete, so the client is always either between chunks or inside chunk data.
"""

from __future__ import annotations

from typing import Final

# Where the tracker stands in the framing (`ChunkTracker.state`): before a size line, inside
# chunk data, at a chunk's closing CRLF, in the trailer section, or past the end of the body.
# Plain ints, named: the tracker compares its state several times a read, and an int compare
# is the one the interpreter specialises.
SIZE: Final = 0
DATA: Final = 1
DATA_END: Final = 2
TRAILER: Final = 3
DONE: Final = 4
_MAX_LINE = 4096
_HEX = b"0123456789abcdefABCDEF"

# Chunk-size text to its value: the same few sizes recur.
SIZES: dict[bytes, int] = {}


def chunk_size(text: bytes) -> int:
    """A chunk size: hex digits only (int() alone would take 0x5, +5, 0_5, -0); -1 if not."""
    size = SIZES.get(text)
    if size is None:
        if not text or text.translate(None, _HEX):
            return -1
        size = int(text, 16)
        if len(SIZES) < 4096:
            SIZES[text] = size
    return size


class ChunkError(ValueError):
    """The upstream's chunked framing is broken."""


def frame(payload: bytes) -> bytes:
    """One chunk holding `payload` (empty payload gives nothing: that would end the body)."""
    if not payload:
        return b""
    return b"%x\r\n%b\r\n" % (len(payload), payload)


LAST_CHUNK = b"0\r\n\r\n"


class ChunkTracker:
    __slots__ = ("extra", "held", "remaining", "state")

    def __init__(self) -> None:
        self.state = SIZE
        # The chunk-data bytes still owed by the current chunk.
        self.remaining = 0
        # Bytes received that are not yet safe to forward.
        self.held = b""
        # Bytes after the end of the body (the upstream misbehaving).
        self.extra = b""

    @property
    def done(self) -> bool:
        return self.state == DONE

    def whole_chunks(self, data: bytes) -> tuple[list[int] | None, bool]:
        """Payload bounds [a0, b0, a1, b1, ...] when `data` is one or more whole chunks, and
        whether the read ends with the last chunk (no trailer: the usual end of a stream),
        the bounds then the chunks' before it; (None, False) for any other read (the general
        path handles it). The tracker is left as it was.

        That is the usual read (one token per chunk, a few when reads coalesce under load);
        the caller then forwards `data` as is and scans the payloads in place: nothing is
        copied.
        """
        if self.state != SIZE or self.held:
            return None, False
        out: list[int] = []
        pos, n = 0, len(data)
        while pos < n:
            nl = data.find(b"\r\n", pos, pos + 18)
            if nl <= pos:
                return None, False
            size = chunk_size(data[pos:nl])
            if size <= 0:
                # The last chunk with no trailer, the read's end; or junk, or a trailer: the
                # general path ends the body.
                if size == 0 and nl + 4 == n and data[nl + 2] == 13 and data[nl + 3] == 10:
                    return out, True
                return None, False
            start = nl + 2
            end = start + size
            if end + 2 > n or data[end] != 13 or data[end + 1] != 10:
                return None, False
            out.append(start)
            out.append(end)
            pos = end + 2
        return out, False

    @property
    def between_chunks(self) -> bool:
        """Nothing of a chunk is owed or held: the next byte starts a chunk-size line."""
        return self.state == SIZE and not self.held

    def feed(self, data: bytes) -> tuple[bytes, list[bytes]]:
        """Take received bytes; return (bytes safe to forward now, chunk payloads found)."""
        out, spans = self.feed_spans(data)
        return out, [out[spans[i] : spans[i + 1]] for i in range(0, len(spans), 2)]

    def feed_spans(self, data: bytes) -> tuple[bytes, list[int]]:
        """Take received bytes; return (bytes safe to forward now, the bounds of the chunk
        payloads in them: [a0, b0, a1, b1, ...])."""
        buf = self.held + data if self.held else data
        spans: list[int] = []
        n = len(buf)
        pos = safe = 0
        while pos < n:
            st = self.state
            if st == DATA:
                # Chunk data, the usual state, is read here; the other states' lines are
                # read by a method each.
                take = min(self.remaining, n - pos)
                spans.append(pos)
                spans.append(pos + take)
                pos += take
                self.remaining -= take
                if not self.remaining:
                    self.state = DATA_END
                safe = pos
                continue
            if st == DONE:
                self.extra += buf[pos:]
                break
            if st == DATA_END and buf.startswith(b"\r\n", pos):
                # A chunk's end, as it usually comes.
                pos += 2
                self.state = SIZE
                safe = pos
                continue
            if st == SIZE:
                pos = self._size_line(buf, pos)
            elif st == DATA_END:
                pos = self._data_end(buf, pos)
            else:
                pos = self._trailer_line(buf, pos)
            if pos < 0:
                break
            # Everything read is safe to forward, but a last chunk and its trailer, which
            # go out only once the trailer has ended.
            if self.state != TRAILER:
                safe = pos
        if safe == n:
            self.held = b""
            return buf, spans
        self.held = buf[safe:] if self.state != DONE else b""
        return buf[:safe], spans

    def _size_line(self, buf: bytes, pos: int) -> int:
        nl = buf.find(b"\n", pos)
        if nl < 0:
            if len(buf) - pos > _MAX_LINE:
                raise ChunkError("chunk-size line too long")
            return -1
        line = buf[pos:nl].rstrip(b"\r").split(b";", 1)[0].strip(b" \t")
        size = chunk_size(line)
        if size < 0:
            raise ChunkError(f"bad chunk size {line[:20]!r}")
        if size == 0:
            self.state = TRAILER
        else:
            self.state = DATA
            self.remaining = size
        return nl + 1

    def _data_end(self, buf: bytes, pos: int) -> int:
        if buf.startswith(b"\r\n", pos):
            pos += 2
        elif buf.startswith(b"\n", pos):
            pos += 1
        elif len(buf) - pos == 1 and buf[pos] == 13:
            # A lone CR: its LF is in the next read.
            return -1
        else:
            raise ChunkError("chunk data not followed by CRLF")
        self.state = SIZE
        return pos

    def _trailer_line(self, buf: bytes, pos: int) -> int:
        nl = buf.find(b"\n", pos)
        if nl < 0:
            if len(buf) - pos > _MAX_LINE:
                raise ChunkError("trailer line too long")
            return -1
        if nl == pos or (nl == pos + 1 and buf[pos] == 13):
            self.state = DONE
        return nl + 1

    def close_with(self, payload: bytes) -> bytes:
        """Bytes that end the body cleanly from where the client stands, carrying `payload`.

        Inside a chunk the owed bytes are filled first: with the payload itself, padded
        with newlines when the payload is shorter, after the payload's first blank line (what
        comes before it finishes a half-sent event; more blank lines are ignored by SSE
        parsers). Held-back bytes are dropped.
        """
        if self.state == DONE:
            # The body is already whole: nothing may follow it.
            return b""
        out = []
        if self.state == DATA:
            owed = self.remaining
            if owed >= len(payload):
                # With no blank line in the payload, the padding goes first.
                at = payload.find(b"\n\n")
                at = at + 2 if at >= 0 else 0
                pad = b"\n" * (owed - len(payload))
                out.append(payload[:at] + pad + payload[at:] + b"\r\n")
                payload = b""
            else:
                out.append(payload[:owed] + b"\r\n")
                payload = payload[owed:]
        elif self.state == DATA_END:
            out.append(b"\r\n")
        out.append(frame(payload))
        out.append(LAST_CHUNK)
        self.state = DONE
        self.held = b""
        return b"".join(out)

"""The response before its first content event: what is held, when it commits, what a fallback
may still do. Pure: every step returns what to write (`Out`) and leaves the hold in its new
state; the writing and the heartbeat's timer are the proxy's (relay.proxy.reply).

Until the first content event reaches the client, another upstream may still serve the
request. One Hold per request, fed by each exchange in turn, says where that stands:

- WAITING: nothing has reached the client. The exchange gives the head it would send
  (`hold_head`) and the body pieces as they would go out (`keep`); `release` gives them back
  for one write (the usual path: head, role event and first token leave together).
- COMMITTED: a `200 text/event-stream` head and SSE comments only have reached the client:
  heartbeats while the upstream works on a long prompt (`beat`), and the upstream's own
  comment lines (llama-server's pings). From here the body comes in as payloads (`feed`):
  comment blocks go out at once while no event is held, other events are held until the
  first content event; the relay frames the chunks itself (`frames`) or, for an HTTP/1.0
  client, the body ends by closing. A failure that would have been an HTTP error becomes one
  in-band error in the stream's API shape and a clean end (`fail`, `terminal.error_events`:
  chat's `{"error": ...}` and `[DONE]`, Anthropic's `event: error`, a Responses `error`
  event); the next candidate's events continue the same response (`retry`).
- OPEN: content (or anything that is not a comment) has reached the client: nothing is
  swapped any more. The exchange then writes to the client directly.
- FAILED: the committed response ended with an in-band error: nothing more goes out.
"""

from __future__ import annotations

from enum import Enum, auto

import msgspec

from relay.errors import UpstreamErrorFields, reason_phrase
from relay.http.fields import HeaderPairs
from relay.http.response_framing import BodyKind, Carriage, payload_of
from relay.http.response_head import ResponseHead
from relay.http.to_client import client_response, with_cors
from relay.stream.dialect import Api
from relay.stream.sse import event_json
from relay.stream.terminal import error_events


class HoldState(Enum):
    WAITING = auto()
    COMMITTED = auto()
    OPEN = auto()
    FAILED = auto()


class Took(Enum):
    """What `take` made of body pieces: still held; written with what was held (the client
    gets the rest directly); or this upstream's error, which ends its exchange (the next
    candidate serves, or the error is told in-band)."""

    HELD = auto()
    WRITTEN = auto()
    ERROR = auto()


WAITING, COMMITTED, OPEN, FAILED = HoldState
HELD, WRITTEN, ERROR = Took
# The most bytes held back waiting for the first content event.
LIMIT = 64 * 1024
HEARTBEAT = b": relay heartbeat\n\n"


class Out(msgspec.Struct, frozen=True, gc=False):
    """What one step of the hold writes to the client: a response head (b"": none), then body
    pieces, each a chunk of its own when the relay frames the body (`frames`, set with the
    head), then, with `end`, the body's end (the last chunk, when framed)."""

    head: bytes = b""
    pieces: tuple[bytes, ...] = ()
    frames: bool = False
    end: bool = False


NOTHING = Out()


def comment_prefix(buf: bytes) -> int:
    """Length of the leading run of whole comment blocks in `buf` (SSE lines starting with
    `:`, each block ended by a blank line): what may reach the client before content."""
    pos = 0
    while True:
        end = buf.find(b"\n\n", pos)
        if end < 0:
            return pos
        block = buf[pos:end]
        if 13 in block or not all(not line or line[0] == 0x3A for line in block.split(b"\n")):
            return pos
        pos = end + 2


def synthetic_head(
    request_id: bytes, chunked: bool, keep_alive: bool, extra: HeaderPairs = ()
) -> bytes:
    """The head committed before the upstream's own is in (built as a relayed one is)."""
    own = [(b"Content-Type", b"text/event-stream"), (b"Cache-Control", b"no-cache"), *extra]
    return client_response(200, b"OK", own, request_id, chunked, keep_alive)


class Hold:
    __slots__ = (
        "beats",
        "extra",
        "frames",
        "head",
        "http11",
        "keep_alive",
        "parts",
        "pending",
        "request_id",
        "size",
        "state",
    )

    def __init__(
        self,
        request_id: bytes,
        extra: HeaderPairs = (),
        http11: bool = True,
        keep_alive: bool = True,
    ) -> None:
        self.request_id = request_id
        # The headers every response of this request carries (CORS), as given: not copied.
        self.extra = extra
        # The client's side: its HTTP version and whether it wants the connection kept.
        self.http11 = http11
        self.keep_alive: bool = keep_alive
        self.state = WAITING
        # WAITING: the head the exchange would send. Whether the relay frames the body after
        # the head (the exchange's, WAITING; the one the hold committed, COMMITTED).
        self.head = b""
        self.frames = False
        # WAITING: the pieces after the head; COMMITTED: the held events.
        self.parts: list[bytes] = []
        self.size = 0
        # COMMITTED: an unfinished event.
        self.pending: bytes | bytearray = b""
        self.beats = 0

    @property
    def sent(self) -> bool:
        """Something reached the client."""
        return self.state is not WAITING

    @property
    def committed(self) -> bool:
        return self.state is COMMITTED

    @property
    def open(self) -> bool:
        """Content reached the client."""
        return self.state is OPEN

    @property
    def over(self) -> bool:
        """Nothing more is held: content reached the client, or an in-band error ended it."""
        return self.state is OPEN or self.state is FAILED

    def client_head(
        self, resp: ResponseHead, chunked: bool, keep_alive: bool, keep_length: bool = True
    ) -> bytes:
        """The head the client gets for an upstream response head (`resp`)."""
        raw: HeaderPairs = resp.headers
        if self.extra:
            # CORS: the relay's answer replaces the upstream's.
            raw = with_cors(raw, self.extra)
        if not keep_length:
            # The relay frames the body itself.
            raw = [(k, v) for k, v in raw if k.lower() != b"content-length"]
        status = resp.status_code
        return client_response(
            status, resp.reason or reason_phrase(status), raw, self.request_id, chunked, keep_alive
        )

    def take(self, piece: bytes, content: bool, error_first: bool, more: bool) -> tuple[Took, Out]:
        """A body piece while held, as it would go out. `content`: the first content event is
        in it; `error_first`: the first event is an `{"error": ...}` object; `more`: another
        candidate is left."""
        if self.state is COMMITTED:
            opened, out = self.feed(piece, content and not error_first)
            if opened:
                return WRITTEN, out
            return (ERROR if error_first else HELD), out
        if error_first and more:
            return ERROR, NOTHING
        if self.keep(piece) or content:
            return WRITTEN, self.release()
        return HELD, NOTHING

    # ---- WAITING -----------------------------------------------------------------------
    def hold_head(self, head: bytes, frames: bool) -> None:
        """The head the exchange would send, and whether the relay frames the body after it."""
        self.head, self.frames = head, frames

    def keep(self, piece: bytes) -> bool:
        """Hold a piece that follows the head; True once more is held than a hold may keep."""
        self.parts.append(piece)
        self.size += len(piece)
        return self.size > LIMIT

    def release(self) -> Out:
        """What is held, to be written: the head and the pieces after it (WAITING), or the
        held events (COMMITTED). The client has seen more than comments from here."""
        out = NOTHING
        if self.state is WAITING:
            out = Out(self.head, tuple(self.parts), self.frames)
        elif self.state is COMMITTED:
            out = Out(pieces=(b"".join(self.parts) + self.pending,))
        self.parts, self.size, self.pending, self.head = [], 0, b"", b""
        self.state = OPEN
        return out

    # ---- COMMITTED ---------------------------------------------------------------------
    def commit(self, head: bytes | None = None) -> Out:
        """A 200 event-stream head (the upstream's own, re-framed by the caller, or the relay's)
        to send; from here only comments reach the client until the first content event."""
        self.frames = self.http11
        if head is None:
            keep_alive = self.keep_alive and self.frames
            head = synthetic_head(self.request_id, self.frames, keep_alive, self.extra)
        self.parts, self.size, self.pending, self.head = [], 0, b"", b""
        self.state = COMMITTED
        return Out(head, frames=self.frames)

    def commit_upstream(
        self, resp: ResponseHead, kind: BodyKind, mode: Carriage
    ) -> tuple[Out, bytes]:
        """Commit with the upstream's own head (`resp`), re-framed for the relay's chunks, as
        a heartbeat falls due while it and its pieces are held: the head to write, and what
        was held as body payload (to be fed again)."""
        held = payload_of(kind, mode, self.parts)
        chunked = self.http11
        head = self.client_head(resp, chunked, chunked and self.keep_alive, keep_length=False)
        return self.commit(head), held

    def beat(self) -> Out:
        """A heartbeat falls due with nothing committed by the upstream's head: the relay's own
        head first (WAITING), then the heartbeat comment."""
        head = self.commit().head if self.state is WAITING else b""
        self.beats += 1
        return Out(head, (HEARTBEAT,), self.frames)

    def feed(self, payload: bytes, content: bool) -> tuple[bool, Out]:
        """Body payload while COMMITTED; `content`: the first content event is in it. True
        when the hold opens (content, or more held than a hold may keep), with what to
        write (comment blocks may go out while the hold stays committed)."""
        if content:
            self.pending += payload
            return True, self.release()
        pending = self.pending
        if pending and not (
            payload.find(b"\n\n") >= 0 or (pending[-1] == 10 and payload[:1] == b"\n")
        ):
            # The unfinished event goes on: it grows in place, searched only in the new
            # bytes (an event sent a byte at a time costs linear time, not quadratic).
            if isinstance(pending, bytes):
                pending = self.pending = bytearray(pending)
            pending += payload
            if self.size + len(pending) > LIMIT:
                return True, self.release()
            return False, NOTHING
        buf = bytes(pending) + payload if pending else payload
        # Whole events first, an unfinished one after.
        end = buf.rfind(b"\n\n")
        end = end + 2 if end >= 0 else 0
        whole, self.pending = buf[:end], buf[end:]
        out = NOTHING
        if whole and not self.parts:
            n = comment_prefix(whole)
            if n:
                out = Out(pieces=(whole[:n],))
            whole = whole[n:]
        if whole:
            self.parts.append(whole)
            self.size += len(whole)
        if self.size + len(self.pending) > LIMIT:
            released = self.release()
            return True, Out(pieces=out.pieces + released.pieces)
        return False, out

    def finish(self) -> Out:
        """The upstream's body ended cleanly while held: it all goes out, and the end."""
        if self.state is COMMITTED:
            released = self.release()
            return Out(pieces=released.pieces, end=True)
        if self.state is WAITING:
            # A close-delimited body the relay frames ends with its last chunk too.
            released = self.release()
            return Out(released.head, released.pieces, released.frames, end=True)
        return NOTHING

    def fail(self, message: str, type_: str, code: str | None, api: Api) -> tuple[Out, bool]:
        """End the committed response with one in-band error in its API's shape and a clean
        end; with whether the client connection may stay open."""
        self.parts, self.size, self.pending = [], 0, b""
        self.state = FAILED
        out = Out(pieces=(error_events(api, message, type_, code),), end=True)
        return out, self.frames and self.keep_alive

    def error(self) -> UpstreamErrorFields | None:
        """The error of the first held error event: an upstream's `{"error": ...}`,
        Anthropic's `event: error`, a Responses `error` or `response.failed`."""
        for ev in b"".join(self.parts).replace(b"\r\n", b"\n").split(b"\n\n"):
            body = event_json(ev.lstrip(b"\n"))
            fields = error_of(body) if body else None
            if fields is not None:
                return fields
        return None

    # ---- between candidates ------------------------------------------------------------
    def retry(self) -> None:
        """The next candidate starts: what the last one left held is dropped (only comments
        or nothing reached the client)."""
        self.parts, self.size, self.pending, self.head = [], 0, b"", b""


def error_of(body: bytes) -> UpstreamErrorFields | None:
    """`{"error": {...}}` (or `{"error": "text"}`; Anthropic's `{"type":"error","error":...}`
    too), a Responses `{"type":"error","code":..,"message":..}` or `response.failed` (its
    `response.error`) -> its string fields, else None."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    if doc.get("type") == "error" and "error" not in doc:
        # A Responses error event names its fields at its top.
        message, code = doc.get("message"), doc.get("code")
        return UpstreamErrorFields(_text(message), None, _text(code))
    if doc.get("type") == "response.failed" and isinstance(doc.get("response"), dict):
        err = doc["response"].get("error")
    else:
        err = doc.get("error")
    if isinstance(err, str):
        return UpstreamErrorFields(message=err or None)
    if not isinstance(err, dict):
        return None
    return UpstreamErrorFields(
        _text(err.get("message")), _text(err.get("type")), _text(err.get("code"))
    )


def _text(value: object) -> str | None:
    """A non-empty string field, else None."""
    return value if isinstance(value, str) and value else None

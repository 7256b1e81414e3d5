"""The response before its first content event: what is held, when it commits, what a fallback
may still do.

Until the first content event reaches the client, another upstream may still serve the
request. One Hold per request, fed by each exchange in turn, says where that stands:

- WAITING: nothing has reached the client. The exchange keeps the head it would send
  (`head`) and the body bytes as they would go out (`keep`); `release` writes them in one
  write (the usual path: head, role event and first token leave together).
- COMMITTED: a `200 text/event-stream` head and SSE comments only have reached the client:
  heartbeats while the upstream works on a long prompt (`heartbeat_s`), and the upstream's
  own comment lines (llama-server's pings). From here the body comes in as payloads
  (`feed`): comment blocks go out at once while no event is held, other events are held
  until the first content event; the relay frames the chunks itself (`chunked`) or, for an
  HTTP/1.0 client, the body ends by closing. A failure that would have been an HTTP error
  becomes one in-band error in the stream's API shape and a clean end (`fail`,
  `terminal.error_events`: chat's `{"error": ...}` and `[DONE]`, Anthropic's `event: error`,
  a Responses `error` event); the next candidate's events continue the same response
  (`retry`).
- OPEN: content (or anything that is not a comment) has reached the client: nothing is
  swapped any more. The exchange then writes to the client directly.

The heartbeat timer is re-armed lazily from the last write to the client (`last_out`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from relay.errors import UpstreamErrorFields, reason_phrase
from relay.http.chunked import LAST_CHUNK, frame
from relay.http.fields import HeaderPairs
from relay.http.response_framing import payload_of
from relay.http.to_client import client_response, with_cors
from relay.stream import dialect as D
from relay.stream.sse import event_json
from relay.stream.terminal import error_events

WAITING, COMMITTED, OPEN = 0, 1, 2
HELD, OPENED, ERROR = 0, 1, 2  # what `take` made of body bytes
LIMIT = 64 * 1024  # most bytes held back waiting for the first content event
HEARTBEAT = b": relay heartbeat\n\n"


def comment_prefix(buf: bytes) -> int:
    """Length of the leading run of whole comment blocks in `buf` (SSE lines starting with
    `:`, each block ended by a blank line): what may reach the client before content."""
    pos = 0
    while True:
        end = buf.find(b"\n\n", pos)
        if end < 0:
            return pos
        block = buf[pos:end]
        if b"\r" in block or not all(not line or line[0] == 0x3A for line in block.split(b"\n")):
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
        "chunked",
        "client",
        "dialect",
        "extra",
        "first_out",
        "head",
        "interval",
        "last_out",
        "loop",
        "more",
        "on_commit",
        "parts",
        "pending",
        "request_id",
        "size",
        "state",
        "swallow",
        "timer",
        "timer_at",
    )

    def __init__(
        self,
        loop,
        client,
        request_id: bytes,
        interval: float = 0.0,
        extra: HeaderPairs = (),
        dialect: str = D.CHAT,
    ) -> None:
        self.loop = loop
        self.dialect = dialect  # the API the stream speaks (the path's, then its events')
        self.client = client  # ClientConn: .transport, .http11, .wants_keep_alive, .gone
        self.request_id = request_id
        self.interval = interval  # heartbeat_s; 0 = never commit early
        self.extra = list(extra)  # headers every response of this request carries (CORS)
        self.state = WAITING
        self.more = False  # another candidate is left: a failure may quietly move on
        self.head = b""  # WAITING: the head the exchange would send
        self.parts: list[bytes] = []  # WAITING: bytes after the head; COMMITTED: held events
        self.size = 0
        self.pending: bytes | bytearray = b""  # COMMITTED: an unfinished event
        self.swallow = False  # COMMITTED: this response cannot continue it (non-2xx, not SSE)
        self.chunked = False  # COMMITTED: the client's body is framed by the relay
        self.on_commit: Callable[[], None] | None = (
            None  # the exchange's way to commit with its upstream's head
        )
        self.beats = 0
        self.timer = None
        self.timer_at = 0.0
        self.last_out = 0.0
        self.first_out: float | None = None  # perf_counter of the first byte out (a row's
        # first_byte_ms: observe.row_timings); every write before the hold opens comes through here

    @property
    def sent(self) -> bool:
        """Something reached the client."""
        return self.state != WAITING

    @property
    def committed(self) -> bool:
        return self.state == COMMITTED

    @property
    def open(self) -> bool:
        return self.state == OPEN

    # ---- heartbeat ---------------------------------------------------------------------
    def start(self) -> None:
        if self.interval > 0:
            self.last_out = self.loop.time()
            self._arm(self.last_out + self.interval)

    def _arm(self, at: float) -> None:
        self.timer_at = at
        self.timer = self.loop.call_at(at, self._tick)

    def _tick(self) -> None:
        self.timer = None
        if self.state == OPEN or self.client.gone:
            return
        due = self.last_out + self.interval
        if due > self.timer_at:  # something went out since: look again then
            self._arm(due)
            return
        if self.state == WAITING:
            if self.on_commit is not None:
                self.on_commit()  # the upstream's head is in: commit with it
            else:
                self.commit(None)
            if self.state != COMMITTED:
                return
        self.beats += 1
        self._out(HEARTBEAT)
        self._arm(self.last_out + self.interval)

    def close(self) -> None:
        self.on_commit = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _write(self, data: bytes) -> None:
        if not self.client.gone:
            self.client.transport.write(data)
            self.last_out = self.loop.time()
            if self.first_out is None:
                self.first_out = time.perf_counter()

    def _out(self, payload: bytes) -> None:
        if payload:
            self._write(frame(payload) if self.chunked else payload)

    def client_head(self, resp, chunked: bool, keep_alive: bool, keep_length: bool = True) -> bytes:
        """The head the client gets for an upstream response head (`resp`)."""
        raw = resp.headers
        if self.extra:  # CORS: the relay's answer replaces the upstream's
            raw = with_cors(raw, self.extra)
        if not keep_length:  # the relay frames the body itself
            raw = [(k, v) for k, v in raw if k.lower() != b"content-length"]
        status = resp.status_code
        return client_response(
            status, resp.reason or reason_phrase(status), raw, self.request_id, chunked, keep_alive
        )

    def take(self, out: bytes, content: bool, error_first: bool) -> int:
        """Body bytes while held, as they would go out. `content`: the first content event is
        in them; `error_first`: the first event is an `{"error": ...}` object. HELD: still
        held; OPENED: written, the client gets the rest directly; ERROR: this upstream's
        error ends its exchange (the next candidate serves, or the error is told in-band)."""
        if self.state == COMMITTED:
            if self.feed(out, content and not error_first):
                return OPENED
            return ERROR if error_first else HELD
        if error_first and self.more:
            return ERROR
        if self.keep(out) or content:
            self.release()
            return OPENED
        return HELD

    def commit_upstream(self, resp, kind: str, mode: str) -> tuple[bytes, int]:
        """Commit with the upstream's own head (`resp`), re-framed for the relay's chunks, as
        a heartbeat falls due while it and its events are held: what was held comes back as
        body payload, with the number of bytes it was held as."""
        sent = b"".join(self.parts)
        chunked = self.client.http11
        self.commit(
            self.client_head(
                resp, chunked, chunked and self.client.wants_keep_alive, keep_length=False
            )
        )
        return payload_of(kind, mode, sent), len(sent)

    # ---- WAITING -----------------------------------------------------------------------
    def keep(self, data: bytes) -> bool:
        """Hold bytes that follow the head; True once more is held than a hold may keep."""
        self.parts.append(data)
        self.size += len(data)
        return self.size > LIMIT

    def release(self) -> None:
        """Write what is held: the head and the bytes after it (WAITING), or the held events
        (COMMITTED). The client has seen more than comments from here."""
        if self.state == WAITING:
            self.parts.insert(0, self.head)
            self._write(b"".join(self.parts))
        elif self.state == COMMITTED:
            self._out(b"".join(self.parts) + self.pending)
        self.parts, self.size, self.pending, self.head = [], 0, b"", b""
        self.state = OPEN
        self.close()

    # ---- COMMITTED ---------------------------------------------------------------------
    def commit(self, head: bytes | None) -> None:
        """Send a 200 event-stream head (the upstream's own, re-framed by the caller, or the
        relay's); from here only comments reach the client until the first content event."""
        client = self.client
        self.chunked = client.http11
        if head is None:
            head = synthetic_head(
                self.request_id, self.chunked, client.wants_keep_alive and self.chunked, self.extra
            )
        self.parts, self.size, self.pending, self.head = [], 0, b"", b""
        self.state = COMMITTED
        self._write(head)

    def feed(self, payload: bytes, content: bool) -> bool:
        """Body payload while COMMITTED; `content`: the first content event is in it. True
        when the hold opens (content, or more held than a hold may keep)."""
        if self.swallow:
            return False
        if content:
            self.pending += payload
            self.release()
            return True
        pending = self.pending
        if pending and not (b"\n\n" in payload or (pending[-1] == 10 and payload[:1] == b"\n")):
            # the unfinished event goes on: it grows in place, searched only in the new
            # bytes (an event sent a byte at a time costs linear time, not quadratic)
            if isinstance(pending, bytes):
                pending = self.pending = bytearray(pending)
            pending += payload
            if self.size + len(pending) > LIMIT:
                self.release()
                return True
            return False
        buf = bytes(pending) + payload if pending else payload
        end = buf.rfind(b"\n\n")
        end = end + 2 if end >= 0 else 0  # whole events first, an unfinished one after
        whole, self.pending = buf[:end], buf[end:]
        if whole and not self.parts:
            n = comment_prefix(whole)
            self._out(whole[:n])
            whole = whole[n:]
        if whole:
            self.parts.append(whole)
            self.size += len(whole)
        if self.size + len(self.pending) > LIMIT:
            self.release()
            return True
        return False

    def finish(self) -> None:
        """The upstream's body ended cleanly while held: it all goes out, and the end."""
        if self.state == COMMITTED:
            if self.swallow:
                return  # the caller answers in-band instead
            self.release()
            if self.chunked:
                self._write(LAST_CHUNK)
        elif self.state == WAITING:
            self.release()

    def fail(self, message: str, type_: str, code: str | None) -> bool:
        """End the committed response with one in-band error in its API's shape and a clean
        end; True when the client connection may stay open."""
        self.parts, self.size, self.pending = [], 0, b""
        self._out(error_events(self.dialect, message, type_, code))
        if self.chunked:
            self._write(LAST_CHUNK)
        self.state = OPEN
        self.close()
        return self.chunked and self.client.wants_keep_alive

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
        self.on_commit = None
        self.swallow = False
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
    if doc.get("type") == "error" and "error" not in doc:  # Responses' error event
        message, code = doc.get("message"), doc.get("code")
        return UpstreamErrorFields(
            message if isinstance(message, str) and message else None,
            None,
            code if isinstance(code, str) and code else None,
        )
    if doc.get("type") == "response.failed" and isinstance(doc.get("response"), dict):
        err = doc["response"].get("error")
    else:
        err = doc.get("error")
    if isinstance(err, str):
        return UpstreamErrorFields(message=err or None)
    if not isinstance(err, dict):
        return None
    message, type_, code = (err.get(k) for k in ("message", "type", "code"))
    return UpstreamErrorFields(
        message if isinstance(message, str) and message else None,
        type_ if isinstance(type_, str) and type_ else None,
        code if isinstance(code, str) and code else None,
    )

"""One request on one upstream connection: wait for the head, then relay the body.

This is the hot path. Upstream bytes go to the client transport unchanged as they arrive
(chunked framing passed through raw while `ChunkTracker` follows it); the SSE scanner watches
the payload in passing; the stall guard is one timer re-armed lazily from the last read time.
Every way out ends in `_end(outcome)`, exactly once, which resolves `done`.
"""

from __future__ import annotations

import asyncio
import time

from relay import framing, headers as hdr
from relay.head import BadHead, HeadReader, ResponseHead, request_bytes
from relay.chunked import LAST_CHUNK, SIZE, ChunkError, ChunkTracker, frame
from relay.fastpath import same_shape, shape_of, token_event
from relay.errors import reason_phrase
from relay.sse import SseScanner
from relay.usage import JsonBody
from relay.stall import StallPolicy, stall_frame

from relay.outcomes import (  # noqa: F401 - the dispatcher reads them from here
    BAD_FRAMING, CLIENT_GONE, CLIENT_SLOW, DONE, DROPPED, ERROR_EVENT, SHUTDOWN, STALL,
    ClientGone, RelayShutdown, UpstreamBadHead, UpstreamGone,
)

_HOLD_LIMIT = 64 * 1024  # most bytes held back waiting for the first content event


class Exchange:
    # Slots: nearly 50 fields is past what a shared-key instance dict holds, and the body
    # path reads several per event.
    __slots__ = (
        "_closed_early", "_leftover", "_write", "body_copy", "body_started", "bytes_out",
        "can_retry", "client", "client_keep_alive", "conn", "counted", "data_received", "done",
        "fast", "first_content_at", "got_bytes", "head_at", "head_bytes", "head_reader",
        "head_fut", "head_resp", "head_sent", "held", "held_size", "holding", "kind",
        "last_read", "loop", "method", "mode", "model", "on_content", "outcome", "path",
        "paused", "policy", "remaining", "request_id", "scanner", "shape", "sse",
        "stall_elapsed", "stall_reason", "status", "timer", "tracker", "upstream_keep_alive",
        "upstream_name", "write_timeout_s", "write_timer",
    )

    def __init__(self, loop, conn, client, method: bytes, request_id: bytes,
                 policy: StallPolicy, write_timeout_s: float, path: str, model: str,
                 upstream_name: str) -> None:
        self.loop = loop
        self.conn = conn
        self.client = client  # ClientConn: .transport, .http11, .wants_keep_alive
        self.method = method
        self.request_id = request_id
        self.policy = policy
        self.write_timeout_s = write_timeout_s
        self.path = path
        self.model = model
        self.upstream_name = upstream_name
        self.head_reader: HeadReader | None = HeadReader()  # None once the head is parsed
        self.head_fut: asyncio.Future = loop.create_future()
        self.head_resp: ResponseHead | None = None
        self.done: asyncio.Future = loop.create_future()
        self.got_bytes = False
        self.body_started = False
        self._leftover = b""
        self._closed_early = False
        # set when the head arrives
        self.status = 0
        self.kind = framing.EMPTY
        self.mode = framing.PASS
        self.remaining = 0
        self.tracker: ChunkTracker | None = None
        self.scanner: SseScanner | None = None
        self.sse = False
        self.upstream_keep_alive = False
        self.client_keep_alive = False
        self.holding = False
        self.held: list[bytes] = []
        self.held_size = 0
        self.head_bytes = b""
        self.head_sent = False
        self.head_at = 0.0
        self.last_read = 0.0
        self.first_content_at: float | None = None
        self.bytes_out = 0
        self.outcome: str | None = None
        self.stall_reason: str | None = None
        self.stall_elapsed = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.counted = 0  # tokens already added to the upstream's rate window
        self.fast = False  # the next read may be recognised by the fast path (fastpath.py)
        self.shape = None  # this stream's token event around its text (fastpath.shape_of)
        self.can_retry = False  # another candidate is left: fail quietly before content
        self.on_content = None  # called once the first content event is written (metrics)
        self.body_copy: JsonBody | None = None
        # While the body flows the exchange is the upstream transport's protocol itself, and
        # its data_received is upstream_data: no hop (uvloop binds it at set_protocol time).
        self.data_received = self.upstream_data

    # ---- request -------------------------------------------------------------------
    def request_bytes(self, target: bytes, head: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        return request_bytes(self.method, target, head, body)

    # ---- upstream callbacks (UpstreamConn) -----------------------------------------
    def upstream_data(self, data: bytes) -> None:
        if not self.body_started:
            if self.head_reader is not None:
                self._head_data(data)
            else:  # head parsed, body not started yet: keep for start_body
                self._leftover += data
            return
        self.last_read = self.loop.time()
        if self.fast:  # the usual read, one token: see relay/fastpath.py
            shape = self.shape
            if (shape is not None and same_shape(data, shape)) or self._token_read(data):
                self.scanner.content_events += 1
                self.bytes_out += len(data)
                self._write(data)
                return
        kind = self.kind
        if kind == framing.CHUNKED:
            tracker = self.tracker
            spans = tracker.spans(data)
            if spans is not None:  # whole chunks: forward as is, scan in place
                scanner = self.scanner
                if scanner is not None:
                    if len(spans) == 2:
                        scanner.feed_span(data, spans[0], spans[1])
                    else:
                        feed = scanner.feed_span
                        for i in range(0, len(spans), 2):
                            feed(data, spans[i], spans[i + 1])
                if self.mode == framing.PASS:
                    self._emit(data)
                else:
                    self._emit(b"".join(data[spans[i]:spans[i + 1]]
                                        for i in range(0, len(spans), 2)))
                self._check_fast()
                return
            try:
                out, payloads = tracker.feed(data)
            except ChunkError:
                self._upstream_failed(BAD_FRAMING)
                return
            scanner = self.scanner
            if scanner is not None:
                for p in payloads:
                    scanner.feed(p)
            if self.mode == framing.DECHUNK:
                out = b"".join(payloads)
            self._emit(out)
            if tracker.state == 4:  # DONE
                self.upstream_keep_alive &= not tracker.extra
                self._end(DONE)
            else:
                self._check_fast()
        elif kind == framing.LENGTH:
            if len(data) >= self.remaining:
                if len(data) > self.remaining:
                    data = data[: self.remaining]
                    self.upstream_keep_alive = False
                self.remaining = 0
            else:
                self.remaining -= len(data)
            if self.scanner is not None:
                self.scanner.feed(data)
            self._emit(data)
            if not self.remaining:
                self._end(DONE)
        elif kind == framing.UNTIL_CLOSE:
            if self.scanner is not None:
                self.scanner.feed(data)
            self._emit(frame(data) if self.mode == framing.CHUNK else data)

    def _token_read(self, data: bytes) -> bool:
        """A read checked from scratch; a token event's shape is kept for the next reads."""
        i = token_event(data)
        if i:
            self.shape = shape_of(data, i) or self.shape
        return i > 0

    def upstream_closed(self, exc) -> None:
        if self.head_reader is not None:
            if not self.head_fut.done():
                self.head_fut.set_exception(UpstreamGone(silent=not self.got_bytes))
            self.head_reader = None
            return
        if not self.body_started:
            self._closed_early = True
            return
        if self.outcome is not None:
            return
        if self.kind == framing.UNTIL_CLOSE:
            self.upstream_keep_alive = False
            if self.mode == framing.CHUNK:
                self._emit(LAST_CHUNK)
            self._end(DONE)
        else:
            self._upstream_failed(DROPPED)

    # ---- head ----------------------------------------------------------------------
    def _head_data(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            parsed = self.head_reader.feed(data)
        except BadHead as exc:
            self.head_reader = None
            self.conn.abort()  # read no more of it (an endless head would pile up meanwhile)
            if not self.head_fut.done():
                self.head_fut.set_exception(UpstreamBadHead(str(exc)))
            return
        if parsed is None:
            return
        resp, self._leftover = parsed
        self.head_reader = None
        self.head_at = self.last_read = self.loop.time()
        self.head_resp = resp
        if self.head_fut.done():
            return
        status = resp.status_code
        if not (self.can_retry and (status == 429 or status >= 500)):
            self.start_body(resp)  # at once: the dispatcher only awaits `done` from here
        self.head_fut.set_result(resp)

    def eof_received(self):
        return self.conn.eof_received()

    def connection_lost(self, exc) -> None:
        self.conn.connection_lost(exc)

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass

    def start_body(self, resp: ResponseHead, hold_for_content: bool = True) -> None:
        """Decide framing, write (or hold) the head, and relay what came with it."""
        if self.outcome is not None:
            return
        self.body_started = True
        transport = self.conn.transport
        if transport is not None and not transport.is_closing():
            transport.set_protocol(self)
        raw = resp.headers
        self.status = resp.status_code
        try:
            self.kind, self.remaining = framing.upstream_body(self.method, self.status, raw)
        except framing.FramingError:  # (head.py refuses these heads first) nothing is sent
            self.conn.abort()
            self._upstream_failed(BAD_FRAMING)
            return
        self.mode = framing.carriage(self.kind, self.client.http11)
        ctype = hdr.get(raw, b"content-type") or b""
        self.sse = ctype.lower().startswith(b"text/event-stream")
        self.upstream_keep_alive = resp.http_version == b"1.1" and not hdr.has_token(
            raw, b"connection", b"close")
        self.client_keep_alive = self.client.wants_keep_alive and framing.self_delimited(
            self.kind, self.mode)
        if self.kind == framing.CHUNKED:
            self.tracker = ChunkTracker()
        if self.sse:
            self.scanner = SseScanner(self._first_content)
        elif b"json" in ctype.lower():  # a whole JSON body: keep it (bounded) to read usage
            self.scanner = self.body_copy = JsonBody()
        self._write = self.client.transport.write
        self.head_bytes = hdr.client_response(
            self.status, resp.reason or reason_phrase(self.status), raw, self.request_id,
            framing.client_chunked(self.kind, self.mode), self.client_keep_alive)
        hold = hold_for_content and self.sse and 200 <= self.status < 300
        self.holding = True  # the head and what came with it leave in one write
        if self.kind == framing.EMPTY:
            # bytes after a head with no body: the upstream is out of step, do not reuse it
            self.upstream_keep_alive &= not self._leftover
            self._end(DONE)
            return
        leftover, self._leftover = self._leftover, b""
        if leftover:
            self.upstream_data(leftover)
        if not hold and self.holding and self.outcome is None:
            self._release_hold()
        if self.outcome is None:
            self._arm()  # (after the first write: it is not in the client's wait)
        if self._closed_early:
            self.upstream_closed(None)

    # ---- body ----------------------------------------------------------------------
    def _first_content(self) -> None:
        # the held head goes out with this read, in _emit: one write, one wake-up; the
        # metrics hear of it after that write (`_emit`)
        self.first_content_at = time.perf_counter()

    def _release_hold(self) -> None:
        self.holding = False
        self.head_sent = True
        self.held.insert(0, self.head_bytes)
        self._write(b"".join(self.held))
        self.held = []

    def _emit(self, out: bytes) -> None:
        if out:
            self.bytes_out += len(out)
            if not self.holding:
                self._write(out)
            elif self.can_retry and self.scanner is not None and self.scanner.error_first:
                self.conn.abort()  # an {"error": ...} first event: try the next upstream
                self._end(ERROR_EVENT)
                return
            else:
                self.held.append(out)
                self.held_size += len(out)
                if self.first_content_at is not None or self.held_size > _HOLD_LIMIT:
                    self._release_hold()
        if self.on_content is not None and self.first_content_at is not None:
            report, self.on_content = self.on_content, None
            report(self)

    def _check_fast(self) -> None:
        """Whether the next read may take the fast path: streaming, between chunks and events."""
        sc, tr = self.scanner, self.tracker
        self.fast = (self.mode == framing.PASS and not self.holding and self.outcome is None
                     and isinstance(sc, SseScanner) and sc.content_events > 0
                     and not sc.pending and tr.state == SIZE and not tr.held)

    def _upstream_failed(self, outcome: str) -> None:
        """The upstream broke the body: the client sees the truncation (no clean end).

        While the head is still held nothing has reached the client: the caller answers
        with an error of its own (or tries another upstream) instead.
        """
        self.client_keep_alive = False
        self._end(outcome)

    # ---- stall guard -----------------------------------------------------------------
    def _arm(self) -> None:
        self.timer = self.loop.call_at(self.policy.next_check(self.head_at, self.last_read),
                                       self._check_stall)

    def _check_stall(self) -> None:
        self.timer = None
        if self.outcome is not None:
            return
        now = self.loop.time()
        if self.paused:  # the client is the slow side: reads are not owed
            self.last_read = now
        reason = self.policy.due(now, self.head_at, self.last_read)
        if reason is None:
            self._arm()
            return
        self.trip(reason, now)

    def trip(self, reason: str, now: float) -> None:
        self.stall_reason = reason
        self.stall_elapsed = self.policy.elapsed(reason, now, self.head_at, self.last_read)
        self.conn.abort()
        if self.holding and self.can_retry:  # nothing reached the client: next upstream
            self._end(STALL)
            return
        if not self.sse:  # non-SSE bodies are cut: nothing injected
            self.client_keep_alive = False
            if self.holding:
                self._release_hold()
            self._end(STALL)
            return
        payload = b""
        if not self.scanner.done_seen:
            payload = stall_frame(self.path, self.model, reason, self.stall_elapsed,
                                  self.upstream_name, int(time.time()))
        if self.holding:
            self._release_hold()
        tail, self_delimited = framing.closing_bytes(self.kind, self.mode, self.tracker, payload)
        self.client_keep_alive &= self_delimited
        if tail:
            self.bytes_out += len(tail)
            self.client.transport.write(tail)
        self._end(STALL)

    # ---- flow control (client transport) -------------------------------------------
    def client_paused(self) -> None:
        self.paused = True
        if self.conn.transport is not None and self.outcome is None:
            self.conn.transport.pause_reading()
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(self.write_timeout_s, self._write_stuck)

    def client_resumed(self) -> None:
        self.paused = False
        self.last_read = self.loop.time()
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        if self.conn.transport is not None and self.outcome is None:
            self.conn.transport.resume_reading()

    def _write_stuck(self) -> None:
        self.write_timer = None
        if self.outcome is None:
            self.conn.abort()
            self.client_keep_alive = False
            self._end(CLIENT_SLOW)

    def head_timeout(self) -> None:
        if not self.head_fut.done():
            self.head_fut.set_exception(TimeoutError())
            self.head_reader = None

    def client_gone(self) -> None:
        """The client closed or reset: close the upstream socket at once."""
        self.conn.abort()
        self.client_keep_alive = False
        if not self.head_fut.done():
            self.head_fut.set_exception(ClientGone())
            self.head_reader = None
        if self.outcome is None and self.head_at:
            self._end(CLIENT_GONE)

    def shutdown(self) -> None:
        if self.outcome is not None:
            return
        self.conn.abort()
        if self.head_at:
            self._upstream_failed(SHUTDOWN)
        elif not self.head_fut.done():
            self.head_fut.set_exception(RelayShutdown())
            self.head_reader = None

    # ---- the one way out ---------------------------------------------------------------
    def _end(self, outcome: str) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.fast = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        if self.holding and outcome == DONE:
            self._release_hold()
        if self.conn.handler is self:
            self.conn.handler = None
        transport = self.conn.transport
        if transport is not None and transport.get_protocol() is self:
            transport.set_protocol(self.conn)
        if self.paused and self.conn.transport is not None:
            self.conn.transport.resume_reading()
        if not self.done.done():
            self.done.set_result(outcome)

    @property
    def reusable(self) -> bool:
        return (self.outcome == DONE and self.upstream_keep_alive
                and self.kind != framing.UNTIL_CLOSE)

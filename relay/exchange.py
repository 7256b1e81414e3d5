"""One request on one upstream connection: wait for the head, then relay the body.

This is the hot path. Upstream bytes go to the client transport unchanged as they arrive
(chunked framing passed through raw while `ChunkTracker` follows it); the SSE scanner watches
the payload in passing; the stall guard is one timer re-armed lazily from the last read time.
Every way out ends in `_end(outcome)`, exactly once, which resolves `done`.
"""

from __future__ import annotations

import asyncio
import time

import h11

from relay import framing, headers as hdr
from relay.chunked import LAST_CHUNK, ChunkError, ChunkTracker, frame
from relay.errors import reason_phrase
from relay.sse import SseScanner
from relay.stall import StallPolicy, stall_frame

# outcomes
DONE = "done"
DROPPED = "upstream_dropped"
BAD_FRAMING = "upstream_bad_framing"
CLIENT_GONE = "client_closed"
CLIENT_SLOW = "client_write_timeout"
STALL = "stall"
SHUTDOWN = "shutdown"
_HOLD_LIMIT = 64 * 1024  # most bytes held back waiting for the first content event


class UpstreamGone(Exception):
    """The upstream closed before a whole response head; `silent` if not one byte came."""

    def __init__(self, silent: bool) -> None:
        super().__init__("upstream closed the connection before a response head")
        self.silent = silent


class UpstreamBadHead(Exception):
    pass


class ClientGone(Exception):
    pass


class Exchange:
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
        self.h11: h11.Connection | None = h11.Connection(h11.CLIENT)
        self.head_fut: asyncio.Future = loop.create_future()
        self.head_resp: h11.Response | None = None
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
        self.end_at: float | None = None
        self.bytes_out = 0
        self.outcome: str | None = None
        self.stall_reason: str | None = None
        self.stall_elapsed = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        self.paused = False

    # ---- request -------------------------------------------------------------------
    def request_bytes(self, target: bytes, head: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        out = self.h11.send(h11.Request(method=self.method, target=target, headers=head))
        if body:
            out += self.h11.send(h11.Data(data=body))
        return out + self.h11.send(h11.EndOfMessage())

    # ---- upstream callbacks (UpstreamConn) -----------------------------------------
    def upstream_data(self, data: bytes) -> None:
        if not self.body_started:
            if self.h11 is not None:
                self._head_data(data)
            else:  # head parsed, body not started yet: keep for start_body
                self._leftover += data
            return
        self.last_read = self.loop.time()
        kind = self.kind
        if kind == framing.CHUNKED:
            tracker = self.tracker
            start = tracker.single(data)
            if start > 0:  # one whole chunk: forward as is, scan in place
                if self.scanner is not None:
                    self.scanner.feed_span(data, start, len(data) - 2)
                self._emit(data if self.mode == framing.PASS else data[start:-2])
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

    def upstream_closed(self, exc) -> None:
        if self.h11 is not None:
            if not self.head_fut.done():
                self.head_fut.set_exception(UpstreamGone(silent=not self.got_bytes))
            self.h11 = None
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
        conn = self.h11
        try:
            conn.receive_data(data)
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    return
                if isinstance(ev, h11.InformationalResponse):
                    continue
                if isinstance(ev, h11.Response):
                    break
                raise h11.RemoteProtocolError(f"unexpected {type(ev).__name__}")
        except h11.RemoteProtocolError as exc:
            self.h11 = None
            if not self.head_fut.done():
                self.head_fut.set_exception(UpstreamBadHead(str(exc)))
            return
        leftover = conn.trailing_data[0]
        self.h11 = None
        self.head_at = self.last_read = self.loop.time()
        if not self.head_fut.done():
            self.head_fut.set_result(ev)
        self._leftover = leftover

    def start_body(self, resp: h11.Response, hold_for_content: bool = True) -> None:
        """Decide framing, write (or hold) the head, and relay what came with it."""
        if self.outcome is not None:
            return
        self.body_started = True
        raw = resp.headers.raw_items()
        self.status = resp.status_code
        try:
            self.kind, self.remaining = framing.upstream_body(self.method, self.status, raw)
        except framing.FramingError:
            self.kind, self.remaining = framing.UNTIL_CLOSE, -1
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
        self._write = self.client.transport.write
        self.head_bytes = hdr.client_response(
            self.status, resp.reason or reason_phrase(self.status), raw, self.request_id,
            framing.client_chunked(self.kind, self.mode), self.client_keep_alive)
        self.holding = hold_for_content and self.sse and 200 <= self.status < 300
        if not self.holding:
            self._send_head()
        if self.kind == framing.EMPTY:
            self._end(DONE)
            return
        self._arm()
        leftover, self._leftover = self._leftover, b""
        if leftover:
            self.upstream_data(leftover)
        if self._closed_early:
            self.upstream_closed(None)

    def _send_head(self) -> None:
        self.head_sent = True
        self.client.transport.write(self.head_bytes)

    # ---- body ----------------------------------------------------------------------
    def _first_content(self) -> None:
        self.first_content_at = time.perf_counter()
        if self.holding:
            self._release_hold()

    def _release_hold(self) -> None:
        self.holding = False
        self._send_head()
        if self.held:
            self.client.transport.writelines(self.held)
            self.held = []

    def _emit(self, out: bytes) -> None:
        if not out:
            return
        self.bytes_out += len(out)
        if self.holding:
            self.held.append(out)
            self.held_size += len(out)
            if self.held_size > _HOLD_LIMIT:
                self._release_hold()
            return
        self._write(out)

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
        mode, kind = self.mode, self.kind
        if kind == framing.CHUNKED and mode == framing.PASS:
            tail = self.tracker.close_with(payload)
        elif mode == framing.CHUNK:
            tail = frame(payload) + LAST_CHUNK
        elif kind == framing.LENGTH:
            tail = b""  # a declared length cannot grow: cut
            self.client_keep_alive = False
        else:  # close-delimited to the client
            tail = payload
            self.client_keep_alive = False
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

    def client_gone(self) -> None:
        """The client closed or reset: close the upstream socket at once."""
        self.conn.abort()
        self.client_keep_alive = False
        if not self.head_fut.done():
            self.head_fut.set_exception(ClientGone())
            self.h11 = None
        if self.outcome is None and self.head_at:
            self._end(CLIENT_GONE)

    def shutdown(self) -> None:
        if self.outcome is None and self.head_at:
            self.conn.abort()
            self._upstream_failed(SHUTDOWN)

    # ---- the one way out ---------------------------------------------------------------
    def _end(self, outcome: str) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.end_at = self.loop.time()
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
        if self.paused and self.conn.transport is not None:
            self.conn.transport.resume_reading()
        if not self.done.done():
            self.done.set_result(outcome)

    @property
    def reusable(self) -> bool:
        return self.outcome == DONE and self.upstream_keep_alive and self.kind != framing.UNTIL_CLOSE

"""One request on one upstream connection: wait for the head, then relay the body.

This is the hot path. Upstream bytes go to the client transport unchanged as they arrive
(chunked framing passed through raw while `ChunkTracker` follows it); the SSE scanner watches
the payload in passing; the stall guard is one deadline (relay/deadlines.py: one loop timer
for every stream) re-armed lazily from the last read time.
Every way out ends in `_end(outcome)`, exactly once, which resolves `done`.
"""

from __future__ import annotations

import asyncio
import time

from relay.http import response_framing as framing
from relay.http.chunked import LAST_CHUNK, SIZE, ChunkError, ChunkTracker, frame
from relay.http.response_head import BadHead, HeadReader, ResponseHead
from relay.stream.client_flow import ClientFlow
from relay.stream.content_hold import ERROR, OPENED, Hold
from relay.stream.deadlines import Deadlines
from relay.stream.endings import (
    BAD_FRAMING,
    CLIENT_GONE,
    CLIENT_SLOW,
    DONE,
    DROPPED,
    ERROR_EVENT,
    SHUTDOWN,
    STALL,
    ClientGone,
    RelayShutdown,
    UpstreamBadHead,
    UpstreamGone,
)
from relay.stream.fastpath import events_in, learn
from relay.stream.itl import Gaps
from relay.stream.sse import SseScanner
from relay.stream.stall import StallPolicy, stall_frame
from relay.stream.usage import JsonBody


def _ended_data(*_) -> None:
    """What an ended exchange leaves where its own bound methods were (its data_received: the
    transport reads into its UpstreamConn again; its flow's on_stuck)."""


class Exchange:
    # Slots: over 40 fields is past what a shared-key instance dict holds, and the body
    # path reads several per event.
    __slots__ = (
        "_closed_early",
        "_leftover",
        "_write",
        "body_copy",
        "body_started",
        "bytes_out",
        "client",
        "client_keep_alive",
        "conn",
        "counted",
        "data_received",
        "deadlines",
        "done",
        "fast",
        "first_content_at",
        "flow",
        "gaps",
        "got_bytes",
        "head_at",
        "head_fut",
        "head_reader",
        "head_resp",
        "hold",
        "kind",
        "last_read",
        "loop",
        "method",
        "mode",
        "model",
        "on_content",
        "open_fut",
        "outcome",
        "path",
        "policy",
        "remaining",
        "request_id",
        "scanner",
        "shape",
        "sse",
        "stall_elapsed",
        "stall_reason",
        "status",
        "timer",
        "tracker",
        "upstream_keep_alive",
        "upstream_name",
        "write_timeout_s",
    )

    def __init__(
        self,
        loop,
        conn,
        client,
        method: bytes,
        request_id: bytes,
        policy: StallPolicy,
        write_timeout_s: float,
        path: str,
        model: str,
        upstream_name: str,
        hold: Hold,
        deadlines: Deadlines,
    ) -> None:
        self.loop = loop
        self.deadlines = deadlines  # the relay's stall deadlines (one loop timer for all)
        self.conn = conn
        self.client = client  # ClientConn: .transport, .http11, .wants_keep_alive
        self.method = method
        self.request_id = request_id
        self.policy = policy
        self.flow: ClientFlow | None = None  # made the first time the client falls behind
        self.write_timeout_s = write_timeout_s
        self.path = path
        self.model = model
        self.upstream_name = upstream_name
        self.head_reader: HeadReader | None = HeadReader()  # None once the head is parsed
        # resolved when the response head is in; None once the dispatcher has seen it
        self.head_fut: asyncio.Future | None = loop.create_future()
        self.head_resp: ResponseHead | None = None
        self.done: asyncio.Future = loop.create_future()
        self.open_fut: asyncio.Future | None = None  # `opened()`: resolved when the hold opens
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
        # the request's hold until the first content event is out (relay/hold.py), then None
        self.hold: Hold | None = hold
        self.head_at = 0.0
        self.last_read = 0.0
        self.first_content_at: float | None = None
        self.gaps: Gaps | None = None  # SSE: gaps between content events (relay/gaps.py)
        self.bytes_out = 0
        self.outcome: str | None = None
        self.stall_reason: str | None = None
        self.stall_elapsed = 0.0
        self.timer: int | None = None  # the stall guard's deadline in `deadlines`
        self.counted = 0  # tokens already added to the upstream's rate window
        self.fast = False  # the next read may be recognised by the fast path (fastpath.py)
        self.shape = None  # this stream's token events up to their text (fastpath.learn)
        self.on_content = None  # called once the first content event is written (metrics)
        self.body_copy: JsonBody | None = None
        # While the body flows the exchange is the upstream transport's protocol itself, and
        # its data_received is upstream_data: no hop (uvloop binds it at set_protocol time).
        self.data_received = self.upstream_data

    # ---- upstream callbacks (UpstreamConn) -----------------------------------------
    def upstream_data(self, data: bytes) -> None:
        if not self.body_started:
            if self.head_reader is not None:
                self._head_data(data)
            else:  # head parsed, body not started yet: keep for start_body
                self._leftover += data
            return
        now = self.last_read = self.loop.time()
        if self.fast:  # the usual read, whole token events: see relay/fastpath.py
            shape = self.shape
            n = events_in(data, shape) if shape is not None else 0
            if n or (n := self._token_read(data)):
                self.scanner.content_events += n
                gp = self.gaps  # one inter-token gap (relay/gaps.py)
                g = now - gp.last
                gp.last = now
                if gp.lo <= g < gp.hi:  # in the last gap's bucket again
                    gp.run += 1
                    if g > gp.max:
                        gp.max = g
                else:
                    gp.add(g)
                if n != 1:  # the others came with it: gaps of 0 (Gaps.events)
                    gp.zeros += n - 1
                self.bytes_out += len(data)
                self._write(data)
                return
        gp = self.gaps
        if gp is None:
            self._body_read(data)
            return
        before = self.scanner.content_events
        self._body_read(data)
        if self.scanner.content_events != before:
            gp.events(now, before, self.scanner.content_events)

    def _body_read(self, data: bytes) -> None:
        """Any read the fast path did not take: chunk tracker, scanner, then forward."""
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
                    self._emit(
                        b"".join(data[spans[i] : spans[i + 1]] for i in range(0, len(spans), 2))
                    )
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
            if self.mode != framing.PASS:  # DECHUNK, REFRAME: payloads only
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

    def _token_read(self, data: bytes) -> int:
        """A read that missed the stream's shape: its token events by a shape learned from
        itself (kept for the next reads then), or 0."""
        shape = learn(data)
        if shape is None:
            return 0
        n = events_in(data, shape)
        if n:
            self.shape = shape
        return n

    def upstream_closed(self, exc) -> None:
        if self.head_reader is not None:
            self._head_failed(UpstreamGone(silent=not self.got_bytes))
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
            self._head_failed(UpstreamBadHead(str(exc)))
            return
        if parsed is None:
            return
        resp, self._leftover = parsed
        self.head_reader = None
        self.head_at = self.last_read = self.loop.time()
        self.head_resp = resp
        if self.head_fut is None or self.head_fut.done():
            return
        status = resp.status_code
        if not (self.hold.more and (status == 429 or status >= 500)):
            self.start_body(resp)  # at once: the dispatcher only awaits `done` from here
        self.head_fut.set_result(None)  # (the head is `head_resp`, dropped once the hold opens)

    def eof_received(self):
        return self.conn.eof_received()

    def connection_lost(self, exc) -> None:
        self.conn.connection_lost(exc)

    def pause_writing(self) -> None:  # (towards the upstream: a request is one write)
        pass

    resume_writing = pause_writing

    def start_body(self, resp: ResponseHead) -> None:
        """Decide framing, hold (or write) the head, and relay what came with it."""
        if self.outcome is not None:
            return
        self.body_started = True
        transport = self.conn.transport
        if transport is not None and not transport.is_closing():
            transport.set_protocol(self)
        hold = self.hold
        self.status = resp.status_code
        try:
            p = framing.plan(
                self.method,
                self.status,
                resp.http_version,
                resp.headers,
                self.client.http11,
                self.client.wants_keep_alive,
                hold.committed,
            )
        except framing.FramingError:  # (head.py refuses these heads first) nothing is sent
            self.conn.abort()
            self._upstream_failed(BAD_FRAMING)
            return
        self.kind, self.remaining, self.mode, self.sse = p.kind, p.remaining, p.mode, p.sse
        self.upstream_keep_alive, self.client_keep_alive = (
            p.upstream_keep_alive,
            p.client_keep_alive,
        )
        if hold.committed:  # only comments reached the client: this body continues it
            hold.swallow = not p.holdable  # answered in-band by the dispatcher instead
        else:
            hold.head = hold.client_head(
                resp, framing.client_chunked(self.kind, self.mode), self.client_keep_alive
            )
            if p.holdable:
                hold.on_commit = self._commit_early
        if self.kind == framing.CHUNKED:
            self.tracker = ChunkTracker()
        if self.sse:
            self.scanner = SseScanner(self._first_content)
            self.gaps = Gaps()
        elif p.json:  # a whole JSON body: keep it (bounded) to read usage
            self.scanner = self.body_copy = JsonBody()
        self._write = self.client.transport.write
        if self.kind == framing.EMPTY:
            # bytes after a head with no body: the upstream is out of step, do not reuse it
            self.upstream_keep_alive &= not self._leftover
            self._end(DONE)
            return
        leftover, self._leftover = self._leftover, b""
        if leftover:
            self.upstream_data(leftover)
        if not p.holdable and self.hold is not None and not hold.committed and self.outcome is None:
            self._release_hold()
        if self.outcome is None:
            self._arm()  # (after the first write: it is not in the client's wait)
        if self._closed_early:
            self.upstream_closed(None)

    def _commit_early(self) -> None:
        """A heartbeat is due while this upstream's head and events are held."""
        held, sent = self.hold.commit_upstream(self.head_resp, self.kind, self.mode)
        self.mode = framing.committed_carriage(self.kind, self.client.http11)
        self.client_keep_alive = self.client.wants_keep_alive and self.client.http11
        self.bytes_out -= sent  # counted again, as payload
        if held:
            self._emit(held)

    # ---- body ----------------------------------------------------------------------
    def _first_content(self) -> None:
        # the held head goes out with this read (_emit: one write), then the metrics hear
        self.first_content_at = time.perf_counter()

    def _release_hold(self) -> None:
        self.hold.release()
        self._opened()

    def opened(self) -> asyncio.Future:
        """A future resolved once the hold is open (content reached the client: nothing is
        swapped any more) or the exchange ended, whichever comes first."""
        fut = self.open_fut = self.loop.create_future()
        if self.hold is None or self.outcome is not None:
            self._resolve_open()
        return fut

    def _resolve_open(self) -> None:
        fut, self.open_fut = self.open_fut, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _opened(self) -> None:
        """The hold is over: from here the exchange writes to the client itself (its own chunks
        in REFRAME, until both sides stand between chunks: `_check_fast`)."""
        self.hold = None
        self.head_resp = None  # (its headers were written: not kept for the stream)
        self._resolve_open()
        if self.mode == framing.REFRAME:
            transport = self.client.transport
            self._write = lambda payload: transport.write(frame(payload))

    def _emit(self, out: bytes) -> None:
        if out:
            self.bytes_out += len(out)
            if self.hold is None:
                self._write(out)
            else:
                self._held(out)
        if self.on_content is not None and self.first_content_at is not None:
            report, self.on_content = self.on_content, None
            report(self)

    def _held(self, out: bytes) -> None:
        sc = self.scanner
        took = self.hold.take(
            out, self.first_content_at is not None, sc is not None and sc.error_first
        )
        if took == OPENED:
            self._opened()
        elif took == ERROR:  # an {"error": ...} first event: the next upstream, or in-band
            self.conn.abort()
            self._end(ERROR_EVENT)

    def _check_fast(self) -> None:
        """Whether the next read may take the fast path: streaming, between chunks and events."""
        if self.mode != framing.PASS:
            tr = self.tracker
            if self.mode != framing.REFRAME or self.hold is not None or tr.state != SIZE or tr.held:
                self.fast = False
                return
            # both sides stand between chunks: the upstream's own pass as they are again
            self.mode, self._write = framing.PASS, self.client.transport.write
        sc, tr = self.scanner, self.tracker
        self.fast = (
            self.hold is None
            and self.outcome is None
            and isinstance(sc, SseScanner)
            and sc.content_events > 0
            and not sc.pending
            and tr.state == SIZE
            and not tr.held
        )

    def _upstream_failed(self, outcome: str) -> None:
        """The upstream broke the body: the client sees the truncation (no clean end). While
        held, only comments reached the client: the caller answers or tries another upstream."""
        self.client_keep_alive = False
        self._end(outcome)

    # ---- stall guard -----------------------------------------------------------------
    def _arm(self) -> None:
        self.timer = self.deadlines.add(
            self.policy.next_check(self.head_at, self.last_read), self._check_stall
        )

    def _check_stall(self) -> None:
        self.timer = None
        if self.outcome is not None:
            return
        now = self.loop.time()
        flow = self.flow
        if flow is not None and flow.paused:  # the client is the slow side: reads are not owed
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
        hold = self.hold
        if hold is not None:
            if hold.more or hold.swallow:  # only comments reached the client: the next
                self._end(STALL)  # upstream, or an in-band error
                return
            self._release_hold()
        if not self.sse:  # non-SSE bodies are cut: nothing injected
            self.client_keep_alive = False
        else:
            payload = (
                b""
                if self.scanner.done_seen
                else stall_frame(
                    self.path,
                    self.model,
                    reason,
                    self.stall_elapsed,
                    self.upstream_name,
                    int(time.time()),
                )
            )
            tail, delimited = framing.closing_bytes(self.kind, self.mode, self.tracker, payload)
            self.client_keep_alive &= delimited
            if tail:
                self.bytes_out += len(tail)
                self.client.transport.write(tail)
        self._end(STALL)

    # ---- flow control (client transport) -------------------------------------------
    def client_paused(self) -> None:
        if self.flow is None:
            self.flow = ClientFlow(self.loop, self.write_timeout_s, self._write_stuck)
        self.flow.pause(self.conn.transport if self.outcome is None else None)

    def client_resumed(self) -> None:
        self.last_read = self.loop.time()
        if self.flow is not None:
            self.flow.resume(self.conn.transport if self.outcome is None else None)

    def _write_stuck(self) -> None:
        if self.outcome is None:
            self.conn.abort()
            self.client_keep_alive = False
            self._end(CLIENT_SLOW)

    def _head_failed(self, exc: BaseException) -> bool:
        """The head will not come: the dispatcher's wait ends with `exc` (if it still waits)."""
        fut = self.head_fut
        if fut is None or fut.done():
            return False
        fut.set_exception(exc)
        return True

    def head_timeout(self) -> None:
        if self._head_failed(TimeoutError()):
            self.head_reader = None

    def client_gone(self) -> None:
        """The client closed or reset: close the upstream socket at once."""
        self.conn.abort()
        self.client_keep_alive = False
        if self._head_failed(ClientGone()):
            self.head_reader = None
        if self.outcome is None and self.head_at:
            self._end(CLIENT_GONE)

    def shutdown(self) -> None:
        if self.outcome is not None:
            return
        self.conn.abort()
        if self.head_at:
            self._upstream_failed(SHUTDOWN)
        elif self._head_failed(RelayShutdown()):
            self.head_reader = None

    # ---- the one way out ---------------------------------------------------------------
    def _end(self, outcome: str) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.fast = False
        if self.timer is not None:
            self.deadlines.cancel(self.timer)
            self.timer = None
        flow = self.flow
        if flow is not None:
            flow.cancel()
        hold = self.hold
        if hold is not None:  # ended before content: the hold says what the client gets
            self.hold = None
            hold.on_commit = None
            if outcome == DONE:
                hold.finish()
        elif outcome == DONE and self.mode == framing.REFRAME:
            self.client.transport.write(LAST_CHUNK)
        if self.conn.handler is self:
            self.conn.handler = None
        transport = self.conn.transport
        if transport is not None and transport.get_protocol() is self:
            transport.set_protocol(self.conn)
        # (the bound method held on itself is a reference cycle: without it the exchange, and
        # the client connection and transports it reaches, are freed at once, not by the
        # cyclic collector; issue 15)
        self.data_received = _ended_data
        if flow is not None:
            flow.on_stuck = _ended_data
        if isinstance(self.scanner, SseScanner):
            self.scanner.on_first_content = None  # (a bound method of this exchange too)
        if flow is not None and flow.paused and self.conn.transport is not None:
            self.conn.transport.resume_reading()
        if not self.done.done():
            self.done.set_result(outcome)
        self._resolve_open()

    @property
    def reusable(self) -> bool:
        return (
            self.outcome == DONE and self.upstream_keep_alive and self.kind != framing.UNTIL_CLOSE
        )

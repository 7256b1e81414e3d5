"""One request on one upstream connection: wait for the head, then relay the body.

This is the hot path. Upstream bytes go to the client transport unchanged as they arrive
(chunked framing passed through raw while `ChunkTracker` follows it); the SSE scanner watches
the payload in passing; the stall guard is one deadline (`stream.deadlines`: one loop timer
for every stream) re-armed lazily from the last read time. What the exchange holds, its
output and its one way out, `_end(outcome)`, are `proxy.exchange_state`'s.
"""

from __future__ import annotations

import time
from time import perf_counter as _perf

from relay.http import response_framing as framing
from relay.http.chunked import LAST_CHUNK, ChunkError, ChunkTracker, frame
from relay.http.response_head import BadHead, HeadReader, ResponseHead
from relay.proxy.exchange_state import ExchangeState
from relay.stream import dialect
from relay.stream.client_flow import ClientFlow
from relay.stream.endings import (
    BAD_FRAMING,
    CLIENT_GONE,
    CLIENT_SLOW,
    DONE,
    DROPPED,
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
from relay.stream.terminal import stall_frame
from relay.stream.usage import JsonBody


class Exchange(ExchangeState):
    """Reads the upstream: its head (handed to the dispatcher), then the body, relayed as it
    comes; the stall guard, client flow control and the other ways an exchange is cut."""

    __slots__ = ()

    # ---- upstream callbacks (UpstreamConn) -----------------------------------------
    def upstream_data(self, data: bytes) -> None:
        if not self.body_started:
            self.read_at = _perf()  # (a first content event may come with the head)
            if self.head_reader is not None:
                self._head_data(self.head_reader, data)
            else:  # head parsed, body not started yet: keep for start_body
                self._leftover += data
            return
        self.last_read = self.loop.time()  # (the deadlines' clock)
        now = _perf()  # when the bytes were read, to the microsecond (`stream.itl`)
        if self.fast:  # the usual read, whole token events: see `stream.fastpath`
            shape = self.shape
            n = events_in(data, shape) if shape is not None else 0
            if n or (n := self._token_read(data)):
                sc, gp = self.scanner, self.gaps  # (`fast`: an SSE stream has both)
                assert sc is not None and gp is not None
                sc.content_events += n
                g = now - gp.last  # one inter-token gap (`stream.itl`)
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
        gp, sc = self.gaps, self.scanner
        self.read_at = now  # (TTFT: the read holding the first content event, as `gaps`)
        if gp is None or sc is None:  # (an SSE stream has both)
            self._body_read(data)
            return
        before = sc.content_events
        self._body_read(data)
        if sc.content_events != before:
            gp.events(now, before, sc.content_events)

    def _body_read(self, data: bytes) -> None:
        """Any read the fast path did not take: chunk tracker, scanner, then forward."""
        kind = self.kind
        if kind == framing.CHUNKED:
            tracker = self.tracker
            assert tracker is not None  # (made with the chunked kind: `start_body`)
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
    def _head_data(self, reader: HeadReader, data: bytes) -> None:
        self.got_bytes = True
        try:
            parsed = reader.feed(data)
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
        more = self.hold is not None and self.hold.more  # (the hold is the request's till now)
        if not (more and (status == 429 or status >= 500)):
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
        assert hold is not None  # (the request's, until the first content event is out)
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
        except framing.FramingError:  # (`response_head` refuses these first) nothing is sent
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
            self.scanner = SseScanner(self._first_content, dialect.from_path(self.path))
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
            self._release_hold(hold)  # (still the request's: self.hold is hold)
        if self.outcome is None:
            self._arm()  # (after the first write: it is not in the client's wait)
        if self._closed_early:
            self.upstream_closed(None)

    def _commit_early(self) -> None:
        """A heartbeat is due while this upstream's head and events are held."""
        hold, resp = self.hold, self.head_resp
        assert hold is not None and resp is not None  # (armed by start_body, while held)
        held, sent = hold.commit_upstream(resp, self.kind, self.mode)
        self.mode = framing.committed_carriage(self.kind, self.client.http11)
        self.client_keep_alive = self.client.wants_keep_alive and self.client.http11
        self.bytes_out -= sent  # counted again, as payload
        if held:
            self._emit(held)

    # ---- body ----------------------------------------------------------------------
    def _first_content(self) -> None:
        # the held head goes out with this read (_emit: one write), then the metrics hear; its
        # time is the read's, as every event of it (`stream.itl`): TTFT <= the last content
        self.first_content_at = self.read_at

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
            self._release_hold(hold)
        if not self.sse:  # non-SSE bodies are cut: nothing injected
            self.client_keep_alive = False
        else:
            sc = self.scanner
            payload = stall_frame(  # b"" after the stream's own end
                sc if isinstance(sc, SseScanner) else None,
                dialect.from_path(self.path),
                self.model,
                reason,
                self.stall_elapsed,
                self.upstream_name,
                int(time.time()),
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
        """The client closed or reset: close the upstream socket at once. A client that
        leaves once the stream's own end event reached it ([DONE], message_stop,
        response.completed: SDKs stop reading there) had the whole response: done."""
        self.conn.abort()
        self.client_keep_alive = False
        if self._head_failed(ClientGone()):
            self.head_reader = None
        if self.outcome is None and self.head_at:
            sc = self.scanner
            self.whole = self.hold is None and isinstance(sc, SseScanner) and sc.done_seen
            self._end(DONE if self.whole else CLIENT_GONE)

    def shutdown(self) -> None:
        if self.outcome is not None:
            return
        self.conn.abort()
        if self.head_at:
            self._upstream_failed(SHUTDOWN)
        elif self._head_failed(RelayShutdown()):
            self.head_reader = None

"""What one exchange with an upstream holds, how its bytes reach the client, and its one way
out.

`ExchangeState` is the half of `Exchange` (`proxy.exchange`) that does not read from the
upstream: the fields every phase shares, the output (through the request's hold until the
first content event, then straight to the client transport), and `_end(outcome)`, which
every way out goes through exactly once and which resolves `done`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from relay.http import response_framing as framing
from relay.http.chunked import LAST_CHUNK, SIZE, ChunkTracker, frame
from relay.http.response_head import HeadReader, ResponseHead
from relay.stream.client_flow import ClientFlow
from relay.stream.content_hold import ERROR, OPENED, Hold
from relay.stream.deadlines import Deadlines
from relay.stream.endings import DONE, ERROR_EVENT
from relay.stream.fastpath import Shape
from relay.stream.itl import Gaps
from relay.stream.sse import SseScanner
from relay.stream.stall import StallPolicy
from relay.stream.usage import JsonBody


def _ended_data(*_) -> None:
    """What an ended exchange leaves where its own bound methods were (its data_received: the
    transport reads into its UpstreamConn again; its flow's on_stuck)."""


class ExchangeState:
    # Slots: over 40 fields is past what a shared-key instance dict holds, and the body
    # path reads several per event.
    # fmt: off
    __slots__ = (
        "_closed_early", "_leftover", "_write", "body_copy", "body_started", "bytes_out", "client",
        "client_keep_alive", "conn", "counted", "data_received", "deadlines", "done", "fast",
        "first_content_at", "flow", "gaps", "got_bytes", "head_at", "head_fut", "head_reader",
        "head_resp", "hold", "kind", "last_read", "loop", "method", "mode", "model", "on_content",
        "open_fut", "outcome", "path", "policy", "read_at", "remaining", "request_id", "scanner", "shape",
        "sse", "stall_elapsed", "stall_reason", "status", "timer", "tracker",
        "upstream_keep_alive", "upstream_name", "whole", "write_timeout_s",
    )
    # fmt: on

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
        self.scanner: SseScanner | JsonBody | None = None  # what reads the body in passing
        self.sse = False
        self.upstream_keep_alive = False
        self.client_keep_alive = False
        # the request's hold until the first content event is out (stream.content_hold), then None
        self.hold: Hold | None = hold
        self.head_at = 0.0
        self.last_read = 0.0
        self.read_at = 0.0  # perf_counter of the read being handled (first content's time)
        self.first_content_at: float | None = None
        self.gaps: Gaps | None = None  # SSE: gaps between content events (stream.itl)
        self.bytes_out = 0
        self.outcome: str | None = None
        self.whole = False  # the client left once the stream's own end event reached it
        self.stall_reason: str | None = None
        self.stall_elapsed = 0.0
        self.timer: int | None = None  # the stall guard's deadline in `deadlines`
        self.counted = 0  # tokens already added to the upstream's rate window
        self.fast = False  # the next read may be recognised by the fast path (fastpath.py)
        self.shape: Shape | None = (
            None  # this stream's token events up to their text (fastpath.learn)
        )
        self.on_content: Callable[[ExchangeState], object] | None = (
            None  # called once the first content event is written (metrics)
        )
        self.body_copy: JsonBody | None = None
        # While the body flows the exchange is the upstream transport's protocol itself, and
        # its data_received is upstream_data: no hop (uvloop binds it at set_protocol time).
        self.data_received: Callable[[bytes], None] = self.upstream_data

    def upstream_data(self, data: bytes) -> None:
        """The upstream's bytes: read by `Exchange` (the head, then the body)."""
        raise NotImplementedError

    # ---- output ----------------------------------------------------------------------
    def _release_hold(self, hold: Hold) -> None:
        """Write what `hold` (this exchange's, still held) keeps: from here the client is open."""
        hold.release()
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
            hold = self.hold
            if hold is None:
                self._write(out)
            else:
                self._held(hold, out)
        if self.on_content is not None and self.first_content_at is not None:
            report, self.on_content = self.on_content, None
            report(self)

    def _held(self, hold: Hold, out: bytes) -> None:
        sc = self.scanner
        if isinstance(sc, SseScanner):
            hold.dialect = sc.dialect  # (what the stream's events say it speaks)
        took = hold.take(out, self.first_content_at is not None, sc is not None and sc.error_first)
        if took == OPENED:
            self._opened()
        elif took == ERROR:  # an {"error": ...} first event: the next upstream, or in-band
            self.conn.abort()
            self._end(ERROR_EVENT)

    def _check_fast(self) -> None:
        """Whether the next read may take the fast path: streaming, between chunks and events."""
        if self.mode != framing.PASS:
            tr = self.tracker
            if (
                self.mode != framing.REFRAME
                or self.hold is not None
                or tr is None
                or tr.state != SIZE
                or tr.held
            ):
                self.fast = False
                return
            # both sides stand between chunks: the upstream's own pass as they are again
            self.mode, self._write = framing.PASS, self.client.transport.write
        sc, tr = self.scanner, self.tracker
        self.fast = (
            self.hold is None
            and self.outcome is None
            and isinstance(sc, SseScanner)
            and sc.shortcut
            and sc.content_events > 0
            and not sc.pending
            and tr is not None
            and tr.state == SIZE
            and not tr.held
        )

    def _upstream_failed(self, outcome: str) -> None:
        """The upstream broke the body: the client sees the truncation (no clean end). While
        held, only comments reached the client: the caller answers or tries another upstream."""
        self.client_keep_alive = False
        self._end(outcome)

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
        # cyclic collector)
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

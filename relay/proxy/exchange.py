"""One request on one upstream connection: wait for the head, then relay the body.

This is the hot path. While the body flows the exchange is the upstream transport's protocol
itself (uvloop binds `data_received` at set_protocol time: no hop). Each read goes to the
body's reader (`http.body`, chosen once from the head), its payloads to the observer
(`stream.observer`: scanner, gaps, usage, first and last content), and its bytes to the
client: through the request's reply while the hold keeps them (`proxy.reply`), then through
the connection's writer (`proxy.client_writer`), unchanged but for the framing the client's
side needs. The usual read, whole chunks of whole token events, is recognised in one go
(`Observer.fast`) and written as it came. The stall guard (`proxy.stall_guard`) is one
deadline among every stream's.

Every way out goes through `_end(ending)`, exactly once: it resolves `done` and freezes what
the exchange came to in its `summary` (`stream.summary.ExchangeSummary`), which settlement
reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from time import perf_counter as _perf

import msgspec

from relay.errors import Outcome
from relay.http import response_framing as framing
from relay.http.body import BodyReader, ChunkError, reader_for
from relay.http.response_framing import EMPTY, PASS, REFRAME, UNTIL_CLOSE, Carriage
from relay.http.response_head import BadHead, HeadReader, ResponseHead, parse_response_head
from relay.http.to_client import server_timing
from relay.observe.metrics import UpstreamMetrics
from relay.proxy.client_flow import ClientFlow
from relay.proxy.client_writer import ClientWriter
from relay.proxy.deadlines import Deadlines, Due
from relay.proxy.pool import UpstreamConn
from relay.proxy.reply import Reply
from relay.proxy.request import Request
from relay.proxy.stall_guard import StallGuard
from relay.stream import dialect
from relay.stream.content_hold import ERROR, WRITTEN
from relay.stream.dialect import Api
from relay.stream.observer import Observer
from relay.stream.stall import Stall, StallPolicy, StallReason
from relay.stream.summary import ExchangeSummary
from relay.stream.terminal import stall_frame
from relay.stream.usage import exact_usage

DONE = Outcome.DONE


class Relaying(msgspec.Struct, frozen=True, gc=False):
    """What every exchange of the relay shares: its loop, the stall guards' deadlines and
    rule, and how long a client may take a write."""

    loop: asyncio.AbstractEventLoop
    deadlines: Deadlines
    policy: StallPolicy
    write_timeout_s: float


class Hop(msgspec.Struct, frozen=True):
    """One candidate's part of a request: the upstream's name, the public model name (a
    stall frame's), whether another candidate is left (a failure before content may then
    quietly move on), the upstream's figures, which hear the time to the first content event
    once it is written, and when the dispatcher took the request (`since`, perf_counter), for
    that time and the client head's `Server-Timing`, with the ms this candidate's slot was
    waited for (`queue_ms`). (Fields, not a closure: a stream keeps its hop.)"""

    upstream: str
    model: str
    more: bool
    metrics: UpstreamMetrics | None = None
    since: float = 0.0
    queue_ms: float = 0.0


# The ways the wait for an upstream's head can end other than with the head.
class UpstreamGone(Exception):
    """The upstream closed before a whole response head; `silent` if not one byte came."""

    def __init__(self, silent: bool) -> None:
        super().__init__("upstream closed the connection before a response head")
        self.silent = silent


class UpstreamBadHead(Exception):
    """The upstream's head is malformed (`http.response_head.BadHead` says why)."""


class ClientGone(Exception):
    """The client left while its request waited for the upstream's head."""


class RelayShutdown(Exception):
    """The relay stopped while this request still waited for its upstream head."""


def _ended(*_: object) -> None:
    """What an ended exchange leaves where its own bound methods were (its data_received:
    the transport reads into its UpstreamConn again; its flow's on_stuck): nothing of the
    exchange is kept alive by them."""


class Exchange(asyncio.BaseProtocol, Due):
    """Reads the upstream: its head (handed to the dispatcher), then the body, relayed as it
    comes; the stall guard, client flow control and the other ways an exchange is cut. Its
    own deadline (`Due`) is the wait for the head (`fire`, armed by `attempt`)."""

    # Slots: the body path reads several fields per event, and an exchange lives as long as
    # its stream.
    __slots__ = (
        "_closed_early",
        "_leftover",
        "body_started",
        "carriage",
        "client_keep_alive",
        "conn",
        "counted",
        "data_received",
        "discard",
        "done",
        "ending",
        "fast",
        "flow",
        "got_bytes",
        "guard",
        "head_at",
        "head_fut",
        "head_raw",
        "head_reader",
        "head_resp",
        "hop",
        "http11",
        "keep_alive",
        "loop",
        "method",
        "observer",
        "on_content",
        "past_hold_fut",
        "path",
        "reader",
        "reply",
        "sent_at",
        "stall",
        "status",
        "summary",
        "upstream_keep_alive",
        "whole",
        "write_timeout_s",
        "writer",
    )

    def __init__(
        self, relaying: Relaying, conn: UpstreamConn, request: Request, reply: Reply, hop: Hop
    ) -> None:
        loop = self.loop = relaying.loop
        self.conn = conn
        # Of the request, only what its response's framing and a stall frame need: it is not
        # kept for the stream (its body, the prompt, may be large).
        self.method, self.path = request.method, request.path
        self.http11, self.keep_alive = request.http11, request.keep_alive
        self.hop = hop
        # Told once the first content event's time, once it is written.
        self.on_content = hop.metrics
        self.write_timeout_s = relaying.write_timeout_s
        # The request's reply while the hold keeps what this exchange would write; None once
        # the first content event is out (then `writer`).
        self.reply: Reply | None = reply
        self.writer: ClientWriter = reply.writer
        self.guard = StallGuard(loop, relaying.deadlines, relaying.policy, self)
        # Made the first time the client falls behind.
        self.flow: ClientFlow | None = None
        # The head, as it comes: resolved once it is in (the dispatcher waits for it; None
        # once it has seen it), and the parsed head until the body starts; then, while the
        # hold keeps it, only its bytes (a heartbeat may still commit with it).
        self.head_reader: HeadReader | None = HeadReader()
        self.head_fut: asyncio.Future[None] | None = loop.create_future()
        self.head_resp: ResponseHead | None = None
        # When the request was written upstream (set by its writer, `attempt`) and when its
        # head was read (perf_counter): the client head's `Server-Timing`; 0: not yet.
        self.sent_at = 0.0
        self.head_at = 0.0
        self.head_raw = b""
        self.deadline = None
        self.got_bytes = False
        self.body_started = False
        self._leftover = b""
        self._closed_early = False
        # Set from the head: the status, the body's reader and carriage, what reads it.
        self.status = 0
        self.reader: BodyReader | None = None
        self.carriage: Carriage = PASS
        self.observer: Observer | None = None
        self.upstream_keep_alive = False
        self.client_keep_alive = False
        # The hold committed (heartbeats) but this response cannot continue it (not a 2xx
        # event stream): its body is read, never written; the dispatcher answers in-band.
        self.discard = False
        # The observer while the next read may be recognised by the fast path
        # (`Observer.fast`), else None.
        self.fast: Observer | None = None
        self.done: asyncio.Future[None] = loop.create_future()
        self.past_hold_fut: asyncio.Future[None] | None = None
        self.ending: Outcome | None = None
        self.summary: ExchangeSummary | None = None
        # The client left once the stream's own end event reached it.
        self.whole = False
        self.stall: Stall | None = None
        # Tokens already added to the upstream's rate window (`new_tokens`).
        self.counted = 0
        self.data_received: Callable[[bytes], None] = self.upstream_data

    # ---- upstream callbacks (UpstreamConn) -----------------------------------------
    def upstream_data(self, data: bytes) -> None:
        if not self.body_started:
            if self.head_reader is not None:
                self._head_data(self.head_reader, data)
            else:
                # The head is parsed, the body not started yet: kept for start_body.
                self._leftover += data
            return
        self.guard.last_read = self.loop.time()
        # When the bytes were read, to the microsecond (`stream.itl`).
        now = _perf()
        obs = self.fast
        if obs is not None and obs.fast(data, now):
            self.writer.relay(data)
            return
        self._body_read(data, now)

    def _body_read(self, data: bytes, now: float) -> None:
        """Any read the fast path did not take: the reader, the observer, then out."""
        reader, obs = self.reader, self.observer
        assert reader is not None and obs is not None
        try:
            wire, spans, whole, chunks = reader.read(data)
        except ChunkError:
            self._upstream_failed(Outcome.UPSTREAM_BAD_FRAMING)
            return
        obs.scan(wire, spans, now, chunks)
        self._emit(wire if self.carriage is PASS else reader.payload(wire, spans))
        if self.ending is not None:
            # What it emitted ended it (an error first event): nothing more is its to write.
            return
        if whole:
            self.upstream_keep_alive &= reader.reusable
            self._end(DONE)
        else:
            self._check_fast()

    def upstream_closed(self, exc: BaseException | None) -> None:
        if self.head_reader is not None:
            self._head_failed(UpstreamGone(silent=not self.got_bytes))
            self.head_reader = None
            return
        if not self.body_started:
            self._closed_early = True
            return
        if self.ending is not None:
            return
        reader = self.reader
        if reader is not None and reader.eof():
            self.upstream_keep_alive = False
            self._end(DONE)
        else:
            self._upstream_failed(Outcome.UPSTREAM_DROPPED)

    def eof_received(self) -> bool | None:
        return self.conn.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.connection_lost(exc)

    def pause_writing(self) -> None:
        """Towards the upstream a request is one write: nothing to pause."""

    def resume_writing(self) -> None:
        """As pause_writing."""

    # ---- head ----------------------------------------------------------------------
    def _head_data(self, reader: HeadReader, data: bytes) -> None:
        self.got_bytes = True
        try:
            parsed = reader.feed(data)
        except BadHead as exc:
            self.head_reader = None
            # Read no more of it: an endless head would pile up meanwhile.
            self.conn.abort()
            self._head_failed(UpstreamBadHead(str(exc)))
            return
        if parsed is None:
            return
        resp, self._leftover = parsed
        self.head_at = _perf()
        self.head_reader = None
        self.guard.head_in(self.loop.time())
        self.head_resp = resp
        fut = self.head_fut
        if fut is None or fut.done():
            return
        status = resp.status_code
        if not (self.hop.more and (status == 429 or status >= 500)):
            # At once: from here the dispatcher only awaits `done`.
            self.start_body(resp)
        fut.set_result(None)

    def start_body(self, resp: ResponseHead) -> None:
        """Decide framing, hold (or write) the head, and relay what came with it."""
        if self.ending is not None:
            return
        self.body_started = True
        transport = self.conn.transport
        if transport is not None and not transport.is_closing():
            transport.set_protocol(self)
        reply = self.reply
        assert reply is not None
        self.status = resp.status_code
        try:
            p = framing.plan(
                self.method,
                self.status,
                resp.http_version,
                resp.headers,
                self.http11,
                self.keep_alive,
                reply.committed,
            )
        except framing.FramingError:
            # (`response_head` refuses these first.) Nothing is sent.
            self.conn.abort()
            self._upstream_failed(Outcome.UPSTREAM_BAD_FRAMING)
            return
        self.reader = reader_for(p.kind, p.remaining)
        self.carriage = p.mode
        self.upstream_keep_alive, self.client_keep_alive = (
            p.upstream_keep_alive,
            p.client_keep_alive,
        )
        self._hold_head(reply, resp, p)
        self.observer = self._observer(p)
        if p.kind is EMPTY:
            # Bytes after a head with no body: the upstream is out of step, not reused.
            self.upstream_keep_alive &= not self._leftover
            self._end(DONE)
            return
        leftover, self._leftover = self._leftover, b""
        if leftover:
            # Read with the head: its events are timed at that read.
            self.guard.last_read = self.loop.time()
            self._body_read(leftover, self.head_at)
        if not p.holdable and self.reply is not None and not reply.committed:
            self._release(reply)
        if self.ending is None:
            # After the first write: it is not in the client's wait.
            self.guard.arm()
        if self._closed_early:
            self.upstream_closed(None)

    def _hold_head(self, reply: Reply, resp: ResponseHead, p: framing.Plan) -> None:
        """What the client's head will be, kept by the reply until the first content event;
        or, when the reply already committed a head (heartbeats), whether this body can
        continue it."""
        if reply.committed:
            self.discard = not p.holdable
            return
        head = reply.hold.client_head(
            resp, framing.client_chunked(p.kind, p.mode), self.client_keep_alive
        )
        if not self.sent_at:
            # (Tests that drive an exchange by hand write no request.)
            stamp = None
        else:
            stamp = self._timing if p.holdable else self._timing_unheld
        reply.hold_head(head, framing.relay_frames(p.mode), self if p.holdable else None, stamp)
        if p.holdable:
            # The first content event may be long in coming (a long prompt): its parsed fields
            # are not kept meanwhile, a tenth of what such a stream holds.
            self.head_resp, self.head_raw = None, resp.raw

    def _timing(self) -> bytes:
        """The relay's `Server-Timing` line, made as the client's head goes out: the hold
        ends at the read holding the first content event, or now (a heartbeat commits the
        head, or the body ended first)."""
        obs = self.observer
        first = obs.first_content_at if obs is not None else None
        return self._timing_to(first if first is not None else _perf())

    def _timing_unheld(self) -> bytes:
        """The same for a head that goes out with the read that brought it (nothing is held
        for a body that is no event stream)."""
        return self._timing_to(self.head_at)

    def _timing_to(self, out: float) -> bytes:
        hop, sent, head = self.hop, self.sent_at, self.head_at
        relay_ms = max(0.0, (sent - hop.since) * 1000 - hop.queue_ms)
        return server_timing(relay_ms, hop.queue_ms, (head - sent) * 1000, (out - head) * 1000)

    def _observer(self, p: framing.Plan) -> Observer:
        """What reads the body in passing: the SSE scanner for an event stream, a bounded
        copy of a whole JSON body (its usage), nothing for another."""
        if p.sse:
            return Observer(dialect.from_path(self.path))
        return Observer(json=p.json)

    def commit_early(self) -> None:
        """A heartbeat is due while this upstream's head and pieces are held: commit with the
        head, re-framed as the relay's chunks, and go on as a committed response."""
        reply, reader = self.reply, self.reader
        parsed = parse_response_head(self.head_raw)
        assert reply is not None and parsed is not None and reader is not None
        self.head_raw = b""
        held = reply.commit_upstream(parsed[0], reader.kind, self.carriage)
        self.carriage = framing.committed_carriage(reader.kind, self.http11)
        self.client_keep_alive = self.keep_alive and self.http11
        if held:
            self._emit(held)

    # ---- output ----------------------------------------------------------------------
    def _emit(self, piece: bytes) -> None:
        if piece:
            reply = self.reply
            if reply is None:
                self.writer.body(piece)
            elif not self.discard:
                self._held(reply, piece)
            elif self.observer is not None and self.observer.error_first:
                # A body that cannot continue the committed response, whose first event is an
                # error: the next upstream serves, or the error is told in-band.
                self.conn.abort()
                self._end(Outcome.UPSTREAM_ERROR_EVENT)
        metrics = self.on_content
        if metrics is not None:
            obs = self.observer
            at = obs.first_content_at if obs is not None else None
            if at is not None:
                self.on_content = None
                metrics.observe_ttft(at - self.hop.since, time.monotonic())

    def _held(self, reply: Reply, piece: bytes) -> None:
        obs = self.observer
        assert obs is not None
        sc = obs.scanner
        error_first = sc is not None and sc.error_first
        took = reply.take(piece, obs.first_content_at is not None, error_first, self.hop.more)
        if took is WRITTEN:
            self._write_directly()
        elif took is ERROR:
            # An error first event: the next upstream serves, or the error is told in-band.
            self.conn.abort()
            self._end(Outcome.UPSTREAM_ERROR_EVENT)

    def _release(self, reply: Reply) -> None:
        """What the reply holds of this exchange goes out: the client is open from here."""
        reply.release()
        self._write_directly()

    def past_hold(self) -> asyncio.Future[None]:
        """A future resolved once the hold is over for this exchange (content reached the
        client: nothing is swapped any more) or the exchange ended, whichever comes first."""
        fut = self.past_hold_fut = self.loop.create_future()
        if self.reply is None or self.ending is not None:
            self._resolve_past_hold()
        return fut

    def _resolve_past_hold(self) -> None:
        fut, self.past_hold_fut = self.past_hold_fut, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _write_directly(self) -> None:
        """The hold is over: from here the exchange writes to the client itself."""
        reply, self.reply = self.reply, None
        if reply is not None:
            reply.detach(self)
        # Its headers were written: not kept for the stream.
        self.head_resp, self.head_raw = None, b""
        self._resolve_past_hold()

    def _check_fast(self) -> None:
        """Whether the next read may take the fast path: streaming, between chunks and events."""
        reader = self.reader
        if self.carriage is not PASS:
            if (
                self.carriage is not REFRAME
                or self.reply is not None
                or reader is None
                or not reader.between_chunks
            ):
                self.fast = None
                return
            # Both sides stand between chunks: the upstream's own pass as they are again.
            self.carriage = PASS
            self.writer.pass_upstream_chunks()
        obs = self.observer
        sc = obs.scanner if obs is not None else None
        self.fast = (
            obs
            if (
                self.reply is None
                and self.ending is None
                and sc is not None
                and sc.shortcut
                and sc.content_events > 0
                and not sc.pending
                and reader is not None
                and reader.between_chunks
            )
            else None
        )

    def _upstream_failed(self, ending: Outcome) -> None:
        """The upstream broke the body: the client sees the truncation (no clean end). While
        held, only comments reached the client: the caller answers or tries another upstream."""
        self.client_keep_alive = False
        self._end(ending)

    # ---- the one way out ---------------------------------------------------------------
    def _end(self, ending: Outcome) -> None:
        if self.ending is not None:
            return
        self.ending = ending
        self.fast = None
        self.guard.cancel()
        reply = self.reply
        if reply is not None:
            # Ended before content: the hold says what the client gets.
            self.reply = None
            reply.detach(self)
            if ending is DONE and not self.discard:
                reply.finish()
        elif ending is DONE:
            self.writer.end()
        self._unbind()
        try:
            self.summary = self._summary(ending)
        finally:
            # Whatever happened above, whoever waits for the end hears of it: a request
            # never strands with its slot and reservation.
            if not self.done.done():
                self.done.set_result(None)
            self._resolve_past_hold()

    def _unbind(self) -> None:
        """The upstream connection is its own protocol again, and nothing of this exchange is
        held by it or by a bound method of its own: the exchange, the client connection and
        the transports it reaches are freed at once, not by the cyclic collector."""
        conn = self.conn
        if conn.handler is self:
            conn.handler = None
        transport = conn.transport
        if transport is not None and transport.get_protocol() is self:
            transport.set_protocol(conn)
        self.data_received = _ended
        flow = self.flow
        if flow is not None:
            flow.cancel()
            flow.on_stuck = _ended
            if flow.paused and transport is not None:
                transport.resume_reading()

    def _summary(self, ending: Outcome) -> ExchangeSummary:
        obs = self.observer
        reader = self.reader
        reusable = (
            ending is DONE
            and self.upstream_keep_alive
            and (reader is None or reader.kind is not UNTIL_CLOSE)
        )
        name = self.hop.upstream
        if obs is None:
            api = dialect.from_path(self.path)
            return ExchangeSummary(name, ending, self.status, self.whole, reusable, False, api)
        sc, gaps = obs.scanner, obs.gaps
        body = obs.body
        doc = body.document() if body is not None else None
        if sc is not None:
            usage = obs.stream_usage()
            api = sc.dialect
        else:
            usage = exact_usage(doc) if doc is not None and ending is DONE else None
            api = dialect.from_path(self.path)
        return ExchangeSummary(
            name,
            ending,
            self.status,
            self.whole,
            reusable,
            sc is not None,
            api,
            first_content_at=obs.first_content_at,
            gaps=gaps,
            content_events=sc.content_events if sc is not None else None,
            error_only=sc is not None and sc.error_first and not sc.content_events,
            usage=usage,
            body=doc,
            meta_event=sc.meta if sc is not None else b"",
            stall=self.stall,
            counted=self.counted,
        )

    def new_tokens(self) -> int:
        """The content events counted since the last call, for the upstream's rate window
        while the stream runs (settlement adds the rest, `summary.counted`)."""
        obs = self.observer
        if self.ending is not None or obs is None:
            return 0
        n = obs.content_events - self.counted
        self.counted += n
        return n

    @property
    def api(self) -> Api:
        """The API the stream speaks: what its events said, else what its path says."""
        obs = self.observer
        sc = obs.scanner if obs is not None else None
        return sc.dialect if sc is not None else dialect.from_path(self.path)

    # ---- stall guard -----------------------------------------------------------------
    def trip(self, reason: StallReason, now: float) -> None:
        self.stall = Stall(reason, self.guard.elapsed(reason, now))
        self.conn.abort()
        reply = self.reply
        if reply is not None:
            if self.hop.more or self.discard:
                # Only comments reached the client: the next upstream, or an in-band error.
                self._end(Outcome.STALL)
                return
            self._release(reply)
        obs, reader = self.observer, self.reader
        scanner = obs.scanner if obs is not None else None
        if scanner is None or reader is None:
            # A body that is not an event stream is cut: nothing injected.
            self.client_keep_alive = False
        else:
            payload = stall_frame(
                scanner,
                dialect.from_path(self.path),
                self.hop.model,
                reason,
                self.stall.elapsed_s,
                self.hop.upstream,
                int(time.time()),
            )
            tail, delimited = framing.closing_bytes(
                reader.kind, self.carriage, reader.tracker, payload
            )
            self.client_keep_alive &= delimited
            self.writer.close_with(tail)
        self._end(Outcome.STALL)

    # ---- flow control (client transport) -------------------------------------------
    def client_paused(self) -> None:
        if self.flow is None:
            self.flow = ClientFlow(self.loop, self.write_timeout_s, self._write_stuck)
        self.guard.pause()
        self.flow.pause(self.conn.transport if self.ending is None else None)

    def client_resumed(self) -> None:
        self.guard.resume(self.loop.time())
        if self.flow is not None:
            self.flow.resume(self.conn.transport if self.ending is None else None)

    def _write_stuck(self) -> None:
        if self.ending is None:
            self.conn.abort()
            self.client_keep_alive = False
            self._end(Outcome.CLIENT_WRITE_TIMEOUT)

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

    def fire(self) -> None:
        """The wait for the head is up (its deadline, set by `attempt`)."""
        self.head_timeout()

    def client_gone(self) -> None:
        """The client closed or reset: close the upstream socket at once. A client that
        leaves once the stream's own end event reached it ([DONE], message_stop,
        response.completed: SDKs stop reading there) had the whole response: done."""
        self.conn.abort()
        self.client_keep_alive = False
        if self._head_failed(ClientGone()):
            self.head_reader = None
        if self.ending is None and self.guard.head_seen:
            obs = self.observer
            sc = obs.scanner if obs is not None else None
            self.whole = self.reply is None and sc is not None and sc.done_seen
            self._end(DONE if self.whole else Outcome.CLIENT_CLOSED)

    def shutdown(self) -> None:
        """The relay's drain cuts this exchange (waiting for its head, or relaying)."""
        if self.ending is not None:
            return
        self.conn.abort()
        if self.guard.head_seen:
            self._upstream_failed(Outcome.SHUTDOWN)
        elif self._head_failed(RelayShutdown()):
            self.head_reader = None
            self._end(Outcome.SHUTDOWN)

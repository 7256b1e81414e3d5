"""What one relayed response body says, read in passing: the stream's observation in one
object.

An event stream is read by the SSE scanner (`sse`: content events, its API, its end, an error
first, the events with usage or timings) and its content events' gaps are kept (`itl`); a
whole JSON body is kept, bounded, to read its usage once it ended (`usage.JsonBody`); any
other body is not read. The observer stamps the first content event's read (TTFT) and the
last one's (`gaps.last`), and learns the stream's token events (`fastpath`) so that the usual
read is counted in one go (`fast`). It never changes a byte and writes nothing: the exchange
(relay.proxy.exchange) hands it each read and its time, one `perf_counter` reading per read.
"""

from __future__ import annotations

from relay.stream.dialect import Api
from relay.stream.fastpath import Shape, events_in, learn
from relay.stream.itl import Gaps
from relay.stream.sse import SseScanner
from relay.stream.usage import JsonBody, Usage, stream_usage


class Observer:
    __slots__ = ("body", "first_content_at", "gaps", "scanner", "shape")

    def __init__(self, api: Api | None = None, json: bool = False) -> None:
        """An event stream's observer (`api`: its API as guessed until its events say), a
        whole JSON body's (`json`: kept, bounded, for its usage), or one reading nothing."""
        # An event stream's scanner and gaps between content events (made at its first
        # content event: a stream that waits for it holds none); a JSON body's copy.
        self.scanner: SseScanner | None = None
        self.gaps: Gaps | None = None
        self.body: JsonBody | None = None
        if api is not None:
            self.scanner = SseScanner(dialect=api)
        elif json:
            self.body = JsonBody()
        # The perf_counter time of the read that held the first content event.
        self.first_content_at: float | None = None
        # This stream's token events up to their text, once learned (`fastpath.learn`).
        self.shape: Shape | None = None

    # ---- reads -----------------------------------------------------------------------
    def scan(self, wire: bytes, spans: list[int], now: float, chunks: bool = False) -> None:
        """The payloads `wire[spans[0]:spans[1]]`, ... of one read made at `now`; `chunks`:
        the read is whole chunks, one event each as a rule (read in place: `feed_span`)."""
        sc = self.scanner
        if sc is not None:
            before = sc.content_events
            if chunks:
                span = sc.feed_span
                for i in range(0, len(spans), 2):
                    span(wire, spans[i], spans[i + 1])
            elif len(spans) == 2 and not spans[0] and spans[1] == len(wire):
                sc.feed(wire)
            else:
                for i in range(0, len(spans), 2):
                    sc.feed(wire[spans[i] : spans[i + 1]])
            if sc.content_events != before:
                # Content the learned shape missed (another shape, a read cut mid-event): the
                # next fast read learns again (a miss alone, a stream's end, learns nothing).
                self.shape = None
                if not before:
                    # The first content event's time is its read's, as every event of that
                    # read's is (`stream.itl`): TTFT is never after the last content event.
                    self.first_content_at = now
                gaps = self.gaps
                if gaps is None:
                    gaps = self.gaps = Gaps()
                gaps.events(now, before, sc.content_events)
        elif self.body is not None:
            body = self.body
            for i in range(0, len(spans), 2):
                body.feed(wire[spans[i] : spans[i + 1]])

    def fast(self, data: bytes, now: float) -> int:
        """The token events of a read of whole chunks of whole token events (the usual read,
        `fastpath.events_in`), counted with their gaps; 0 when the read is anything else
        (then `scan` reads it). Called only once a content event went by. A shape is learned
        from a read while there is none: at the first fast read, and after `scan` counted
        content the shape missed; a read that only misses it (a usage or end event) is
        `scan`'s without a new lesson."""
        shape = self.shape
        if shape is not None:
            n = events_in(data, shape)
        else:
            n = self._learned(data)
        if not n:
            return 0
        sc, gp = self.scanner, self.gaps
        assert sc is not None and gp is not None
        sc.content_events += n
        # One inter-token gap; the other events of the read came with it: `Gaps.events`
        # after at least one event, written out (the call would be 5 % of a usual read).
        gp.add(now - gp.last)
        gp.last = now
        if n != 1:
            gp.zeros += n - 1
        return n

    def _learned(self, data: bytes) -> int:
        """The token events of a read while the stream has no shape, by a shape learned from
        the read itself (kept for the next reads then), or 0."""
        shape = learn(data)
        if shape is None:
            return 0
        n = events_in(data, shape)
        if n:
            self.shape = shape
        return n

    # ---- what it says ----------------------------------------------------------------
    @property
    def content_events(self) -> int:
        sc = self.scanner
        return sc.content_events if sc is not None else 0

    @property
    def error_first(self) -> bool:
        """The body's first event (or document) is an error."""
        sc = self.scanner
        return sc.error_first if sc is not None else False

    def stream_usage(self) -> Usage | None:
        """An event stream's exact figures, from its events with usage or timings."""
        sc = self.scanner
        if sc is None or not sc.meta:
            return None
        return stream_usage(sc.meta, sc.meta_first)

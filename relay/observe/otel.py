"""OpenTelemetry for the relay: one span per request and the GenAI metrics, over OTLP.

Imported only when OpenTelemetry is on (`otel_env.start`); it needs the `otel` extra.

- A request's span is started when the relay takes the request on (`begin`: its start is
  the request's, its parent the client's W3C `traceparent` when valid, else a new trace;
  `tracestate` is kept), so its ids are known before any upstream is contacted: the
  upstream gets a `traceparent` naming this span (and the `tracestate`), and joins the trace.
  A fallback is an event on it when it happens. Everything else is set from the row at
  settlement (`settled`), which ends the span with an explicit end time: settlement runs
  once per request on every exit path, so the span ends exactly once (the row's rule).
  Nothing is done per relayed event.
- Metric points are recorded at settlement from the row (`otel_attrs` names them); the
  slots and the queue are observed by the metric reader's thread.
- Export never blocks the event loop: spans go to the SDK's batch processor (a bounded
  queue, a worker thread), metrics to a periodic reader's thread. A span the queue has no
  room for, or one whose export failed (the collector down, too slow), is counted in
  `relay.otel.spans_dropped` as it is lost; at the stop, so is every span the collector has
  not acknowledged (still queued, or in an export that gets no answer in time), in the
  last point and the `otel_stopped` line. The SDK's own warnings become `otel_sdk` JSON
  lines, the same message at most once a minute.
- The stop waits for the last exports `SHUTDOWN_S` at most in all (`aclose`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable

from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from relay.http.fields import Headers, lower_names, values_of
from relay.observe import otel_attrs as A
from relay.observe.log import Log
from relay.observe.metrics import UpstreamMetrics
from relay.observe.otel_env import Settings
from relay.observe.otel_export import (
    CountingExporter,
    CountingProcessor,
    SpanTally,
    bridge,
    metric_exporter,
    sampler,
    span_exporter,
)
from relay.observe.record import Record

_PROPAGATOR = TraceContextTextMapPropagator()
# The most the relay's stop waits for the last exports, spans and metrics together.
SHUTDOWN_S = 5.0
# What is kept of it for the metrics' last export (which carries the final count of the spans
# lost) when the spans' take long: a collector that does not answer.
METRICS_SHARE_S = 1.0
_DEFAULT_BATCH = 512


class Trace:
    """One request's span, and the trace headers the upstream gets; `max_tokens` is
    `gen_ai.request.max_tokens`, when the body says."""

    __slots__ = ("headers", "max_tokens", "span")

    def __init__(self, span: Span, headers: Headers) -> None:
        self.span = span
        self.headers = headers
        self.max_tokens: int | None = None

    def fallback(self, upstream: str, next_upstream: str, reason: str) -> None:
        self.span.add_event(
            "relay.fallback",
            {
                "relay.upstream": upstream,
                "relay.fallback.next": next_upstream,
                "error.type": reason,
            },
        )


class Telemetry:
    """`upstreams` gives the UpstreamMetrics now: the metric reader's thread reads them."""

    def __init__(
        self, s: Settings, log: Log, upstreams: Callable[[], Iterable[UpstreamMetrics]]
    ) -> None:
        self.settings = s
        self.log = log
        self._upstreams = upstreams
        bridge.log = log
        resource = Resource.create(s.resource)
        self._tracer: Tracer | None = None
        self._traces: TracerProvider | None = None
        self._processor: CountingProcessor | None = None
        self._tally = SpanTally()
        self._closing: asyncio.Future[None] | None = None
        if s.traces:
            queue = s.bsp_max_queue_size
            self._processor = CountingProcessor(
                CountingExporter(span_exporter(s), self._tally),
                self._tally,
                max_queue_size=queue,
                schedule_delay_millis=s.bsp_schedule_delay_ms,
                max_export_batch_size=min(queue, _DEFAULT_BATCH) if queue else None,
            )
            self._traces = TracerProvider(
                resource=resource, sampler=sampler(s), shutdown_on_exit=False
            )
            self._traces.add_span_processor(self._processor)
            self._tracer = self._traces.get_tracer("relay")
        self._metrics: MeterProvider | None = None
        if s.metrics:
            reader = PeriodicExportingMetricReader(
                metric_exporter(s), export_interval_millis=s.metric_export_interval_ms
            )
            self._metrics = MeterProvider(
                resource=resource, metric_readers=[reader], shutdown_on_exit=False
            )
            self._instruments(self._metrics.get_meter("relay"))
        log.event(
            "otel_started",
            traces=s.traces,
            metrics=s.metrics,
            protocol=s.traces_protocol if s.traces else s.metrics_protocol,
            configured=s.configured,
        )

    def _instruments(self, m: Meter) -> None:
        h = m.create_histogram
        self._duration = h(
            "gen_ai.server.request.duration",
            unit="s",
            description="Generative AI server request duration such as time-to-last byte or "
            "last output token.",
            explicit_bucket_boundaries_advisory=A.DURATION_BUCKETS,
        )
        self._ttft = h(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=A.TTFT_BUCKETS,
        )
        self._tpot = h(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token generated after the first token for "
            "successful responses.",
            explicit_bucket_boundaries_advisory=A.TPOT_BUCKETS,
        )
        self._tokens = h(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used (charged).",
            explicit_bucket_boundaries_advisory=A.TOKEN_BUCKETS,
        )
        self._queue = h(
            "relay.queue.duration",
            unit="s",
            description="Time a request waited for one of its upstream's slots.",
            explicit_bucket_boundaries_advisory=A.QUEUE_BUCKETS,
        )
        self._stalls = m.create_counter(
            "relay.stall.trips", unit="{trip}", description="Streams the stall guard cut."
        )
        m.create_observable_gauge(
            "relay.slots.in_flight",
            [self._observe(lambda u: u.in_flight)],
            unit="{request}",
            description="Requests on the upstream now.",
        )
        m.create_observable_gauge(
            "relay.slots.parallel",
            [self._observe(lambda u: u.parallel)],
            unit="{slot}",
            description="The upstream's configured parallel slots.",
        )
        m.create_observable_gauge(
            "relay.queue.waiting",
            [self._observe(lambda u: u.queued)],
            unit="{request}",
            description="Requests waiting for one of the upstream's slots.",
        )
        m.create_observable_counter(
            "relay.otel.spans_dropped",
            [lambda _o: [Observation(self.spans_dropped)]],
            unit="{span}",
            description="Spans the collector did not acknowledge: no room in the queue, a "
            "failed export, or (at the stop) not exported yet.",
        )

    def _observe(
        self, figure: Callable[[UpstreamMetrics], int]
    ) -> Callable[[CallbackOptions], list[Observation]]:
        """A gauge's callback: `figure` of every upstream, in the metric reader's thread."""

        def callback(_options: CallbackOptions) -> list[Observation]:
            # A reload may swap the upstreams meanwhile: this reading is skipped then.
            try:
                ups = list(self._upstreams())
            except RuntimeError:
                return []
            return [Observation(figure(u), {"relay.upstream.name": u.name}) for u in ups]

        return callback

    @property
    def spans_dropped(self) -> int:
        """The spans lost: known lost while running, every one not acknowledged once stopped
        (`otel_export.SpanTally`)."""
        return self._tally.dropped

    # ---- one request ----------------------------------------------------------------------
    def begin(self, headers: Headers, rec: Record) -> Trace | None:
        """The request's span, started at its start (None: traces are off). More than one
        `traceparent` is invalid, W3C says: the span begins a new trace then."""
        if self._tracer is None:
            return None
        ctx: Context | None = None
        lows = lower_names(headers)
        parents = values_of(headers, lows, b"traceparent")
        if len(parents) == 1:
            carrier = {"traceparent": parents[0].decode("latin-1")}
            states = values_of(headers, lows, b"tracestate")
            if states:
                carrier["tracestate"] = b",".join(states).decode("latin-1")
            ctx = _PROPAGATOR.extract(carrier)
        span = self._tracer.start_span(
            "relay", context=ctx, kind=SpanKind.SERVER, start_time=int(rec.ts * 1e9)
        )
        sc = span.get_span_context()
        out = [(b"traceparent", b"00-%032x-%016x-%02x" % (sc.trace_id, sc.span_id, sc.trace_flags))]
        if sc.trace_state:
            out.append((b"tracestate", sc.trace_state.to_header().encode("latin-1")))
        return Trace(span, out)

    def settled(
        self,
        rec: Record,
        trace: Trace | None,
        upstream: str | None = None,
        server: tuple[str, int] | None = None,
        doc: bytes | None = None,
        stall: tuple[str, float] | None = None,
        beats: int = 0,
        first_out_ns: int | None = None,
    ) -> None:
        """The request is settled (its row is complete): end its span and record its
        metric points. Called once per request, by settlement only.

        `stall` is (reason, elapsed seconds) when the stall guard cut the stream; unless the
        response said otherwise, its finish reason is then `length`, as the guard's own last
        event says."""
        end_ns = time.time_ns()
        # A request settled before `begin` (a relay endpoint's refusal) has one span all the
        # same, as every row has.
        if trace is None and self._tracer is not None:
            trace = self.begin([], rec)
        facts = A.response_facts(doc)
        if stall is not None and not facts.finish_reasons:
            facts = facts._replace(finish_reasons=("length",))
        if trace is not None:
            span = trace.span
            if beats and first_out_ns is not None:
                span.add_event(
                    "relay.heartbeat", {"relay.heartbeat.count": beats}, timestamp=first_out_ns
                )
            if stall is not None:
                span.add_event(
                    "relay.stall",
                    {
                        "relay.stall.reason": stall[0],
                        "relay.stall.elapsed_s": stall[1],
                        "relay.upstream": upstream or "",
                    },
                    timestamp=end_ns,
                )
            self._end(trace, rec, facts, server, end_ns)
        if self._metrics is not None:
            self._gen_ai_points(rec, facts, server)
            if upstream is not None:
                self._relay_points(rec, upstream, stall)

    def _end(
        self,
        trace: Trace,
        rec: Record,
        facts: A.ResponseFacts,
        server: tuple[str, int] | None,
        end_ns: int,
    ) -> None:
        """Name the span, set its attributes and status from the row, and end it."""
        span = trace.span
        span.update_name(A.span_name(rec))
        provider = self.settings.provider_name
        span.set_attributes(A.span_attributes(rec, provider, facts, server, trace.max_tokens))
        if not rec.ok:
            span.set_status(Status(StatusCode.ERROR, rec.error_code or rec.outcome))
        span.end(end_time=end_ns)

    def _gen_ai_points(
        self, rec: Record, facts: A.ResponseFacts, server: tuple[str, int] | None
    ) -> None:
        """The gen_ai metric points of a request on a GenAI route (none on another)."""
        route = A.route(rec.path)
        if route is None:
            return
        provider = self.settings.provider_name
        attrs = A.metric_attributes(rec, route, provider, facts.model, server)
        err = A.error_type(rec)
        total_s = (rec.total_ms or 0.0) / 1000
        self._duration.record(total_s, attrs if err is None else {**attrs, "error.type": err})
        if rec.ok and rec.ttft_ms is not None:
            self._ttft.record(rec.ttft_ms / 1000, attrs)
        if rec.ok and rec.tpot_ms is not None:
            self._tpot.record(rec.tpot_ms / 1000, attrs)
        if rec.prompt_tokens is not None:
            self._tokens.record(rec.prompt_tokens, {**attrs, "gen_ai.token.type": "input"})
        if rec.completion_tokens is not None:
            self._tokens.record(rec.completion_tokens, {**attrs, "gen_ai.token.type": "output"})

    def _relay_points(self, rec: Record, upstream: str, stall: tuple[str, float] | None) -> None:
        """The relay's own points of a request that reached an upstream."""
        if rec.queue_ms is not None:
            self._queue.record(rec.queue_ms / 1000, {"relay.upstream.name": upstream})
        if stall is not None:
            self._stalls.add(1, {"relay.upstream.name": upstream, "relay.stall.reason": stall[0]})

    def rejected(self, rec: Record, headers: Headers) -> None:
        """A request refused before it was read whole: its span begins and ends here."""
        self.settled(rec, self.begin(headers, rec))

    # ---- the end ---------------------------------------------------------------------------
    def flush(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Export what is pending now (blocking: tests, and the stop's last step)."""
        ms = int(timeout_s * 1000)
        if self._traces is not None:
            self._traces.force_flush(ms)
        if self._metrics is not None:
            self._metrics.force_flush(ms)

    def shutdown(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Shut the exporters down within `timeout_s` in all (blocking). The spans' first,
        which may take all of it but `METRICS_SHARE_S` (the provider's own shutdown would
        wait 30 s): what the collector has not acknowledged then is lost, and counted. Then
        the metrics', with what is left: their last export carries that count."""
        end = time.monotonic() + timeout_s
        if self._processor is not None:
            keep = min(METRICS_SHARE_S, timeout_s / 2) if self._metrics is not None else 0.0
            self._processor.shutdown_within(int((timeout_s - keep) * 1000))
        self._tally.stop()
        if self._traces is not None:
            self._traces.shutdown()
        if self._metrics is not None:
            left = max(0.0, end - time.monotonic())
            self._metrics.shutdown(timeout_millis=int(left * 1000))

    async def aclose(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Shut down in a thread of its own, waited `timeout_s` at most: a collector that is
        down, slow or silent never holds the relay's exit longer. The SDK's errors there never
        stop the relay's stop, and once the loop is closed nobody waits any more. A second
        call (a second stop) waits for the first one's end, the same bound, and says nothing
        more."""
        first = self._closing is None
        if self._closing is None:
            self._closing = self._shut_down_in_a_thread(timeout_s)
        try:
            await asyncio.wait_for(asyncio.shield(self._closing), timeout_s)
        except TimeoutError:
            pass
        if first:
            # Done, or given up on: whatever is not acknowledged by now is lost.
            self._tally.stop()
            self.log.event("otel_stopped", spans_dropped=self.spans_dropped)

    def _shut_down_in_a_thread(self, timeout_s: float) -> asyncio.Future[None]:
        """`shutdown` in a daemon thread; the future is done when it has returned."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def run() -> None:
            try:
                self.shutdown(timeout_s)
            except Exception:
                pass
            try:
                loop.call_soon_threadsafe(finished)
            except RuntimeError:
                pass

        threading.Thread(target=run, name="relay-otel-shutdown", daemon=True).start()
        return done

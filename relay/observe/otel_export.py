"""How the relay's telemetry leaves the process (`observe.otel`): the OTLP exporters of the
configured protocol, the sampler `[otel]` names, the batch processor and exporter that count
what becomes of every span (`SpanTally`), and the SDK's own warnings as the relay's JSON
lines."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.metrics.export import MetricExporter
from opentelemetry.sdk.trace import ReadableSpan, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from relay.config import ConfigError
from relay.observe.log import Log
from relay.observe.otel_env import Settings

GRPC_HINT = (
    "pip install -e '.[otel-grpc]' in the relay's checkout (opentelemetry-exporter-otlp-proto-grpc)"
)


class SpanTally:
    """What became of the sampled spans handed to export, counted as it happens: `ended`
    (handed to the batch processor, on the event loop's thread), `no_room` (a full queue
    dropped one then), and by the exporting thread, under the SDK's export lock,
    `acknowledged` (in a batch the collector answered with success) and `failed`.

    `dropped` is the spans known lost while the relay runs (`no_room` + `failed`). From
    `stop` on, it is every span not acknowledged: the stop gives up on the ones still queued
    and on an export still waiting for its answer, and none of them will reach the collector
    (a late answer is not waited for: the relay is exiting)."""

    def __init__(self) -> None:
        self.ended = 0
        self.no_room = 0
        self.acknowledged = 0
        self.failed = 0
        self._final: int | None = None
        self._lock = threading.Lock()

    @property
    def dropped(self) -> int:
        final = self._final
        return final if final is not None else self.no_room + self.failed

    def stop(self) -> None:
        """No more export is waited for: what is not acknowledged now is lost (the count is
        fixed from here, whichever thread stops it first)."""
        with self._lock:
            if self._final is None:
                self._final = self.ended - self.acknowledged


class CountingProcessor(BatchSpanProcessor):
    """The SDK's batch processor, counting in `tally` the sampled spans it is handed (`on_end`
    runs on the event loop's thread: spans end there) and those it drops, the queue full: a
    span that finds no room is dropped (the SDK would drop the oldest in its place, and
    could count one it did not drop).

    The queue read is the SDK's own (its `_batch_processor`): with an SDK that has none, a
    full queue is not counted as it happens (only at the stop, as not acknowledged), and the
    provider's shutdown shuts the processor down."""

    def __init__(
        self,
        exporter: SpanExporter,
        tally: SpanTally,
        max_queue_size: int | None = None,
        schedule_delay_millis: float | None = None,
        max_export_batch_size: int | None = None,
    ) -> None:
        super().__init__(
            exporter,
            max_queue_size=max_queue_size,
            schedule_delay_millis=schedule_delay_millis,
            max_export_batch_size=max_export_batch_size,
        )
        self.tally = tally

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            super().on_end(span)
            return
        self.tally.ended += 1
        # Only this thread adds to the queue (the export thread takes from it): one with room
        # now still has room as the span goes in. With none, this span is the one dropped,
        # here, so that exactly the spans dropped are counted.
        if self._full():
            self.tally.no_room += 1
            return
        super().on_end(span)

    def _full(self) -> bool:
        bp = getattr(self, "_batch_processor", None)
        if bp is None:
            return False
        queue = getattr(bp, "_queue", None)
        return queue is not None and len(queue) >= int(bp._max_queue_size)

    def shutdown_within(self, timeout_millis: int) -> None:
        bp = getattr(self, "_batch_processor", None)
        if bp is not None:
            bp.shutdown(timeout_millis=timeout_millis)


class CountingExporter(SpanExporter):
    """An OTLP span exporter that counts in `tally` the spans of the batches the collector
    acknowledged, and of those it failed to send."""

    def __init__(self, inner: SpanExporter, tally: SpanTally) -> None:
        self.inner = inner
        self.tally = tally

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.tally.acknowledged += len(spans)
        else:
            self.tally.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def span_exporter(s: Settings) -> SpanExporter:
    """The span exporter of the configured protocol. The gRPC one is the `otel-grpc` extra's
    (pyproject.toml tells mypy it may be missing)."""
    if s.traces_protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter,
            )
        except ImportError:
            raise ConfigError(f"otel: protocol grpc needs {GRPC_HINT}") from None
        grpc_spans: SpanExporter = OTLPSpanExporter(endpoint=s.traces_endpoint, timeout=s.timeout_s)
        return grpc_spans
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    return HttpSpanExporter(endpoint=s.traces_endpoint, timeout=s.timeout_s)


def metric_exporter(s: Settings) -> MetricExporter:
    """The metric exporter of the configured protocol (gRPC: as `span_exporter`)."""
    if s.metrics_protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter,
            )
        except ImportError:
            raise ConfigError(f"otel: protocol grpc needs {GRPC_HINT}") from None
        grpc_metrics: MetricExporter = OTLPMetricExporter(
            endpoint=s.metrics_endpoint, timeout=s.timeout_s
        )
        return grpc_metrics
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )

    return HttpMetricExporter(endpoint=s.metrics_endpoint, timeout=s.timeout_s)


def sampler(s: Settings) -> sampling.Sampler | None:
    """`[otel].traces_sampler` (+ `_arg`); None: the SDK's from OTEL_TRACES_SAMPLER."""
    name, arg = s.sampler, s.sampler_arg if s.sampler_arg is not None else 1.0
    if name is None:
        return None
    root = {
        "always_on": sampling.ALWAYS_ON,
        "always_off": sampling.ALWAYS_OFF,
        "traceidratio": sampling.TraceIdRatioBased(arg),
    }
    if name.startswith("parentbased_"):
        return sampling.ParentBased(root[name.removeprefix("parentbased_")])
    return root[name]


# ---- the SDK's own log lines -----------------------------------------------------------------
class _Bridge(logging.Handler):
    """The SDK's warnings (a full queue, a failed export) as the relay's JSON lines; the
    same message at most once a minute."""

    EVERY_S = 60.0

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.log: Log | None = None
        self._last: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        log = self.log
        if log is None:
            return
        key = f"{record.name}:{record.msg}"
        now = time.monotonic()
        if now - self._last.get(key, -self.EVERY_S) < self.EVERY_S:
            return
        self._last[key] = now
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        log.event("otel_sdk", level=record.levelname.lower(), message=message[:300])


bridge = _Bridge()
_sdk_log = logging.getLogger("opentelemetry")
_sdk_log.addHandler(bridge)
# Not to Python's last-resort handler either, which writes plain text on stderr.
_sdk_log.propagate = False

"""How the relay's telemetry leaves the process (`observe.otel`): the OTLP exporters of the
configured protocol, the sampler `[otel]` names, the batch processor and exporter that count
the spans lost, and the SDK's own warnings as the relay's JSON lines."""

from __future__ import annotations

import logging
import time

from opentelemetry.sdk.trace import ReadableSpan, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from relay.config import ConfigError
from relay.observe.otel_env import Settings

GRPC_HINT = "pip install 'relay[otel-grpc]' (opentelemetry-exporter-otlp-proto-grpc)"


class CountingProcessor(BatchSpanProcessor):
    """The SDK's batch processor, counting the spans its full queue drops."""

    def __init__(self, exporter, **kw) -> None:
        super().__init__(exporter, **kw)
        self.dropped = 0  # (the event loop's thread only: spans end there)

    def on_end(self, span: ReadableSpan) -> None:
        bp = getattr(self, "_batch_processor", None)
        queue = getattr(bp, "_queue", None)
        if (
            queue is not None
            and span.context is not None
            and span.context.trace_flags.sampled
            and len(queue) >= bp._max_queue_size  # type: ignore[union-attr]
        ):
            self.dropped += 1
        super().on_end(span)

    def shutdown_within(self, timeout_millis: int) -> None:
        bp = getattr(self, "_batch_processor", None)
        if bp is not None:
            bp.shutdown(timeout_millis=timeout_millis)
        else:
            self.shutdown()


class CountingExporter(SpanExporter):
    """An OTLP span exporter that counts the spans of the batches it failed to send."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.failed = 0  # (the worker thread's only)

    def export(self, spans):
        try:
            result = self.inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def span_exporter(s: Settings):
    if s.traces_protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
                OTLPSpanExporter,
            )
        except ImportError:
            raise ConfigError(f"otel: protocol grpc needs {GRPC_HINT}") from None
        return OTLPSpanExporter(endpoint=s.traces_endpoint, timeout=s.timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    return HttpSpanExporter(endpoint=s.traces_endpoint, timeout=s.timeout_s)


def metric_exporter(s: Settings):
    if s.metrics_protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (  # type: ignore[import-not-found,unused-ignore]
                OTLPMetricExporter,
            )
        except ImportError:
            raise ConfigError(f"otel: protocol grpc needs {GRPC_HINT}") from None
        return OTLPMetricExporter(endpoint=s.metrics_endpoint, timeout=s.timeout_s)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )

    return HttpMetricExporter(endpoint=s.metrics_endpoint, timeout=s.timeout_s)


def sampler(s: Settings):
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
        self.log = None
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
_sdk_log.propagate = False  # (not Python's last-resort handler: plain text on stderr)

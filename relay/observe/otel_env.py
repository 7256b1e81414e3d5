"""Whether OpenTelemetry is on, and how it exports: `[otel]` and the standard environment.

OpenTelemetry is optional (the `otel` extra). It is on when `[otel]` is in the config, or
when the environment names an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` or a per-signal
`..._TRACES_ENDPOINT` / `..._METRICS_ENDPOINT`), as `opentelemetry-instrument` users expect;
`OTEL_SDK_DISABLED=true` (or `disabled = true`) turns it off whatever else says. Off, nothing
of OpenTelemetry is imported and the data path does not change (`App.otel` is None).

A key in `[otel]` wins over its environment variable; what the file leaves unset the SDK
reads from the environment itself (endpoints, protocol, timeout, headers, sampler, resource,
intervals, queue bounds), so every standard variable keeps its meaning. Headers (which may
carry a collector's credential) come only from the environment, never from the file.

`otel_start.start` builds the telemetry at the relay's start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from relay.config import ConfigError, OtelConfig

EXTRA_HINT = "pip install -e '.[otel]' in the relay's checkout"
PROTOCOLS = ("http/protobuf", "grpc")
_ENDPOINT_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)


@dataclass(frozen=True)
class Settings:
    """What the exporter is built with; None: the SDK reads the environment variable.
    `configured`: whether `[otel]` is in the file (not the environment alone)."""

    configured: bool
    traces: bool
    metrics: bool
    traces_protocol: str
    metrics_protocol: str
    traces_endpoint: str | None = None
    metrics_endpoint: str | None = None
    timeout_s: float | None = None
    resource: dict[str, str] = field(default_factory=dict)
    sampler: str | None = None
    sampler_arg: float | None = None
    metric_export_interval_ms: int | None = None
    bsp_schedule_delay_ms: int | None = None
    bsp_max_queue_size: int | None = None
    provider_name: str | None = None


def _true(value: str | None) -> bool:
    return value is not None and value.strip().lower() == "true"


def _protocol(cfg: OtelConfig | None, environ: Mapping[str, str], signal: str) -> str:
    if cfg is not None and cfg.protocol is not None:
        return cfg.protocol
    value = environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    value = value.strip()
    if value not in PROTOCOLS:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: {value!r} is not supported (http/protobuf or grpc)"
        )
    return value


def _endpoint(cfg: OtelConfig | None, signal: str, protocol: str) -> str | None:
    """The file's endpoint for a signal (None: the SDK's from the environment). A base
    endpoint gets the signal's path over HTTP (`/v1/traces`), as the variable does."""
    if cfg is None:
        return None
    own = cfg.traces_endpoint if signal == "traces" else cfg.metrics_endpoint
    if own is not None:
        return own
    if cfg.endpoint is None:
        return None
    if protocol == "grpc":
        return cfg.endpoint
    return cfg.endpoint.rstrip("/") + f"/v1/{signal}"


def settings(cfg: OtelConfig | None, environ: Mapping[str, str]) -> Settings | None:
    """The exporter's settings, None when OpenTelemetry is off."""
    if _true(environ.get("OTEL_SDK_DISABLED")) or (cfg is not None and cfg.disabled):
        return None
    if cfg is None and not any(environ.get(v) for v in _ENDPOINT_VARS):
        return None
    traces = (cfg is None or cfg.traces) and environ.get(
        "OTEL_TRACES_EXPORTER", ""
    ).strip().lower() != "none"
    metrics = (cfg is None or cfg.metrics) and environ.get(
        "OTEL_METRICS_EXPORTER", ""
    ).strip().lower() != "none"
    if not traces and not metrics:
        return None
    tp, mp = _protocol(cfg, environ, "TRACES"), _protocol(cfg, environ, "METRICS")
    resource = dict(cfg.resource_attributes) if cfg is not None else {}
    if cfg is not None and cfg.service_name is not None:
        resource["service.name"] = cfg.service_name
    elif "service.name" not in resource and not _names_service(environ):
        resource["service.name"] = "relay"
    return Settings(
        configured=cfg is not None,
        traces=traces,
        metrics=metrics,
        traces_protocol=tp,
        metrics_protocol=mp,
        traces_endpoint=_endpoint(cfg, "traces", tp),
        metrics_endpoint=_endpoint(cfg, "metrics", mp),
        timeout_s=cfg.timeout_ms / 1000 if cfg is not None and cfg.timeout_ms else None,
        resource=resource,
        sampler=cfg.traces_sampler if cfg is not None else None,
        sampler_arg=cfg.traces_sampler_arg if cfg is not None else None,
        metric_export_interval_ms=cfg.metric_export_interval_ms if cfg is not None else None,
        bsp_schedule_delay_ms=cfg.bsp_schedule_delay_ms if cfg is not None else None,
        bsp_max_queue_size=cfg.bsp_max_queue_size if cfg is not None else None,
        provider_name=cfg.provider_name if cfg is not None else None,
    )


def _names_service(environ: Mapping[str, str]) -> bool:
    """Whether the environment names the service (the SDK's resource reads it then)."""
    if environ.get("OTEL_SERVICE_NAME"):
        return True
    attrs = environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return any(p.split("=", 1)[0].strip() == "service.name" for p in attrs.split(","))

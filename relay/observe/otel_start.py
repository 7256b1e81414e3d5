"""The relay's telemetry built at its start (`App.start`), or None when it is off.

Without the `otel` extra, `[otel]` is a ConfigError naming it; an environment alone that asks
for it is logged (`otel_extra_missing`) and ignored: the relay still starts, as an
instrumented program does without its SDK.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from relay.config import ConfigError, OtelConfig
from relay.observe.otel_env import EXTRA_HINT, settings


def start(cfg: OtelConfig | None, log, upstreams: Callable[[], list], environ=os.environ):
    """The relay's telemetry (`relay.observe.otel.Telemetry`), or None when it is off."""
    s = settings(cfg, environ)
    if s is None:
        return None
    try:
        from relay.observe.otel import Telemetry
    except ImportError as exc:
        if s.configured:
            raise ConfigError(
                f"otel: OpenTelemetry needs the 'otel' extra ({EXTRA_HINT}): {exc}"
            ) from None
        log.event("otel_extra_missing", note=f"OTEL_* set but {EXTRA_HINT} is not: off")
        return None
    return Telemetry(s, log, upstreams)

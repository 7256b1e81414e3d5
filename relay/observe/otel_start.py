"""The relay's telemetry built at its start (`App.start`), or None when it is off.

Without the `otel` extra, `[otel]` is a ConfigError naming it; an environment alone that asks
for it is logged (`otel_extra_missing`) and ignored: the relay still starts, as an
instrumented program does without its SDK.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from relay.config import ConfigError, OtelConfig
from relay.observe.log import Log
from relay.observe.metrics import UpstreamMetrics
from relay.observe.otel_env import EXTRA_HINT, Settings, settings

if TYPE_CHECKING:
    from relay.observe.otel import Telemetry


def start(
    cfg: OtelConfig | None,
    log: Log,
    upstreams: Callable[[], Iterable[UpstreamMetrics]],
    environ: Mapping[str, str] = os.environ,
) -> Telemetry | None:
    """The relay's telemetry, or None when it is off. `relay.observe.otel` (and with it
    OpenTelemetry) is imported only when it is on."""
    s = settings(cfg, environ)
    if s is None:
        return None
    if not available(s):
        log.event("otel_extra_missing", note=f"OTEL_* set but {EXTRA_HINT} is not: off")
        return None
    from relay.observe.otel import Telemetry

    return Telemetry(s, log, upstreams)


def available(s: Settings) -> bool:
    """Whether OpenTelemetry can be imported for `s`: ConfigError when `[otel]` asks for it
    and the extra is missing; False when only the environment does (it is then off)."""
    try:
        import relay.observe.otel  # noqa: F401
    except ImportError as exc:
        if s.configured:
            raise ConfigError(
                f"otel: OpenTelemetry needs the 'otel' extra ({EXTRA_HINT}): {exc}"
            ) from None
        return False
    return True

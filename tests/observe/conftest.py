"""Fixtures of the OpenTelemetry tests (test_otel*.py): an OTLP/HTTP receiver, and relays
with `[otel]` pointed at one, built in this process as tests/conftest.py builds relays."""

from __future__ import annotations

import os

import pytest

from relay.app import App
from relay.config import OtelConfig


@pytest.fixture
async def receiver():
    from tests.support.otlp_receiver import Receiver

    r = await Receiver().start()
    yield r
    await r.stop()


@pytest.fixture
async def otel_relay(make_relay, monkeypatch):
    """make(receiver | None, upstreams=None, otel=None, **dispatcher fields) -> a started
    relay (tests/conftest.py's make_relay) whose `[otel]` exports to the receiver (or as `otel`
    says). No OTEL_* variable of the environment reaches it."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)

    async def make(receiver, upstreams: list | None = None, otel=None, **disp) -> App:
        if otel is None and receiver is not None:
            otel = OtelConfig(
                endpoint=receiver.endpoint,
                bsp_schedule_delay_ms=50,
                metric_export_interval_ms=3_600_000,  # (the tests flush: otlp_receiver.flushed)
                timeout_ms=2000,
            )
        return await make_relay(upstreams=upstreams, parallel=64, otel=otel, **disp)

    return make

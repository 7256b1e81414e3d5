"""Fixtures of the OpenTelemetry tests (test_otel*.py): an OTLP/HTTP receiver, and relays
with `[otel]` pointed at one, built in this process as tests/conftest.py builds relays."""

from __future__ import annotations

import os

import pytest

from relay.app import App
from relay.config import Config, DispatcherConfig, OtelConfig, ServerConfig, StoreConfig
from relay.config import UpstreamConfig as Up
from relay.observe.log import quiet


@pytest.fixture
async def receiver():
    from tests.support.otlp_receiver import Receiver

    r = await Receiver().start()
    yield r
    await r.stop()


@pytest.fixture
async def otel_relay(sim, monkeypatch):
    """make(receiver | None, upstreams=None, otel=None, **dispatcher fields) -> a started
    relay whose `[otel]` exports to the receiver (or as `otel` says). No OTEL_* variable of
    the environment reaches it."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    apps = []

    async def make(receiver, upstreams: list | None = None, otel=None, **disp) -> App:
        disp.setdefault("health_interval_s", 0)
        if otel is None and receiver is not None:
            otel = OtelConfig(
                endpoint=receiver.endpoint,
                bsp_schedule_delay_ms=50,
                metric_export_interval_ms=3_600_000,  # (the tests flush: otlp_receiver.flushed)
                timeout_ms=2000,
            )
        cfg = Config(
            server=ServerConfig(port=0),
            dispatcher=DispatcherConfig(**disp),
            upstream=upstreams or [Up(name="llm", url=sim.url, parallel=64)],
            store=StoreConfig(path=":memory:"),
            otel=otel,
        )
        app = App(cfg, quiet())
        await app.start()
        apps.append(app)
        return app

    yield make
    for app in apps:
        await app.stop(drain_timeout_s=0.5)

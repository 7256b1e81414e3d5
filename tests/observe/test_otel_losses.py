"""Every span the collector does not acknowledge is counted lost (docs/otel.md, "Export never
holds the relay"), against a collector on a real socket that accepts, reads every export
whole and never answers: the spans its export timed out on, those the full queue had no
room for, and those the stop came before (queued, or in an export still waiting) are all in
`spans_dropped`, in the `otel_stopped` line and in the last `relay.otel.spans_dropped` point.
The stop waits the documented grace for it at most."""

from __future__ import annotations

import asyncio
import json
import signal
import time

from relay.config import OtelConfig
from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.helpers import CHAT, wait_for
from tests.support.need import need_extra
from tests.support.otlp_receiver import Receiver
from tests.support.processes import kill, start, wait_listening

# The relay's OpenTelemetry module needs the extra: missing, the module skips naming it.
SHUTDOWN_S = need_extra("otel", "relay.observe.otel").SHUTDOWN_S

# One span per request: N requests, N spans.
N = 120
QUEUE = 32


async def requests(port: int, n: int) -> None:
    """n short requests, 16 at a time."""
    gate = asyncio.Semaphore(16)

    async def one() -> None:
        async with gate:
            resp = await httpc.fetch(port, "POST", CHAT, httpc.chat(1, stream=False))
            assert resp.status == 200

    await asyncio.gather(*(one() for _ in range(n)))


def split(traces: Receiver, metrics: Receiver, timeout_ms: int) -> OtelConfig:
    """Spans to `traces`, metric points to `metrics` (which answers: it reads the count)."""
    return OtelConfig(
        traces_endpoint=f"{traces.endpoint}/v1/traces",
        metrics_endpoint=f"{metrics.endpoint}/v1/metrics",
        bsp_max_queue_size=QUEUE,
        bsp_schedule_delay_ms=10,
        metric_export_interval_ms=3_600_000,
        timeout_ms=timeout_ms,
    )


async def timed_stop(app) -> float:
    """The relay's stop; how long its telemetry's part of it (`aclose`) took."""
    took: list[float] = []
    close = app.otel.aclose

    async def aclose() -> None:
        t = time.perf_counter()
        await close()
        took.append(time.perf_counter() - t)

    app.otel.aclose = aclose
    await app.stop(drain_timeout_s=0.5)
    [s] = took
    return s


async def test_a_collector_that_never_answers_loses_every_span_and_counts_each(otel_relay):
    """The export waits longer than the stop's grace: the queue fills (spans dropped for want
    of room), the first export is still waiting at the stop, the rest are still queued."""
    silent, answering = await Receiver(answer=False).start(), await Receiver().start()
    try:
        app = await otel_relay(None, otel=split(silent, answering, timeout_ms=60_000))
        await requests(app.port, N)
        await wait_for(lambda: len(app.log.of("access")) == N)
        await wait_for(lambda: silent.requests >= 1)  # an export is waiting for its answer
        assert silent.spans() == []
        took = await timed_stop(app)
        [line] = app.log.of("otel_stopped")
        assert line["spans_dropped"] == N
        # the last metric export (at the stop) carries the final count
        [(_a, point)] = answering.points("relay.otel.spans_dropped")
        assert point.as_int == N
        # the grace, and the loop's turn to notice it ended
        assert took < SHUTDOWN_S + 1.0, took
    finally:
        await silent.stop()
        await answering.stop()


async def test_exports_that_time_out_are_counted_as_they_fail(otel_relay):
    """An export timeout shorter than the run: each batch fails, and is counted then."""
    silent, answering = await Receiver(answer=False).start(), await Receiver().start()
    try:
        app = await otel_relay(None, otel=split(silent, answering, timeout_ms=200))
        await requests(app.port, N)
        await wait_for(lambda: len(app.log.of("access")) == N)
        # every batch's export timed out (or found no room in the queue): all counted, live
        await wait_for(lambda: app.otel.spans_dropped == N, timeout=30)
        await timed_stop(app)
        [line] = app.log.of("otel_stopped")
        assert line["spans_dropped"] == N
        [(_a, point)] = answering.points("relay.otel.spans_dropped")
        assert point.as_int == N
    finally:
        await silent.stop()
        await answering.stop()


async def test_relay_serve_exits_in_bounded_time_counting_every_span(tmp_path):
    """`relay serve` as a user runs it, the OTEL_* variables pointed at a collector that never
    answers: SIGTERM, and the process exits, its `otel_stopped` line counting every span."""
    sim, silent = Simulator(), Receiver(answer=False)
    await sim.start()
    await silent.start()
    conf = tmp_path / "relay.toml"
    conf.write_text(
        f'[server]\nport = 0\n[store]\npath = "{tmp_path / "relay.db"}"\n'
        f'[[upstream]]\nname = "llm"\nurl = "{sim.url}"\nparallel = 32\n'
    )
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": silent.endpoint,
        "OTEL_EXPORTER_OTLP_TIMEOUT": "60000",
        "OTEL_BSP_SCHEDULE_DELAY": "10",
        "OTEL_METRICS_EXPORTER": "none",
    }
    proc = await start("serve", "--config", str(conf), env=env)
    try:
        port, _ = await wait_listening(proc)
        # (read as it comes: a full pipe would hold the relay's log writes)
        err = asyncio.ensure_future(proc.stderr.read())
        await requests(port, N)
        await wait_for(lambda: silent.requests >= 1, timeout=20)
        t = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        took = time.perf_counter() - t
        lines = [json.loads(x) for x in (await err).splitlines() if x.startswith(b"{")]
        [line] = [x for x in lines if x["event"] == "otel_stopped"]
        assert line["spans_dropped"] == N
        # The stop's own waits (the clients' linger, 2.5 s) and the telemetry's grace, with
        # room for a busy machine; a stop held by the export would take its 60 s.
        assert took < 2.5 + SHUTDOWN_S + 10.0, took
    finally:
        await kill(proc)
        await silent.stop()
        await sim.stop()

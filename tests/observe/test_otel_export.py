"""Export never holds the relay: with the collector down or answering slowly, a paced stream's
gaps stay the upstream's pacing, the spans that find no room (or fail) are counted, and the
relay's stop waits a bounded time for the last export."""

from __future__ import annotations

import asyncio
import time
from itertools import pairwise

from relay.config import OtelConfig
from tests.support import httpc
from tests.support.helpers import CHAT, closed_port, wait_for
from tests.support.otlp_receiver import Receiver, flushed

PACE_MS = 20
QUEUE = 8


async def paced_gaps(port: int, n: int = 40) -> list[float]:
    """The gaps (ms) between a paced stream's content events as the client reads them."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(httpc.build_request("POST", CHAT, httpc.chat(n, interval_ms=PACE_MS)))
    seen: list[float] = []
    buf = b""
    try:
        while True:
            data = await asyncio.wait_for(reader.read(65536), 5)
            if not data:
                break
            now = time.perf_counter()
            buf += data
            seen += [now] * data.count(b'"content":"')
            if b"[DONE]" in buf:
                break
    finally:
        writer.close()
    assert len(seen) == n
    return [(b - a) * 1000 for a, b in pairwise(seen)]


async def burst(port: int, n: int) -> None:
    """n short requests at once: n spans ending together, more than the queue holds."""
    resps = await asyncio.gather(
        *(httpc.fetch(port, "POST", CHAT, httpc.chat(1, stream=False)) for _ in range(n))
    )
    assert all(r.status == 200 for r in resps)


async def stream_beside_a_burst(app, n: int = 40) -> list[float]:
    stream = asyncio.ensure_future(paced_gaps(app.port))
    await asyncio.sleep(0.1)
    await burst(app.port, n)
    return await stream


def otel(endpoint: str) -> OtelConfig:
    return OtelConfig(
        endpoint=endpoint,
        bsp_max_queue_size=QUEUE,
        bsp_schedule_delay_ms=10,
        metric_export_interval_ms=3_600_000,
        timeout_ms=500,
    )


async def test_collector_down_requests_unaffected_and_every_lost_span_counted(otel_relay):
    app = await otel_relay(None, otel=otel(f"http://127.0.0.1:{closed_port()}"))
    gaps = await stream_beside_a_burst(app)
    # the pacing, not an export's timeout (500 ms, retried): no gap near it
    assert max(gaps) < 150, gaps
    assert sorted(gaps)[len(gaps) // 2] < PACE_MS + 10, gaps
    await wait_for(lambda: len(app.log.of("access")) == 41)
    assert app.otel.spans_dropped >= 41 - QUEUE - 512  # (some found the queue full)
    # every span is lost: no room in the queue, or its export failed
    await wait_for(lambda: app.otel.spans_dropped == 41, timeout=15)
    t = time.perf_counter()
    await app.stop(drain_timeout_s=0.5)
    assert time.perf_counter() - t < 8  # (the last export waited SHUTDOWN_S at most)
    [line] = app.log.of("otel_stopped")
    assert line["spans_dropped"] == 41


async def test_slow_collector_requests_unaffected_drops_counted_in_a_metric(otel_relay):
    slow = await Receiver(delay_s=0.3).start()  # (within the 500 ms export timeout)
    try:
        app = await otel_relay(None, otel=otel(slow.endpoint))
        gaps = await stream_beside_a_burst(app)
        assert max(gaps) < 150, gaps
        assert sorted(gaps)[len(gaps) // 2] < PACE_MS + 10, gaps
        await wait_for(lambda: len(app.log.of("access")) == 41)
        dropped = app.otel.spans_dropped
        assert dropped > 0  # 40 spans ended at once into a queue of 8 behind a slow export
        await flushed(app)
        [(_a, p)] = slow.points("relay.otel.spans_dropped")
        assert p.as_int == app.otel.spans_dropped >= dropped
        exported = len(slow.spans())
        assert exported + app.otel.spans_dropped == 41  # none lost uncounted
    finally:
        await slow.stop()

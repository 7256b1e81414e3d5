"""OpenTelemetry with `--workers 2`: one span per request whichever worker settled it, each
process its own instance (its metric streams apart), the relay-wide slot gauges once."""

from __future__ import annotations

import asyncio
import re
import signal

from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.otlp_receiver import Receiver, attrs
from tests.support.processes import kill, start, wait_listening
from tests.workers.test_workers import CHAT, _config


async def test_one_span_per_request_and_one_instance_per_process(tmp_path):
    sim, receiver = Simulator(), Receiver()
    await sim.start()
    await receiver.start()
    path, db = tmp_path / "relay.toml", str(tmp_path / "relay.db")
    _config(path, db, sim.port)
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "200",
    }
    proc = await start("serve", "--config", str(path), "--workers", "2", env=env)
    try:
        port, _ = await wait_listening(proc)
        ids = [f"otel-w-{i}" for i in range(40)]
        results = await asyncio.gather(
            *(httpc.fetch(port, "POST", CHAT, httpc.chat(3), {"X-Request-Id": rid}) for rid in ids)
        )
        assert {r.status for r in results} == {200}
        proc.send_signal(signal.SIGTERM)  # every process exports what it has left as it stops
        assert await asyncio.wait_for(proc.wait(), 40) == 0
        spans = receiver.spans()
        got = sorted(attrs(s.attributes)["relay.request_id"] for s in spans)
        assert got == sorted(ids)  # exactly one span per request
        instances = {r.get("service.instance.id") for r in receiver.resources()}
        # each worker that served is its own instance (which of the two the kernel gave the
        # connections to is its choice: one may have taken them all)
        assert 1 <= len(instances) <= 2 and None not in instances
        assert all(re.fullmatch(r".+:\d+:worker-[01]", i) for i in instances), instances
        points = receiver.points("gen_ai.server.request.duration")
        assert sum(p.count for _a, p in points) >= 1
    finally:
        await kill(proc)
        await receiver.stop()
        await sim.stop()

"""OpenTelemetry with `--workers 2`: one span per request whichever worker settled it, each
process its own instance (its metric streams apart), the relay-wide slot gauges once."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections import Counter

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
        workers = {f"{socket.gethostname()}:{proc.pid}:worker-{i}" for i in (0, 1)}
        # Each process exports its metrics as its own instance: the two workers (whether the
        # kernel gave them connections or not), and the parent.
        exported = _latest_by_instance(receiver)
        (parent,) = set(exported) - workers
        assert set(exported) == workers | {parent}
        # (the parent's: the relay-wide gauges, no request of its own)
        assert "relay.slots.in_flight" in exported[parent]
        assert "gen_ai.server.request.duration" not in exported[parent]
        # A request's span and its duration point come from the worker that settled it
        # (which of the two the kernel gave each connection to is its choice).
        spans_by = Counter(
            attrs(rs.resource.attributes)["service.instance.id"]
            for req in receiver.traces
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for _span in ss.spans
        )
        assert set(spans_by) <= workers
        durations = {
            i: sum(p.count for p in ms.get("gen_ai.server.request.duration", ()))
            for i, ms in exported.items()
        }
        assert durations == {i: spans_by.get(i, 0) for i in exported}
        assert sum(durations.values()) == 40
    finally:
        await kill(proc)
        await receiver.stop()
        await sim.stop()


def _latest_by_instance(receiver: Receiver) -> dict[str, dict[str, list]]:
    """Each exporting process's metrics as its last export held them (cumulative: the
    totals), by its `service.instance.id`: {instance: {metric name: data points}}."""
    latest: dict[str, dict[str, list]] = {}
    for req in receiver.metric_exports:
        for rm in req.resource_metrics:
            instance = attrs(rm.resource.attributes)["service.instance.id"]
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    points = list(getattr(m, m.WhichOneof("data")).data_points)
                    latest.setdefault(instance, {})[m.name] = points
    return latest

"""A settled request told to OpenTelemetry (`relay.observe.otel`, when it is on).

`settle.settle` calls `settled` once, when the row is complete; this module reads what the
request's ledger and its last exchange came to (the upstream's address, the response's last
JSON document, a stall, heartbeats) so the observe layer gets plain values.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from relay.observe.record import Record
from relay.proxy.ledger import Ledger
from relay.stream.sse import event_json
from relay.stream.summary import ExchangeSummary

if TYPE_CHECKING:
    # Only when OpenTelemetry is on is any of it imported.
    from relay.observe.otel import Telemetry


def settled(
    otel: Telemetry, rec: Record, ledger: Ledger, summary: ExchangeSummary | None,
    first_out: float | None,
) -> None:  # fmt: skip
    """`summary`: the last attempt's exchange; `first_out`: the perf_counter time the
    response's first byte went out."""
    up = ledger.up
    doc = None
    stall = None
    if summary is not None and rec.upstream_served is not None:
        if summary.body is not None:
            doc = summary.body
        elif summary.meta_event:
            doc = event_json(summary.meta_event)
        if summary.stall is not None:
            stall = (summary.stall.reason, summary.stall.elapsed_s)
    reply = ledger.reply
    beats = reply.beats if reply is not None else 0
    first_out_ns = None
    if beats and first_out is not None:
        # perf_counter to the wall clock.
        first_out_ns = time.time_ns() - int((time.perf_counter() - first_out) * 1e9)
    otel.settled(
        rec,
        ledger.trace,
        upstream=up.name if up is not None else None,
        server=(up.host, up.port) if up is not None else None,
        doc=doc,
        stall=stall,
        beats=beats,
        first_out_ns=first_out_ns,
    )

"""A settled request told to OpenTelemetry (`relay.observe.otel`, when it is on).

`settle.settle` calls `settled` once, when the row is complete; this module reads what the
request's ledger and exchange know (the upstream's address, the response's last JSON
document, a stall, heartbeats) so the observe layer gets plain values.
"""

from __future__ import annotations

import time

from relay.observe.record import Record
from relay.proxy.ledger import Ledger
from relay.stream import endings as E
from relay.stream.sse import SseScanner, event_json


def settled(app, rec: Record, ledger: Ledger, t0: float) -> None:
    up = ledger.up
    ex = ledger.exchange
    doc = None
    stall = None
    if ex is not None and rec.upstream_served is not None:
        scanner = ex.scanner
        if ex.body_copy is not None:
            body = ex.body_copy
            if body.size <= body.LIMIT:
                doc = b"".join(body.parts)
        elif isinstance(scanner, SseScanner) and scanner.meta:
            doc = event_json(scanner.meta)
        if ex.outcome == E.STALL and ex.stall_reason is not None:
            stall = (ex.stall_reason, ex.stall_elapsed)
    hold = ledger.hold
    beats = hold.beats if hold is not None else 0
    first_out_ns = None
    if beats and hold is not None and hold.first_out is not None:  # (perf_counter -> wall)
        first_out_ns = time.time_ns() - int((time.perf_counter() - hold.first_out) * 1e9)
    app.otel.settled(
        rec,
        ledger.trace,
        upstream=up.name if up is not None else None,
        server=(up.host, up.port) if up is not None else None,
        doc=doc,
        stall=stall,
        beats=beats,
        first_out_ns=first_out_ns,
    )

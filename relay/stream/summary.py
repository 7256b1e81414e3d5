"""What one exchange with an upstream came to, frozen when it ends: the facts settlement,
the row, the metrics and the span read (relay.proxy.settle), and the dispatcher's verdict on
a failure before the first content event."""

from __future__ import annotations

import msgspec

from relay.errors import Outcome
from relay.stream.dialect import Api
from relay.stream.itl import Gaps
from relay.stream.stall import Stall
from relay.stream.usage import Usage


class ExchangeSummary(msgspec.Struct, frozen=True, gc=False):
    # The upstream's name, and how the exchange ended.
    upstream: str
    ending: Outcome
    # The upstream's status; 0 when no head came.
    status: int
    # The client left once the stream's own end event reached it: it had the whole response.
    whole: bool
    # The connection may serve another request.
    reusable: bool
    # What the response spoke: an event stream (its API, by its events), a JSON body.
    sse: bool
    api: Api
    # perf_counter times of the reads holding the first and the last content event.
    first_content_at: float | None = None
    last_content_at: float | None = None
    # An event stream's gaps between content events, and its content events counted.
    gaps: Gaps | None = None
    content_events: int | None = None
    # The stream's first event was an error and no content came.
    error_only: bool = False
    # The exact figures the upstream gave: an event stream's, or a whole JSON body's.
    usage: Usage | None = None
    # A JSON body as kept (None when it was not kept whole), and an event stream's last
    # event carrying usage or timings (b"": none).
    body: bytes | None = None
    meta_event: bytes = b""
    # The stall guard's trip, when it cut the stream.
    stall: Stall | None = None
    # Tokens already added to the upstream's rate window while the stream ran.
    counted: int = 0

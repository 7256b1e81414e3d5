"""One request's ledger: what it holds until settlement gives it back, and what it learnt.

The dispatcher opens a `Ledger` per request and fills it on the way; `settle` reads it once,
on every exit path. It holds:

- what must be given back: the upstream `slot`, the budget `reservation`, the durable
  `admission` record (its id: the row replaces it in one commit);
- what the relay decided from the request: whether it is an `admin` call, its public
  `model`, whether it `generates` (takes a slot), the token estimates the reservation and a
  row without a usable figure are charged (`prompt_est`, `completion_est`), and the number
  of completions it asks for (`completions`: prompts x choices);
- what served it: the upstream (`up`, kept here because a reload may remove it from the
  relay's list meanwhile), the last `exchange` and the request's `hold` (before the first
  content event), and the CORS headers every answer of this request carries (`cors`);
- its OpenTelemetry span (`trace`, when that is on: ended at settlement).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only: the ledger imports no behaviour)
    from relay.http.fields import Headers
    from relay.observe.otel import Trace
    from relay.policy.budget import Reservation
    from relay.proxy.exchange import Exchange
    from relay.proxy.slots import Slot
    from relay.proxy.upstreams import Upstream
    from relay.store.admissions import AdmissionId
    from relay.stream.content_hold import Hold


class Ledger:
    __slots__ = (
        "admin",
        "admission",
        "completion_est",
        "completions",
        "cors",
        "exchange",
        "generates",
        "hold",
        "model",
        "prompt_est",
        "reservation",
        "slot",
        "trace",
        "up",
    )

    def __init__(self, cors: Headers) -> None:
        self.cors = cors
        self.admin = False
        self.model: str | None = None
        self.generates = False
        self.prompt_est = 0
        self.completion_est = 0
        self.completions = 1
        self.reservation: Reservation | None = None
        self.admission: AdmissionId | None = None
        self.slot: Slot | None = None
        self.up: Upstream | None = None
        self.exchange: Exchange | None = None
        self.hold: Hold | None = None
        self.trace: Trace | None = None  # its OpenTelemetry span, when that is on

    def release_slot(self) -> None:
        """Give the slot back (between candidates, and at settlement): at most once."""
        slot, self.slot = self.slot, None
        if slot is not None:
            slot.release()

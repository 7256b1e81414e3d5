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
  relay's list meanwhile), the last attempt's `exchange`, the request's `reply` (the
  response before its first content event), the CORS headers every answer of this request
  carries (`cors`), and the API its stream speaks (`api`: the path's guess, then what its
  events said);
- the facts its outcome is decided from at settlement (`policy.outcome`): the error it was
  `answered` with, a `cut` (the client left, or the drain ended it), what the wait for the
  client to read a finished response said (`drained`), a `bug`;
- its OpenTelemetry span (`trace`, when that is on: ended at settlement).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay.errors import RelayError
from relay.http.fields import Headers
from relay.policy.outcome import Cut, Drained
from relay.stream.dialect import Api

if TYPE_CHECKING:
    from relay.observe.otel import Trace
    from relay.policy.affinity import Reuse
    from relay.policy.budget import Reservation
    from relay.proxy.exchange import Exchange
    from relay.proxy.reply import Reply
    from relay.proxy.slots import SlotLease
    from relay.proxy.upstreams import Upstream
    from relay.store.admissions import AdmissionId


class Ledger:
    __slots__ = (
        "admin",
        "admission",
        "answered",
        "api",
        "bug",
        "completion_est",
        "completions",
        "cors",
        "cut",
        "drained",
        "exchange",
        "generates",
        "model",
        "prompt_est",
        "reply",
        "reservation",
        "slot",
        "trace",
        "up",
    )

    def __init__(self, cors: Headers, api: Api) -> None:
        self.cors = cors
        self.api = api
        self.admin = False
        self.model: str | None = None
        self.generates = False
        self.prompt_est = 0
        self.completion_est = 0
        self.completions = 1
        self.reservation: Reservation | None = None
        self.admission: AdmissionId | None = None
        self.slot: SlotLease | None = None
        self.up: Upstream | None = None
        self.exchange: Exchange | None = None
        self.reply: Reply | None = None
        self.answered: RelayError | None = None
        self.cut: Cut | None = None
        self.drained: Drained | None = None
        self.bug = False
        self.trace: Trace | None = None

    @property
    def stream_api(self) -> Api:
        """The API an in-band error speaks: the live exchange's stream's, else the last one's
        (`api`, the path's guess until a stream said)."""
        ex = self.exchange
        return ex.api if ex is not None and ex.ending is None else self.api

    @property
    def content_out(self) -> bool:
        """Content reached the client: nothing is swapped any more."""
        return self.reply is not None and self.reply.open

    def release_slot(self, reuse: Reuse | None = None) -> None:
        """Give the slot back (between candidates, and at settlement): at most once; `reuse`,
        what the member's answer said of its prompt cache when it served."""
        slot, self.slot = self.slot, None
        if slot is not None:
            slot.release(reuse)

"""The messages between the parent and its workers, and how they travel.

One Unix socket per worker (a socketpair made before the worker starts) carries them both
ways. Each message is a 4-byte big-endian length, then the msgpack of one of the structs
below: an array whose first item is the struct's tag (its kind), then its fields in order.
An `id` is the asking end's own number for an exchange, echoed in the answer; each end keeps
the answers it awaits by it (`Answers`). Both ends are this same program, so a pickled
`Registry` travels as bytes.

Worker -> parent (`ToParent`):
- `Ready`: it serves.
- `SlotAsk` -> `SlotAnswer`; `Unslot` (the waiter left: a slot granted is given back) and
  `Free` (a granted slot is released) end the exchange.
- `Admit` -> `AdmitAnswer` or `AdmitRefused`: a keyed request's reservation and admission
  record, with the `SlotAsk` of its first upstream's slot in the same message (answered as
  any `SlotAsk` is: relay.workers.ahead).
- `Row`: a settled request's row, never awaited.
- `Down` / `Up`: what a request found of an upstream; the parent's health follows and every
  worker is told (`Health`).
- `ViewAsk` -> `ViewAnswer`: one of the relay's own views, answered from the whole relay.
- `Figures` and `Reloaded`: the answers to `FiguresAsk` and `Reload`.

Parent -> worker: `Configure` first (the configuration to run), then `ToWorker`:
- the answers above; `Health` after every probe and every report;
- `FiguresAsk` ("send your metrics"), `Reload` (switch to this configuration, already applied
  by the parent);
- `Drain` (stop as SIGTERM does) and `Hurry` (end the drain now: a second signal).
"""

from __future__ import annotations

import asyncio
import enum
import struct
from collections.abc import Iterator
from typing import Generic, TypeVar

import msgspec

from relay.config import Config
from relay.observe.metrics import UpstreamState
from relay.observe.record import Record
from relay.observe.ui_state import Trended
from relay.policy.affinity import NO_WANT, Reuse, Want
from relay.policy.budget import BudgetExceeded
from relay.policy.routing import Pool
from relay.store.admissions import AdmissionId

_LEN = struct.Struct(">I")
# A view of many upstreams and keys stays far below this.
MAX_MESSAGE = 64 << 20


class SlotVerdict(enum.StrEnum):
    OK = "ok"
    BUSY = "busy"
    CLOSED = "closed"


class AdmitVerdict(enum.StrEnum):
    """What became of an admission the budgets allowed: its record committed, not committed
    in time, or not committed at all (the store fails). The request is served in each case,
    as in one process."""

    OK = "ok"
    TIMEOUT = "timeout"
    NOT_DURABLE = "not_durable"


# ---- worker -> parent ---------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True, frozen=True):
    pid: int
    index: int


class SlotAsk(msgspec.Struct, tag="slot", array_like=True, frozen=True):
    """A slot of one of the pool `pool`'s `members` (as the worker's configuration has them;
    none: the upstream named `pool` alone) but `exclude`; `want`, where in the pool the
    request's conversation is cached."""

    id: int
    pool: str
    timeout_s: float
    members: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    want: Want = NO_WANT
    # The request's key: its line in the pool's queue (`policy.fair`).
    key: str | None = None

    @property
    def of(self) -> Pool:
        return Pool(self.pool, self.members or (self.pool,))

    def asks_for(self, pool: Pool, exclude: frozenset[str], key: str | None) -> bool:
        """Whether this asks for what a request asks now."""
        return self.of == pool and set(self.exclude) == exclude and self.key == key


class Unslot(msgspec.Struct, tag="unslot", array_like=True, frozen=True):
    id: int


class Free(msgspec.Struct, tag="free", array_like=True, frozen=True):
    """`reuse`: what the member's answer said of its prompt cache, when it served."""

    id: int
    reuse: Reuse | None = None


class Admit(msgspec.Struct, tag="admit", array_like=True, frozen=True):
    """`admission`: the worker's own admission id, which the request's row names."""

    id: int
    admission: AdmissionId
    rec: Record
    prompt: int
    completion: int
    ahead: SlotAsk | None = None


class Row(msgspec.Struct, tag="row", array_like=True, frozen=True):
    """`trend`: how the page's trend takes the row (`App.put_row`)."""

    rec: Record
    admission: AdmissionId | None
    trend: Trended


class Down(msgspec.Struct, tag="down", array_like=True, frozen=True):
    upstream: str
    error: str


class Up(msgspec.Struct, tag="up", array_like=True, frozen=True):
    upstream: str


class ViewAsk(msgspec.Struct, tag="view", array_like=True, frozen=True):
    id: int
    path: str
    target: bytes


class Figures(msgspec.Struct, tag="figures", array_like=True, frozen=True):
    """`registry`: the worker's pickled `Registry`."""

    id: int
    registry: bytes


class Reloaded(msgspec.Struct, tag="reloaded", array_like=True, frozen=True):
    """`error`: why the worker could not apply the configuration, None when it did."""

    id: int
    error: str | None


ToParent = Ready | SlotAsk | Unslot | Free | Admit | Row | Down | Up | ViewAsk | Figures | Reloaded


# ---- parent -> worker ---------------------------------------------------------------------
class Configure(msgspec.Struct, tag="config", array_like=True, frozen=True):
    config: Config


class Health(msgspec.Struct, tag="health", array_like=True, frozen=True):
    upstream: str
    probe: UpstreamState
    error: str


class SlotAnswer(msgspec.Struct, tag="slot", array_like=True, frozen=True):
    """`member`: the upstream whose slot is given; `position`: the request's place among its
    key's waiting requests when it was queued (0: not queued), given a slot or not; `why`: the
    reason a slot was refused (`Busy`), empty otherwise."""

    id: int
    verdict: SlotVerdict
    why: str = ""
    member: str = ""
    position: int = 0


class AdmitAnswer(msgspec.Struct, tag="admit", array_like=True, frozen=True):
    """`why`: what failed, empty when the record is committed."""

    id: int
    verdict: AdmitVerdict
    why: str = ""


class AdmitRefused(msgspec.Struct, tag="exceeded", array_like=True, frozen=True):
    """The key's budget is spent: a `BudgetExceeded`, field for field."""

    id: int
    limit: str
    used: int
    requested: int
    limit_value: int
    resets_at: float

    @classmethod
    def of(cls, i: int, exc: BudgetExceeded) -> AdmitRefused:
        return cls(i, exc.limit, exc.used, exc.requested, exc.limit_value, exc.resets_at)

    def error(self, now: float) -> BudgetExceeded:
        return BudgetExceeded(
            self.limit, self.used, self.requested, self.limit_value, self.resets_at, now
        )


class ViewAnswer(msgspec.Struct, tag="view", array_like=True, frozen=True):
    id: int
    status: int
    body: bytes
    content_type: bytes
    headers: list[tuple[bytes, bytes]]


class FiguresAsk(msgspec.Struct, tag="figures", array_like=True, frozen=True):
    id: int


class Reload(msgspec.Struct, tag="reload", array_like=True, frozen=True):
    id: int
    config: Config


class Drain(msgspec.Struct, tag="drain", array_like=True, frozen=True):
    pass


class Hurry(msgspec.Struct, tag="hurry", array_like=True, frozen=True):
    pass


# What the parent tells a worker that is not an answer to it.
Told = Health | FiguresAsk | Reload | Drain | Hurry
ToWorker = SlotAnswer | AdmitAnswer | AdmitRefused | ViewAnswer | Told
Message = ToParent | ToWorker | Configure

FROM_WORKER = msgspec.msgpack.Decoder(ToParent)
FROM_PARENT = msgspec.msgpack.Decoder(ToWorker)
FIRST = msgspec.msgpack.Decoder(Configure)
_encode = msgspec.msgpack.Encoder().encode

M = TypeVar("M", bound=Message)
A = TypeVar("A")


def frame(message: Message) -> bytes:
    body = _encode(message)
    return _LEN.pack(len(body)) + body


class Outbox(Generic[M]):
    """One end's messages to the other, written together once per loop pass: a request's
    slot release and its row (or many requests' messages on a busy loop) cost one write."""

    __slots__ = ("_parts", "_writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._parts: list[bytes] = []

    def send(self, message: M) -> None:
        if self._writer.is_closing():
            return
        if not self._parts:
            asyncio.get_running_loop().call_soon(self.flush)
        self._parts.append(frame(message))

    def flush(self) -> None:
        parts, self._parts = self._parts, []
        if parts and not self._writer.is_closing():
            self._writer.write(b"".join(parts))


async def read(reader: asyncio.StreamReader, decoder: msgspec.msgpack.Decoder[M]) -> M | None:
    """The next message, or None at the end of the stream (the other process is gone). A
    process that ends with messages it never read resets its end (a worker killed while it
    was stopped): that is the end of the stream too."""
    try:
        head = await reader.readexactly(4)
        (n,) = _LEN.unpack(head)
        if n > MAX_MESSAGE:
            raise ValueError(f"message of {n} bytes")
        return decoder.decode(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return None


class Answers(Generic[A]):
    """The answers of one kind an end awaits, by exchange id. The ids come from `ids`, which
    an end shares between its kinds: an id names one exchange of that end."""

    __slots__ = ("_ids", "_waiting")

    def __init__(self, ids: Iterator[int]) -> None:
        self._ids = ids
        self._waiting: dict[int, asyncio.Future[A]] = {}

    def expect(self) -> tuple[int, asyncio.Future[A]]:
        """A new exchange: its id, and the future of its answer."""
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[i] = fut
        return i, fut

    def answered(self, i: int, answer: A) -> None:
        """An answer came: the one awaiting it has it (none left waiting: it is dropped)."""
        fut = self._waiting.pop(i, None)
        if fut is not None and not fut.done():
            fut.set_result(answer)

    def forget(self, i: int) -> None:
        self._waiting.pop(i, None)

    def cancel(self) -> None:
        """The other end is gone: no answer will come; each waiting future is cancelled."""
        for fut in self._waiting.values():
            fut.cancel()
        self._waiting.clear()

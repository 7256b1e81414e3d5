"""What a running simulator knows: its knobs, the requests it saw, its switches and counters.

`SimDefaults` are the server-wide knobs (the `relay sim` flags; a request's ``"sim"`` object
overrides them, plan.py); `SimRequest` is one request as the simulator saw it (tests read
``sim.requests``); `SimState` holds the switches, the counters /metrics reports, the requests,
the open connections and the slots. It sits below the code that serves (conn.py, gen.py,
server.py): they all read and count here, and it imports none of them.

Slots (slots.py has the rules). `parallel` slots, each with its prompt cache. A generation
asks for one with `begin`: a free slot is chosen as llama-server chooses, and the generation
runs with ``cache_n`` = the tokens that slot's cache spares (0 when the request sets
``"cache_prompt": false``). When every slot is busy:

- `defer` off (the default): the generation runs at once without a slot, as if it had one of
  its own with nothing cached: ``cache_n`` 0, and it leaves no cache behind. Many tests open
  more streams to one simulator than it has slots and expect them all to stream at once.
- `defer` on (``relay sim --defer``): it waits, first come first served, as llama-server
  defers a task, until a slot is released; it then starts (its head and delays counted from
  then) on the slot chosen among the free ones.

`end` releases a generation's slot when its request ends (finished, dropped, or its client
gone): the slot keeps the prompt and the reply's tokens (as the next turn renders the reply)
but the last one generated, that is ``prompt + generated - 1`` tokens, what llama-server's
``tokens_cached`` reports. A cut stream keeps the tokens sent but its last; no slot keeps more
than a context (2048 tokens) of a reply.

The counters, exact in both modes: `active_generations` counts every generation from its
request to its end, a waiting one too; /metrics' ``requests_processing`` is
``min(active, parallel)`` and ``requests_deferred`` the rest (with `defer` on, the running and
the waiting generations; off, those llama-server would have run and deferred); its
``prompt_tokens_total`` counts the prompt tokens processed (cached ones excluded) and
``prompt_tokens_cached_total`` those reused, as llama-server's. /slots shows each slot's
``is_processing`` and, once it took a task, that task's figures.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from relay.sim.slots import Slot, SlotView, choose, reuse
from relay.sim.tinymodel import N_CTX
from relay.sim.wire import Json, Shape


@dataclass
class SimDefaults:
    model: str = "models/tiny.gguf"
    tokens: int = 16
    interval_ms: float = 0.0
    first_token_delay_ms: float = 0.0
    head_delay_ms: float = 0.0
    # Keep the connection after a stream (as hosted APIs do), not close it.
    keep_streams: bool = False
    # Chat chunks in llama-server's, vLLM's or OpenAI's shape (shapes.py).
    shape: Shape = Shape.LLAMA
    events_per_chunk: int = 1
    chunks_per_write: int = 1
    # Prompt processing: this long per prompt token not reused from a slot's cache.
    prefill_ms_per_token: float = 0.0


@dataclass(frozen=True, slots=True)
class SlotAsk:
    """What a generation asks of the slots: its prompt's tokens, whether it may reuse a cache
    (the body's ``cache_prompt``), its token limit (-1 none), its reply's tokens once it
    generated n (as the next turn renders them), and `start`, called with the tokens reused
    when it may run."""

    tokens: list[int]
    cache_prompt: bool
    limit: int
    reply: Callable[[int], list[int]]
    start: Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Lease:
    """The slot a generation holds (None: it runs without one), and the tokens it reused."""

    slot: Slot | None
    cache_n: int


class _Held(NamedTuple):
    """A slot's generation while it runs: its request, what it asked and the tokens reused."""

    req: SimRequest
    ask: SlotAsk
    cache_n: int


@dataclass(eq=False)
class SimRequest:
    """One request as the simulator saw it; `is_generation` marks one that counts in
    SimState.active_generations until it is `closed`; `lease` is a generation's slot and
    reuse once it runs (None while it waits)."""

    method: str
    path: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    json: Json | None = None
    started_at: float = 0.0
    tokens_sent: int = 0
    completion_tokens: int | None = None
    finished: bool = False
    peer_closed_at: float | None = None
    status: int | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    is_generation: bool = field(default=False, repr=False)
    lease: Lease | None = field(default=None, repr=False)


class Connection(Protocol):
    """An open client connection, as the state holds it (conn.py's protocol)."""

    def abort(self) -> None: ...


class SimState:
    """The switches, counters, requests, connections and slots of one simulator
    (server.Simulator).

    `loading` answers 503 "Loading model" on generation, health and embeddings; `parallel`
    is the number of slots (set it while no generation runs); `slot_prompt_similarity` is
    llama-server's threshold for choosing a slot by its cache (0: least recently used only);
    `defer` makes a generation wait for a slot rather than run without one; an idle
    connection stays open `keepalive_timeout` seconds."""

    def __init__(self, defaults: SimDefaults | None = None) -> None:
        self.defaults = defaults or SimDefaults()
        self.loading = False
        self.slots: list[Slot] = []
        self.parallel = 2
        self.slot_prompt_similarity = 0.1
        self.defer = False
        self.keepalive_timeout = 5.0
        self.requests: list[SimRequest] = []
        self.tokens_sent_total = 0
        self.prompt_tokens_total = 0
        self.prompt_tokens_cached_total = 0
        self.active_generations = 0
        self.connections_opened = 0
        self.connections_closed = 0
        self.start_time = time.time()
        self._conns: set[Connection] = set()
        self._waiting: deque[tuple[SimRequest, SlotAsk]] = deque()
        self._held: dict[int, _Held] = {}
        self._ticks = 0
        self._tasks = 0

    @property
    def parallel(self) -> int:
        return len(self.slots)

    @parallel.setter
    def parallel(self, n: int) -> None:
        """Slots 0..n-1: the ones there are keep their caches, new ones start empty."""
        self.slots = self.slots[:n] + [Slot(i) for i in range(len(self.slots), n)]

    @property
    def waiting(self) -> int:
        """Generations waiting for a slot (with `defer` on)."""
        return len(self._waiting)

    def begin(self, req: SimRequest, ask: SlotAsk) -> None:
        """A generation asks for a slot: it starts now on a free one (or, with `defer` off and
        none free, without one), or waits for one."""
        slot = choose(self.slots, ask.tokens, self.slot_prompt_similarity)
        if slot is None and self.defer and self.slots:
            self._waiting.append((req, ask))
            return
        self._grant(req, ask, slot)

    def _grant(self, req: SimRequest, ask: SlotAsk, slot: Slot | None) -> None:
        cache_n = 0
        if slot is not None:
            if ask.cache_prompt:
                cache_n = reuse(slot.tokens, ask.tokens)
            slot.busy = True
            slot.task = self._tasks
            self._tasks += 1
            self._held[slot.id] = _Held(req, ask, cache_n)
        req.lease = Lease(slot, cache_n)
        self.prompt_tokens_total += len(ask.tokens) - cache_n
        self.prompt_tokens_cached_total += cache_n
        ask.start(cache_n)

    def end(self, req: SimRequest) -> None:
        """A generation's request ended: its slot keeps the prompt and the reply decoded, and
        goes to the oldest waiting generation; a waiting one leaves the queue."""
        lease = req.lease
        if lease is None:
            for i, (r, _) in enumerate(self._waiting):
                if r is req:
                    del self._waiting[i]
                    break
            return
        slot = lease.slot
        held = self._held.get(slot.id) if slot is not None else None
        if slot is None or held is None or held.req is not req:
            return
        del self._held[slot.id]
        made = req.completion_tokens if req.completion_tokens is not None else req.tokens_sent
        # A slot's context bounds the reply it keeps (and the work an endless stream costs).
        made = min(made, N_CTX + 1)
        slot.tokens = held.ask.tokens + held.ask.reply(made)[: max(made - 1, 0)]
        slot.busy = False
        slot.last_used = self._ticks
        self._ticks += 1
        while self._waiting:
            nxt = choose(self.slots, self._waiting[0][1].tokens, self.slot_prompt_similarity)
            if nxt is None:
                break
            r, ask = self._waiting.popleft()
            self._grant(r, ask, nxt)

    def slot_views(self) -> list[SlotView]:
        """Each slot as /slots shows it."""
        out = []
        for s in self.slots:
            held = self._held.get(s.id)
            if held is None:
                out.append(SlotView(s.id, s.busy, s.task, len(s.tokens), 0, 0, -1, 0))
                continue
            req, ask, cache_n = held
            remain = ask.limit - req.tokens_sent if ask.limit >= 0 else -1
            n = len(ask.tokens)
            out.append(
                SlotView(s.id, True, s.task, n, n - cache_n, cache_n, remain, req.tokens_sent)
            )
        return out

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def track(self, conn: Connection) -> None:
        """A connection opened: counted, and aborted by Simulator.stop while it stays open."""
        self.connections_opened += 1
        self._conns.add(conn)

    def untrack(self, conn: Connection) -> None:
        """A connection closed: counted, and no longer held."""
        self._conns.discard(conn)
        self.connections_closed += 1

    def metrics_values(self) -> dict[str, float]:
        busy = self.active_generations
        return {
            "prompt_tokens_total": self.prompt_tokens_total,
            "prompt_tokens_cached_total": self.prompt_tokens_cached_total,
            "tokens_predicted_total": self.tokens_sent_total,
            "n_decode_total": self.tokens_sent_total,
            "requests_processing": min(busy, self.parallel),
            "requests_deferred": max(0, busy - self.parallel),
        }

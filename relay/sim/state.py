"""What a running simulator knows: its knobs, the requests it saw, its switches and counters.

`SimDefaults` are the server-wide knobs (the `relay sim` flags; a request's ``"sim"`` object
overrides them, plan.py); `SimRequest` is one request as the simulator saw it (tests read
``sim.requests``); `SimState` holds the switches, the counters /metrics reports, the requests
and the open connections. It sits below the code that serves (conn.py, gen.py, server.py):
they all read and count here, and it imports none of them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

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


@dataclass(eq=False)
class SimRequest:
    """One request as the simulator saw it; `is_generation` marks one that counts in
    SimState.active_generations until it is `closed`."""

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


class Connection(Protocol):
    """An open client connection, as the state holds it (conn.py's protocol)."""

    def abort(self) -> None: ...


class SimState:
    """The switches, counters, requests and connections of one simulator (server.Simulator).

    `loading` answers 503 "Loading model" on generation, health and embeddings; `parallel`
    is the slots /props, /slots and /metrics' requests_processing report; an idle connection
    stays open `keepalive_timeout` seconds."""

    def __init__(self, defaults: SimDefaults | None = None) -> None:
        self.defaults = defaults or SimDefaults()
        self.loading = False
        self.parallel = 2
        self.keepalive_timeout = 5.0
        self.requests: list[SimRequest] = []
        self.tokens_sent_total = 0
        self.prompt_tokens_total = 0
        self.active_generations = 0
        self.connections_opened = 0
        self.connections_closed = 0
        self.start_time = time.time()
        self._conns: set[Connection] = set()

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
            "tokens_predicted_total": self.tokens_sent_total,
            "n_decode_total": self.tokens_sent_total,
            "requests_processing": min(busy, self.parallel),
            "requests_deferred": max(0, busy - self.parallel),
        }

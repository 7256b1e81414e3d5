"""One streamed generation of the simulator: frames paced by a loop.call_at chain.

The head is due `head_delay` after the generation may run (its request, or the slot it waited
for), the first token `ftd` plus the prompt's prefill after that, at t0; token i is due at
t0 + i*interval (no drift), each event is one transport.write (or, with the
events_per_chunk / chunks_per_write knobs, a group of them when its last one is due), and
production stops while the connection's transport is paused. Knobs (stall, drop, mid-line
or mid-chunk cuts, content-length bodies) come from the request's plan (plan.Plan). What it
uses of its connection is the `Link` protocol below, which conn.py's connection satisfies, so
this module needs nothing from conn.py.
"""

from __future__ import annotations

import asyncio
from enum import Enum
from typing import Protocol

from relay.sim import wire as W
from relay.sim.completion import timings
from relay.sim.frames import StreamFrames
from relay.sim.plan import Cut, Plan
from relay.sim.state import SimRequest, SimState
from relay.sim.wire import Kind, Timings


class Link(Protocol):
    """What a Gen uses of its connection (read-only here, so plain attributes satisfy it).

    `paused` is set while the transport asks us to stop writing; `keep_alive` while the
    connection stays open after this response; `sim` is where the tokens sent are counted;
    `finish_stream` ends the response once its last bytes are written."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...
    @property
    def transport(self) -> asyncio.WriteTransport: ...
    @property
    def paused(self) -> bool: ...
    @property
    def keep_alive(self) -> bool: ...
    @property
    def sim(self) -> SimState: ...

    def abort(self) -> None: ...
    def finish_stream(self) -> None: ...


class GenState(Enum):
    """Where a Gen is: waiting to send its head, producing events, stalled on purpose (the
    connection held open), or done (finished, dropped or cancelled)."""

    HEAD = "head"
    RUN = "run"
    STALLED = "stalled"
    DONE = "done"


# The per-tick check compares with this module-level name: on Python 3.11 a member's lookup on
# its enum class goes through the metaclass's attribute hook, several times a string compare.
_RUN = GenState.RUN


class Gen:
    """One streamed generation response, driven by a call_at chain."""

    __slots__ = (
        "at",
        "cl_tail",
        "conn",
        "frames",
        "handle",
        "i",
        "plan",
        "req",
        "role",
        "state",
        "stop_at",
        "t0",
    )

    def __init__(
        self,
        conn: Link,
        req: SimRequest,
        plan: Plan,
        frames: StreamFrames,
        at: float | None = None,
    ) -> None:
        self.conn, self.req, self.plan, self.frames = conn, req, plan, frames
        # When it may run: its request's arrival, or the slot it waited for.
        self.at = req.started_at if at is None else at
        self.i = 0
        self.handle: asyncio.Handle | None = None
        self.state = GenState.HEAD
        self.role: bytes | None = None
        self.cl_tail = b""
        lim = [x for x in (plan.stall_after, plan.drop_after, plan.n) if x is not None and x >= 0]
        self.stop_at = min(lim) if lim else None
        self.t0 = self.at + plan.head_delay + plan.prefill + plan.ftd

    def start(self) -> None:
        if self.plan.head_delay > 0:
            self.handle = self.conn.loop.call_at(self.at + self.plan.head_delay, self._head)
        else:
            self._head()

    def cancel(self) -> None:
        self.state = GenState.DONE
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def resume(self) -> None:
        if self.state is GenState.RUN and self.handle is None:
            self.handle = self.conn.loop.call_soon(self._tick)

    def _tail_payloads(self, tm: Timings) -> list[bytes]:
        p, f = self.plan, self.frames
        n = p.n or 0
        parts = [
            f.stop_token_event(n, p.predicted_n, p.stop_word, p.eos, tm),
            f.final_events(n, p.predicted_n, p.finish, tm, p.stop_word, p.settings, p.prompt),
            f.done_event,
        ]
        return [x for x in parts if x]

    def _tail(self, tm: Timings) -> bytes:
        parts = self._tail_payloads(tm)
        if self.plan.content_length:
            return b"".join(parts)
        return b"".join(map(W.chunk, parts)) + W.TERMINATOR

    def _head(self) -> None:
        self.handle = None
        p, f = self.plan, self.frames
        role = f.role_event()
        keep = self.conn.keep_alive
        if p.content_length:
            n = p.n or 0
            ms = (p.ftd + max(n - 1, 0) * p.interval) * 1e3
            self.cl_tail = self._tail(
                timings(p.processed, p.predicted_n, ms, p.cache_n, p.prompt_ms)
            )
            length = f.body_len(n) + len(role or b"") + len(self.cl_tail)
            head = W.head(200, W.SSE_CT, length=length, sse=True, close=not keep)
        elif f.kind == Kind.OCTET or not keep:
            head = W.head(200, f.content_type, sse=True, close=not keep)
        else:
            head = W.SSE_HEAD
        if role is not None and (p.ftd > 0 or p.prefill > 0 or self.stop_at == 0):
            head += role if p.content_length else W.chunk(role)
        else:
            self.role = role
        self.conn.transport.write(head)
        self.state = GenState.RUN
        self._tick()

    def _frame(self, i: int) -> bytes:
        if self.role is not None:
            data, self.role = self.role + self.frames.event(i), None
            return data if self.plan.content_length else W.chunk(data)
        return self.frames.event(i) if self.plan.content_length else self.frames.chunk(i)

    def _frames(self, i: int, j: int) -> bytes:
        """Content events i..j-1 in one write: `events_per_chunk` of them to a chunk."""
        evs = [self.frames.event(k) for k in range(i, j)]
        if self.role is not None:
            evs[0], self.role = self.role + evs[0], None
        if self.plan.content_length:
            return b"".join(evs)
        per = self.plan.events_per_chunk
        return b"".join(W.chunk(b"".join(evs[k : k + per])) for k in range(0, len(evs), per))

    def _tick(self) -> None:
        self.handle = None
        c = self.conn
        if self.state is not _RUN or c.paused:
            return
        loop, tr, req, sim = c.loop, c.transport, self.req, c.sim
        now, iv, t0, stop_at = loop.time() + 0.001, self.plan.interval, self.t0, self.stop_at
        budget = 256
        # The events of one write; a group goes out when its last event is due.
        group = self.plan.events_per_chunk * self.plan.chunks_per_write
        while True:
            i = self.i
            if i == stop_at:
                self._boundary()
                return
            j = i + group if stop_at is None else min(i + group, stop_at)
            due = t0 + (j - 1) * iv
            if due > now:
                self.handle = loop.call_at(due, self._tick)
                return
            if budget == 0:
                self.handle = loop.call_soon(self._tick)
                return
            tr.write(self._frame(i) if group == 1 else self._frames(i, j))
            self.i = j
            req.tokens_sent += j - i
            sim.tokens_sent_total += j - i
            budget -= 1
            if c.paused:
                return

    def _boundary(self) -> None:
        """The stop point is reached: drop the connection, stall (maybe inside the next
        event), or send the tail and finish."""
        p, i = self.plan, self.i
        if p.drop_after is not None and i == p.drop_after:
            self.state = GenState.DONE
            self.conn.abort()
            return
        if p.stall_after is not None and i == p.stall_after:
            self.state = GenState.STALLED
            if p.stall_cut is not Cut.NONE:
                self._cut_short(i)
            return
        self.state = GenState.DONE
        self.conn.transport.write(self.cl_tail if p.content_length else self._tail(self._timings()))
        self.req.completion_tokens = p.predicted_n
        self.conn.finish_stream()

    def _cut_short(self, i: int) -> None:
        """A stall's cut: half of what comes next (event i, or the tail's first event), inside
        its ``data:`` line or its chunk."""
        p = self.plan
        if p.n is None or i < p.n:
            nxt = (self.role or b"") + self.frames.event(i)
        else:
            nxt = (self._tail_payloads(self._timings()) or [b""])[0]
        if not nxt:
            return
        half = nxt[: len(nxt) // 2]
        if p.content_length:
            self.conn.transport.write(half)
        elif p.stall_cut is Cut.MID_LINE:
            self.conn.transport.write(W.chunk(half))
        else:
            self.conn.transport.write(b"%x\r\n" % len(nxt) + half)

    def _timings(self) -> Timings:
        p = self.plan
        ms = (self.conn.loop.time() - self.t0) * 1000.0 if self.i else 0.0
        return timings(p.processed, p.predicted_n, ms, p.cache_n, p.prompt_ms)

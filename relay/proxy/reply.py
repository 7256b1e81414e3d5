"""A request's response until its first content event: the hold's steps written to the client,
and the heartbeat's timer.

The hold (`stream.content_hold`) decides what is held and what goes out; a `Reply` writes each
step through the connection's `ClientWriter` and keeps the heartbeat: a streamed request
that got nothing for `heartbeat_s` gets a 200 event-stream head and a heartbeat comment each
`heartbeat_s` until content. The timer is re-armed lazily from the last write to the client;
it is one deadline among every stream's (`deadlines`: one loop timer for all), not a loop timer
of its own, since a stream waiting for its first token keeps it the whole wait.
When a heartbeat falls due while an exchange holds its upstream's head, the exchange commits
with that head (`EarlyCommit`, attached while it holds one); otherwise the relay's own head
goes out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from relay.errors import UpstreamErrorFields
from relay.http.response_framing import BodyKind, Carriage
from relay.http.response_head import ResponseHead
from relay.proxy.client_writer import ClientWriter
from relay.proxy.deadlines import Deadlines, Due
from relay.stream.content_hold import COMMITTED, NOTHING, OPEN, WRITTEN, Hold, Out, Took
from relay.stream.dialect import Api


class EarlyCommit(Protocol):
    """An exchange holding its upstream's head: it commits with it when a heartbeat is due."""

    def commit_early(self) -> None: ...


class Reply(Due):
    """The heartbeat's deadline is this reply's (`Due.deadline`) while armed."""

    __slots__ = (
        "deadlines",
        "hold",
        "holder",
        "interval",
        "loop",
        "since",
        "stamp",
        "timer_at",
        "writer",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        writer: ClientWriter,
        hold: Hold,
        interval: float,
        deadlines: Deadlines,
    ) -> None:
        self.loop = loop
        self.deadlines = deadlines
        self.writer = writer
        self.hold = hold
        # heartbeat_s; 0: never commit early.
        self.interval = interval
        self.holder: EarlyCommit | None = None
        # The relay's Server-Timing line for the upstream's head, made as it goes out.
        self.stamp: Callable[[], bytes] | None = None
        self.deadline = None
        self.timer_at = 0.0
        self.since = 0.0

    # ---- what the hold says ----------------------------------------------------------
    @property
    def open(self) -> bool:
        """Content reached the client."""
        return self.hold.state is OPEN

    @property
    def committed(self) -> bool:
        """A head and comments only reached the client (heartbeats)."""
        return self.hold.state is COMMITTED

    @property
    def beats(self) -> int:
        return self.hold.beats

    def error(self) -> UpstreamErrorFields | None:
        return self.hold.error()

    # ---- heartbeat ---------------------------------------------------------------------
    def start(self) -> None:
        if self.interval > 0:
            self.since = self.loop.time()
            self._arm(self.since + self.interval)

    def _arm(self, at: float) -> None:
        self.timer_at = at
        self.deadlines.add(at, self)

    def fire(self) -> None:
        """The heartbeat's deadline is up: a heartbeat, or armed again from the last write."""
        hold, writer = self.hold, self.writer
        if hold.over or writer.gone:
            return
        due = max(self.since, writer.last_at) + self.interval
        if due > self.timer_at:
            # Something went out since: look again then.
            self._arm(due)
            return
        if self.holder is not None and not hold.committed:
            self.holder.commit_early()
            if not hold.committed:
                return
        writer.write(hold.beat())
        self._arm(writer.last_at + self.interval)

    def close(self) -> None:
        """No more heartbeats (the hold opened, or the request ends)."""
        self.holder = None
        self.stamp = None
        self.deadlines.cancel(self)

    # ---- the exchange holding its head -------------------------------------------------
    def hold_head(
        self,
        head: bytes,
        frames: bool,
        holder: EarlyCommit | None,
        stamp: Callable[[], bytes] | None = None,
    ) -> None:
        """The head an exchange would send (`frames`: the relay frames the body after it);
        `holder` commits with it if a heartbeat falls due meanwhile; `stamp` makes the
        relay's Server-Timing line it goes out with."""
        self.hold.hold_head(head, frames)
        self.holder = holder
        self.stamp = stamp

    def detach(self, holder: EarlyCommit) -> None:
        if self.holder is holder:
            self.holder = None

    def commit_upstream(self, resp: ResponseHead, kind: BodyKind, mode: Carriage) -> bytes:
        """Commit with the upstream's own head; what was held comes back as body payload."""
        self.holder = None
        out, held = self.hold.commit_upstream(resp, kind, mode)
        self._write(out)
        return held

    def _write(self, out: Out) -> None:
        """One step of the hold out; the upstream's head, the first time, with the relay's
        Server-Timing line (`stamp`) added last."""
        stamp = self.stamp
        if stamp is not None and out.head:
            self.stamp = None
            out = Out(out.head[:-2] + stamp() + b"\r\n\r\n", out.pieces, out.frames, out.end)
        self.writer.write(out)

    # ---- body pieces -------------------------------------------------------------------
    def take(self, piece: bytes, content: bool, error_first: bool, more: bool) -> Took:
        took, out = self.hold.take(piece, content, error_first, more)
        if out is not NOTHING:
            self._write(out)
        if took is WRITTEN:
            self.close()
        return took

    def release(self) -> None:
        """What is held goes out: the client is open from here."""
        self._write(self.hold.release())
        self.close()

    def finish(self) -> None:
        """The upstream's body ended cleanly while held: it all goes out, and the end."""
        self._write(self.hold.finish())
        self.close()

    def fail(self, message: str, type_: str, code: str | None, api: Api) -> bool:
        """End the committed response with one in-band error; whether the connection may
        stay open."""
        out, keep_alive = self.hold.fail(message, type_, code, api)
        self.writer.write(out)
        self.close()
        return keep_alive

    def retry(self) -> None:
        """The next candidate starts."""
        self.holder = None
        self.stamp = None
        self.hold.retry()

"""One candidate's attempt at a request, up to its response head: a slot, then a connection,
the request sent, the head awaited.

A failure here is a `Retry` when the next candidate may still serve (busy, down, refused
connection, no or a malformed head, too slow); a refusal that ends the request (draining,
a target that cannot go under the upstream's path prefix) is a RelayError.
"""

from __future__ import annotations

import asyncio
import time

from relay.errors import Code, Details, RelayError, shutting_down
from relay.http.to_upstream import request_bytes, upstream_request_headers
from relay.http.upstream_url import TargetError
from relay.observe.record import Record
from relay.observe.row_timings import round3
from relay.policy.affinity import Want
from relay.policy.model_map import served_name, with_model
from relay.policy.routing import Pool
from relay.proxy.app_view import AppView
from relay.proxy.client import ClientConn
from relay.proxy.exchange import (
    ClientGone,
    Exchange,
    Hop,
    Relaying,
    RelayShutdown,
    UpstreamBadHead,
    UpstreamGone,
)
from relay.proxy.ledger import Ledger
from relay.proxy.pool import ConnectError, UpstreamConn
from relay.proxy.request import Request
from relay.proxy.slots import Busy, SlotsClosed
from relay.proxy.upstreams import Upstream


class Retry(Exception):
    """A failure before the first content event: the next candidate may serve."""

    def __init__(self, err: RelayError) -> None:
        super().__init__(err.message)
        self.err = err


def unavailable(up: Upstream, message: str, **details: str | int) -> Retry:
    facts: Details = {"upstream": up.name, **details}
    return Retry(RelayError(Code.UPSTREAM_UNAVAILABLE, message, facts))


class PoolBusy(Retry):
    """No slot of the pool came free (or its queue is full): the next candidate may serve."""


async def take_slot(
    app: AppView, pool: Pool, want: Want, exclude: frozenset[str], rec: Record, ledger: Ledger
) -> str:
    """Wait for a slot of one of the pool's members but `exclude` (the queue wait goes in the
    row and the metrics of the member given, or for a busy pool of its first member): the
    member's name."""
    d = app.config.dispatcher
    q0 = time.perf_counter()
    up = ledger.up
    try:
        slot = ledger.slot = await app.balancer.acquire(
            pool, want, d.pool_timeout_s, exclude, ledger.admission, rec.key_id
        )
    except SlotsClosed:
        # The relay began draining while this request queued.
        raise shutting_down() from None
    except Busy as exc:
        if exc.position:
            # It was queued: its row says where, as a served one's does.
            rec.queue_position = exc.position
        retry_after = max(1, int(d.pool_timeout_s + 0.999))
        many = len(pool.members) > 1
        raise PoolBusy(
            RelayError(
                Code.UPSTREAM_BUSY,
                f"{'every upstream of ' if many else 'upstream '}{pool.name} is busy: {exc}",
                {"upstream": pool.name},
                [(b"Retry-After", b"%d" % retry_after)],
            )
        ) from None
    finally:
        waited = time.perf_counter() - q0
        rec.queue_ms = round3(waited * 1000)
        granted = ledger.slot
        if granted is not None:
            up = app.upstreams.get(granted.member) or up
        if up is not None:
            up.metrics.observe_queue_wait(waited)
    if slot.position:
        rec.queue_position = slot.position
    return slot.member


def request_to(app: AppView, up: Upstream, req: Request, rid: bytes, ledger: Ledger) -> bytes:
    """The request's bytes as this upstream gets them: the target under its path prefix, the
    model under its name for it, the headers that cross."""
    try:
        # Under the URL's path prefix, if any.
        target = up.target.join(req.target)
    except TargetError as exc:
        raise RelayError(
            Code.BAD_REQUEST, f"upstream {up.name}: {exc}", {"upstream": up.name}
        ) from None
    body = req.body
    name = served_name(up.cfg.model_map, ledger.model)
    if name is not None:
        # This upstream knows the model by another name.
        body = with_model(body, name)
    # The caller's credential is the upstream's to check unless the relay checked it (API
    # keys, or its admin key on an admin call) or sends its own.
    auth = app.auth
    mine = auth.enabled or (ledger.admin and auth.admin is not None)
    head = upstream_request_headers(
        req.headers,
        up.host_header,
        len(body),
        rid,
        up.auth,
        up.static,
        pass_credentials=not mine and up.auth is None,
        trace=ledger.trace.headers if ledger.trace is not None else (),
    )
    return request_bytes(req.method, target, head, body)


async def open_exchange(
    app: AppView, client: ClientConn, req: Request, up: Upstream, rid: bytes, ledger: Ledger,
    hop: Hop,
) -> Exchange:  # fmt: skip
    """Connect (pooled or new), send the request, wait for the response head.

    The exchange starts relaying the body as soon as the head is in, without waiting for
    this coroutine to wake up; only a 429/5xx with another candidate left is held back.

    A pooled connection that turns out dead before one response byte is retried once on
    a fresh connection: llama-server closes after every stream.
    """
    d = app.config.dispatcher
    reply = ledger.reply
    assert reply is not None
    sent = request_to(app, up, req, rid, ledger)
    fresh = False
    while True:
        if app.draining:
            # No upstream stream starts once the drain began.
            raise shutting_down()
        try:
            conn, reused = await up.pool.acquire(d.connect_timeout_s, fresh=fresh)
        except ConnectError as exc:
            up.health.connect_failed(str(exc))
            raise unavailable(
                up, f"upstream {up.name} is unavailable: {exc}", error=str(exc)
            ) from None
        relaying = Relaying(app.loop, app.deadlines, app.policy, d.write_timeout_s)
        ex = Exchange(relaying, conn, req, reply, hop)
        ledger.exchange = ex
        conn.used = True
        conn.handler = ex
        client.exchange = ex
        transport = conn.transport
        assert transport is not None
        transport.write(sent)
        ex.sent_at = time.perf_counter()
        # One deadline among every stream's (`Exchange.fire`), not a loop timer of its own: a
        # slow upstream keeps many requests waiting here.
        deadlines = app.deadlines
        deadlines.add(app.loop.time() + d.direct_read_timeout_s, ex)
        head = ex.head_fut
        assert head is not None
        try:
            await head
        except UpstreamGone as exc:
            client.exchange = None
            conn.abort()
            if reused and exc.silent and not fresh:
                fresh = True
                continue
            raise unavailable(up, str(exc), error="closed") from None
        except (UpstreamBadHead, TimeoutError, ClientGone, RelayShutdown) as exc:
            client.exchange = None
            raise _head_failure(up, conn, exc, d.direct_read_timeout_s) from None
        except BaseException:
            client.exchange = None
            raise
        finally:
            deadlines.cancel(ex)
            # Seen (or failed, holding an exception whose frames hold the exchange): not kept.
            ex.head_fut = None
        up.health.answered()
        return ex


def _head_failure(
    up: Upstream, conn: UpstreamConn, exc: Exception, timeout: float
) -> BaseException:
    """What a wait for a head that ended without one raises: the next candidate's turn
    (`Retry`), the relay's drain (503), or the request's cancel (the client left)."""
    if isinstance(exc, ClientGone):
        return asyncio.CancelledError()
    if isinstance(exc, RelayShutdown):
        return shutting_down()
    conn.abort()
    if isinstance(exc, UpstreamBadHead):
        err = RelayError(
            Code.UPSTREAM_BAD_RESPONSE,
            "upstream sent a malformed response",
            {"upstream": up.name, "error": str(exc)[:200]},
        )
    else:
        err = RelayError(
            Code.UPSTREAM_TIMEOUT,
            f"upstream {up.name} sent no response head within {timeout}s",
            {"upstream": up.name},
        )
    return Retry(err)

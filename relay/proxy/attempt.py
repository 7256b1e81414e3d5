"""One candidate's attempt at a request, up to its response head: a slot, then a connection,
the request sent, the head awaited.

A failure here is a `Retry` when the next candidate may still serve (busy, down, refused
connection, no or a malformed head, too slow); a refusal that ends the request (draining,
a target that cannot go under the upstream's path prefix) is a RelayError.
"""

from __future__ import annotations

import asyncio
import time

from relay.errors import RelayError, shutting_down
from relay.http.to_upstream import request_bytes, upstream_request_headers
from relay.http.upstream_url import TargetError
from relay.observe.record import Record
from relay.observe.row_timings import round3
from relay.policy.model_map import served_name, with_model
from relay.proxy.exchange import Exchange
from relay.proxy.ledger import Ledger
from relay.proxy.pool import ConnectError
from relay.proxy.slots import Busy, SlotsClosed
from relay.stream import endings as E


class Retry(Exception):
    """A failure before the first content event: the next candidate may serve."""

    def __init__(self, err: RelayError) -> None:
        super().__init__(err.message)
        self.err = err


def unavailable(up, message: str, **details) -> Retry:
    return Retry(RelayError("upstream_unavailable", message, {"upstream": up.name, **details}))


async def take_slot(app, up, rec: Record, ledger: Ledger) -> None:
    """Wait for one of the upstream's slots (the queue wait goes in the row and metrics)."""
    d = app.config.dispatcher
    q0 = time.perf_counter()
    try:
        ledger.slot = await up.slots.acquire(d.pool_timeout_s, ledger.admission)
    except SlotsClosed:  # the relay began draining while this request queued
        raise shutting_down() from None
    except Busy as exc:
        retry_after = max(1, int(d.pool_timeout_s + 0.999))
        raise Retry(
            RelayError(
                "upstream_busy",
                f"upstream {up.name} is busy: {exc}",
                {"upstream": up.name},
                [(b"Retry-After", b"%d" % retry_after)],
            )
        ) from None
    finally:
        waited = time.perf_counter() - q0
        rec.queue_ms = round3(waited * 1000)
        up.metrics.observe_queue_wait(waited)


def request_to(app, up, req, rid: bytes, ledger: Ledger) -> bytes:
    """The request's bytes as this upstream gets them: the target under its path prefix, the
    model under its name for it, the headers that cross."""
    try:
        target = up.target.join(req.target)  # under the URL's path prefix, if any
    except TargetError as exc:
        raise RelayError(
            "bad_request", f"upstream {up.name}: {exc}", {"upstream": up.name}
        ) from None
    body = req.body
    name = served_name(up.cfg.model_map, ledger.model)
    if name is not None:  # this upstream knows the model by another name
        body = with_model(body, name)
    # the caller's credential is the upstream's to check unless the relay checked it
    # (API keys, or its admin key on an admin call) or sends its own
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
    app, client, req, up, rid: bytes, rec: Record, on_content, ledger: Ledger
) -> Exchange:
    """Connect (pooled or new), send the request, wait for the response head.

    The exchange starts relaying the body as soon as the head is in, without waiting for
    this coroutine to wake up; only a 429/5xx with another candidate left is held back.

    A pooled connection that turns out dead before one response byte is retried once on
    a fresh connection: llama-server closes after every stream.
    """
    d = app.config.dispatcher
    hold = ledger.hold
    assert hold is not None  # (the request's, made before its first candidate)
    sent = request_to(app, up, req, rid, ledger)
    fresh = False
    while True:
        if app.draining:  # no upstream stream starts once the drain began
            raise shutting_down()
        try:
            conn, reused = await up.pool.acquire(d.connect_timeout_s, fresh=fresh)
        except ConnectError as exc:
            up.health.connect_failed(str(exc))
            raise unavailable(
                up, f"upstream {up.name} is unavailable: {exc}", error=str(exc)
            ) from None
        ex = Exchange(
            app.loop,
            conn,
            client,
            req.method,
            rid,
            app.policy,
            d.write_timeout_s,
            rec.path,
            rec.model or "",
            up.name,
            hold,
            app.deadlines,
        )
        ex.on_content = on_content
        ledger.exchange = ex
        conn.used = True
        conn.handler = ex
        client.exchange = ex
        conn.transport.write(sent)
        timer = app.loop.call_later(d.direct_read_timeout_s, ex.head_timeout)
        head_fut = ex.head_fut
        assert head_fut is not None  # (made with the exchange; dropped once seen)
        try:
            await head_fut
            ex.head_fut = None  # (seen: not kept for the stream)
            up.health.answered()
            return ex
        except E.UpstreamGone as exc:
            conn.abort()
            if reused and exc.silent and not fresh:
                fresh = True
                ex.head_fut = None  # (it holds the exception, whose frames hold `ex`)
                continue
            raise unavailable(up, str(exc), error="closed") from None
        except E.UpstreamBadHead as exc:
            conn.abort()
            raise Retry(
                RelayError(
                    "upstream_bad_response",
                    "upstream sent a malformed response",
                    {"upstream": up.name, "error": str(exc)[:200]},
                )
            ) from None
        except E.ClientGone:
            raise asyncio.CancelledError from None
        except E.RelayShutdown:
            rec.outcome = rec.error_code = E.SHUTDOWN  # as a stream cut by shutdown is
            raise shutting_down() from None
        except TimeoutError:
            conn.abort()
            raise Retry(
                RelayError(
                    "upstream_timeout",
                    f"upstream {up.name} sent no response head within {d.direct_read_timeout_s}s",
                    {"upstream": up.name},
                )
            ) from None
        except BaseException:
            client.exchange = None
            raise
        finally:
            timer.cancel()

"""The life of one request: admission, candidates, relay, and settlement exactly once.

Admission (the head was already judged by the client connection, `admission.head_check`):
the relay's own endpoints (`endpoints`) -> key (401) -> body peek (400) -> route (404) ->
budget reservation (429) -> durable admission -> per candidate (`attempt`): slot (503) ->
upstream (502/504) -> relay. Before the first content event reaches the client a retryable
failure moves on to the next candidate; after it nothing is swapped. What the request holds
and learns is written in its `Ledger`; every request ends in `settle.settle`, once.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time

from relay.errors import RelayError, shutting_down, upstream_error
from relay.http.fields import get as header
from relay.http.request_path import bounded
from relay.observe.record import Record, user_agent
from relay.policy import admission as A
from relay.policy.budget import BudgetExceeded, Reservation
from relay.policy.routing import NoRoute
from relay.proxy import endpoints, settle
from relay.proxy.attempt import Retry, open_exchange, take_slot, unavailable
from relay.proxy.body_memory import BodyBytes
from relay.proxy.exchange import Exchange
from relay.proxy.health import DOWN
from relay.proxy.ledger import Ledger
from relay.stream import dialect
from relay.stream import endings as E
from relay.stream.content_hold import Hold, error_of

# The longest a keyed request waits for its admission record before it is served without
# one (JSON line `admission_not_durable`). Serving is the choice: the in-memory budget still
# holds every limit, and only a crash in that window could give a key back what it spent,
# whereas refusing would turn a locked or failing database into an outage of keyed traffic.
ADMIT_WAIT_S = 0.5

_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")


def exceeded(exc: BudgetExceeded) -> RelayError:
    return RelayError(
        "budget_exceeded", str(exc), exc.details(), [(b"Retry-After", b"%d" % exc.retry_after)]
    )


class Dispatcher:
    def __init__(self, app) -> None:
        self.app = app
        # Generated ids: a random prefix per process and a counter (24 hex digits, unique,
        # no system call per request as os.urandom would make).
        self._id_prefix = os.urandom(6).hex().encode()
        self._id_count = itertools.count(1)
        self.bodies = BodyBytes(app.config.server.max_buffered_body_bytes)

    def request_id(self, headers) -> bytes:
        given = header(headers, b"x-request-id")
        if given is not None and _REQUEST_ID.match(given):
            return given
        return self.new_id()

    def new_id(self) -> bytes:
        return b"%s%012x" % (self._id_prefix, next(self._id_count))

    # ---- entry -------------------------------------------------------------------------
    async def handle(self, client, req) -> None:
        app = self.app
        t0 = time.perf_counter()
        rid = self.request_id(req.headers)
        path = req.path  # the name the upstream routes on, bounded: echoed, stored and logged
        rec = Record(
            ts=time.time(),
            request_id=rid.decode(),
            path=path,
            method=bounded(req.method.decode("latin-1"), 32),
            client_addr=client.peer_host,
            user_agent=user_agent(req.headers),
        )
        keep_alive = req.keep_alive
        cors = app.cors.headers(req.headers)
        ledger = Ledger(cors)
        try:
            if app.cors.is_preflight(req.method, req.headers):  # before any key is asked for
                if not client.gone:
                    client.transport.write(app.cors.preflight(req.headers, rid, keep_alive))
                return
            answered = endpoints.answer(app, client, req, rid, ledger)
            if answered:
                if answered is not True:  # (a worker asks its parent for the relay's figures)
                    await answered
                return
            keep_alive = await self._serve(client, req, rid, rec, ledger, t0, path)
            if keep_alive is None:  # the body streams to the client: wait for its end here,
                del req  # with no frame but this one (the request was sent: not kept either)
                ex = ledger.exchange
                assert ex is not None  # (`_serve` returns None only while it streams)
                await ex.done
                keep_alive = await self._ended(client, rec, ledger, ledger.up, ex, False)
        except RelayError as err:
            keep_alive = self._answer_error(client, rid, rec, err, keep_alive, ledger)
        except asyncio.CancelledError:
            keep_alive = False
            self._cancelled(client, rid, rec, ledger)
        except Exception as exc:  # a bug: the client still gets an answer, the row is written
            app.log.event(
                "internal_error",
                request_id=rec.request_id,
                error=f"{type(exc).__name__}: {exc}"[:300],
            )
            if ledger.exchange is not None:
                ledger.exchange.conn.abort()
            rec.outcome = rec.error_code = "internal_error"
            keep_alive = False
            hold = ledger.hold
            if hold is None or not hold.open:
                self._answer_error(
                    client,
                    rid,
                    rec,
                    RelayError("internal_error", "internal relay error"),
                    False,
                    ledger,
                )
        finally:
            if ledger.hold is not None:
                ledger.hold.close()
            if rec.outcome is not None or rec.status is not None:
                settle.settle(app, client, rec, ledger, t0)  # once per request
            client.finish(keep_alive)

    def _cancelled(self, client, rid: bytes, rec: Record, ledger: Ledger) -> None:
        """The task was cancelled (client gone, or the drain's last step): the row still says
        what reached the client, and a client that got nothing yet gets an answer."""
        draining = self.app.draining and not client.gone
        ex, hold = ledger.exchange, ledger.hold
        if ex is not None:
            if ex.head_at and ex.outcome is None:
                ex.shutdown()  # ends the exchange: its timers stop, its figures stay
            else:
                ex.conn.abort()
            if hold is not None and hold.open and rec.upstream_served is None:
                rec.upstream_served, rec.status = ex.upstream_name, ex.status
        rec.outcome = rec.outcome or (E.SHUTDOWN if draining else E.CLIENT_GONE)
        rec.error_code = rec.error_code or rec.outcome
        if draining and (hold is None or not hold.open):  # nothing but comments went out
            err = shutting_down()
            rec.status = err.status
            if hold is not None and hold.committed:
                hold.fail(err.message, err.type, err.code)
            else:
                client.respond(err.status, err.body(), rid, False, ledger.cors)

    def _answer_error(
        self, client, rid, rec, err: RelayError, keep_alive: bool, ledger: Ledger
    ) -> bool:
        rec.status = err.status
        rec.error_code = rec.error_code or err.code
        why = err.details.get("error")
        if rec.error is None and isinstance(why, str) and why:
            rec.error = bounded(why)  # e.g. the TLS reason of a refused certificate
        rec.outcome = rec.outcome or "error"
        hold = ledger.hold
        if hold is not None:
            hold.close()
            if hold.committed:  # a 200 event stream is out (heartbeats): the error goes in it
                return hold.fail(err.message, err.type, err.code) and keep_alive
        keep_alive = keep_alive and err.status < 500 and err.status != 408
        client.respond(err.status, err.body(), rid, keep_alive, err.headers + ledger.cors)
        return keep_alive

    # ---- admission and relay -------------------------------------------------------------
    async def _serve(
        self, client, req, rid: bytes, rec: Record, ledger: Ledger, t0: float, path: str
    ) -> bool | None:
        app = self.app
        if app.otel is not None:  # the span starts with the request (ends in settlement)
            ledger.trace = app.otel.begin(req.headers, rec)
        if app.auth.enabled and not ledger.admin:
            rec.key_id = req.key_id or app.auth.identify(req.headers)
            if rec.key_id is None:
                raise RelayError("invalid_api_key", "missing or unknown API key")
        slot_path = A.generates(req.method, path)  # any POST but a known cheap route
        large = len(req.body) > A.LARGE_BODY  # the other streams' turn between body passes
        if large:
            await asyncio.sleep(0)
        peek = A.peek_body(req.method, req.headers, req.body, A.json_route(path))
        rec.model, rec.stream = bounded(peek.model, A.MAX_ECHO), bool(peek.stream)
        ledger.model = peek.model  # the public name, whole (model_map looks it up)
        if ledger.trace is not None:
            ledger.trace.max_tokens = A.completion_limit(peek, path)
        # the request keeps the upstreams it was routed among: a reload (SIGHUP) that removes
        # a fallback meanwhile must not leave a candidate with no upstream behind its name
        upstreams = app.upstreams
        try:
            candidates = app.router.candidates(peek.model)
        except NoRoute:
            raise RelayError(
                "model_not_found", f"no upstream serves model {rec.model!r}", {"model": rec.model}
            ) from None
        rec.upstream_requested = candidates[0]
        if large:
            await asyncio.sleep(0)
        cap = app.config.budget.default_max_tokens
        prompt_est, completion_est, completions, prompts = A.estimates(req.body, peek, cap, path)
        budgeted = rec.key_id is not None and app.budgets.limits_tokens(rec.key_id)
        if budgeted and prompts > A.MAX_PROMPTS:  # (counted up to there: at least that many)
            raise RelayError(
                "bad_request",
                f"more than {A.MAX_PROMPTS} prompts in one request: a token budget cannot "
                "reserve them",
            )
        if budgeted and A.json_route(path) and A.completion_limit(peek, path) is None:
            # the upstream must honour what is reserved
            req.body = A.with_limit(req.body, peek, cap, path)
        ledger.generates = slot_path
        ledger.completion_est = completion_est
        ledger.completions = completions
        ledger.prompt_est = prompt_est
        if rec.key_id is not None:
            try:
                ledger.reservation = app.budgets.reserve(
                    rec.key_id, prompt_est + completion_est, time.time()
                )
            except BudgetExceeded as exc:
                raise exceeded(exc) from None
        res = ledger.reservation
        if res is not None and not res.settled:  # on disk before any slot or upstream
            await self._admit(rec, ledger, res)
        hold = ledger.hold = Hold(
            app.loop,
            client,
            rid,
            app.config.dispatcher.heartbeat_s if rec.stream else 0.0,
            ledger.cors,
            dialect.from_path(path),  # (until the stream's own events say)
        )
        hold.start()
        last: Retry | None = None
        for i, name in enumerate(candidates):
            up = upstreams[name]
            more = i < len(candidates) - 1
            rec.fallback_attempts = i
            hold.more = more
            try:
                return await self._attempt(client, req, rid, rec, ledger, up, more, t0)
            except Retry as retry:
                last = retry
                hold.retry()
                ledger.release_slot()
                if more:  # the attempt failed on this upstream: its metrics say so
                    if ledger.generates:
                        up.metrics.request_done(False, retry.err.code)
                    else:
                        up.metrics.other_request_done()
                    if ledger.trace is not None:
                        ledger.trace.fallback(name, candidates[i + 1], retry.err.code)
                    app.log.event(
                        "fallback",
                        request_id=rec.request_id,
                        upstream=name,
                        next=candidates[i + 1],
                        reason=retry.err.code,
                        error=retry.err.details.get("error"),
                    )
        assert last is not None  # (every candidate failed: the last one's error is the answer)
        raise last.err

    async def _attempt(
        self, client, req, rid, rec: Record, ledger: Ledger, up, more: bool, t0: float
    ) -> bool | None:
        """keep-alive once the exchange ended; None while its body streams to the client."""
        app = self.app
        d = app.config.dispatcher
        ledger.up = up  # (a config reload may remove it from app.upstreams meanwhile)
        if up.health.probe == DOWN and d.health_interval_s > 0:  # probed often while down
            err = up.health.last_error
            raise unavailable(up, f"upstream {up.name} is down: {err}", error=err)
        if ledger.generates:
            await take_slot(app, up, rec, ledger)
        on_content = lambda e, up=up: up.metrics.observe_ttft(  # noqa: E731
            e.first_content_at - t0, time.monotonic()
        )
        ex = await open_exchange(app, client, req, up, rid, rec, on_content, ledger)
        if not ex.body_started:  # 429/5xx with another candidate left
            status = ex.head_resp.status_code if ex.head_resp is not None else 0
            ex.conn.abort()
            client.exchange = None
            raise unavailable(up, f"upstream {up.name} answered {status}", status=status)
        if ex.outcome is None and ledger.hold is not None and not ledger.hold.open:
            await ex.opened()  # the first content event is out, or the exchange ended
        if ex.outcome is None:  # streaming, nothing is swapped any more: `handle` waits for
            return None  # the end (only its frame stays with a long stream, not the admission's)
        return await self._ended(client, rec, ledger, up, ex, more)

    async def _ended(
        self, client, rec: Record, ledger: Ledger, up, ex: Exchange, more: bool
    ) -> bool:
        """The exchange is over: what the row says, and whether the client connection stays
        (or the next candidate's turn: `Retry`, only while the hold is not open)."""
        await ex.done
        client.exchange = None
        rec.outcome = ex.outcome
        hold = ledger.hold
        assert hold is not None  # (the request's, made before its first candidate)
        if not hold.open:  # ended while nothing but comments reached the client
            if ex.outcome in (E.DROPPED, E.BAD_FRAMING, E.STALL, E.ERROR_EVENT, E.SHUTDOWN):
                err = RelayError(
                    "upstream_unavailable",
                    "upstream failed before the first content event",
                    {"upstream": up.name, "error": ex.outcome},
                )
                if more and ex.outcome != E.SHUTDOWN:
                    raise Retry(err)
                rec.outcome = ex.outcome
                if ex.outcome == E.ERROR_EVENT:  # the upstream's own words, in-band
                    rec.upstream_served, rec.error_code = up.name, E.ERROR_EVENT
                    err = upstream_error(
                        ex.status,
                        hold.error(),
                        "upstream_error",
                        f"upstream {up.name} answered with an error",
                    )
                raise err
            if hold.committed and ex.outcome == E.DONE:  # a response that cannot continue
                rec.upstream_served, rec.outcome = up.name, "error"  # the event stream
                sse = 200 <= ex.status < 300
                rec.error_code = "upstream_bad_response" if sse else f"upstream_{ex.status}"
                body = ex.body_copy
                raise upstream_error(
                    ex.status,
                    error_of(b"".join(body.parts)) if body is not None else None,
                    rec.error_code,
                    f"upstream {up.name} answered {ex.status}"
                    + (" without an event stream" if sse else ""),
                )
        rec.upstream_served = up.name
        rec.status = ex.status
        keep_alive = ex.client_keep_alive
        if ex.outcome == E.DONE and not ex.whole:  # (whole: the client read to its end)
            drain = await client.drained(self.app.config.dispatcher.write_timeout_s)
            if drain != "drained":  # the response never reached the client whole
                rec.outcome = E.CLIENT_SLOW if drain == "timeout" else E.CLIENT_GONE
                keep_alive = False
        up.pool.release(ex.conn, ex.reusable)
        return keep_alive and not client.gone

    async def _admit(self, rec: Record, ledger: Ledger, res: Reservation) -> None:
        """A key with limits: its admission is on disk before the upstream is contacted (a
        crash then cannot give the key back what it spent; `store.admissions`). With a
        shared store it is the reservation itself, taken in the database (429 when the key
        is spent across all relays; `store.postgres`)."""
        store = self.app.store
        ledger.admission = admission_id = store.next_admission_id()
        reserved = res.tokens
        prompt = min(ledger.prompt_est, reserved)
        try:
            await store.admit(admission_id, rec, prompt, reserved - prompt, ADMIT_WAIT_S, res=res)
        except BudgetExceeded as exc:  # no lease taken: the row is a plain 429's
            ledger.admission = None
            raise exceeded(exc) from None
        except RuntimeError as exc:  # the database fails: serve, the budget still holds
            self.app.log.event(
                "admission_not_durable", request_id=rec.request_id, error=str(exc)[:300]
            )
        except TimeoutError:  # locked (a backup?): the same
            self.app.log.event(
                "admission_not_durable",
                request_id=rec.request_id,
                error=f"not committed within {ADMIT_WAIT_S}s",
            )

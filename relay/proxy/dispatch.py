"""The life of one request: admission, candidates, relay, and settlement exactly once.

Admission (the head was already judged by the client connection, `admission.head_check`):
the relay's own endpoints (`endpoints`) -> key (401) -> body peek (400) -> route (404) ->
budget reservation (429) -> durable admission -> per candidate (`attempt`): slot (503) ->
upstream (502/504) -> relay. Before the first content event reaches the client a retryable
failure moves on to the next candidate; after it nothing is swapped. What the request holds
and learns is written in its `Ledger`; every request ends in `settle.settle`, once, which
decides from the ledger's facts how it ended (`policy.outcome`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time
from collections.abc import Mapping

import msgspec

from relay.errors import Code, Outcome, RelayError, shutting_down, upstream_error
from relay.http.fields import Headers
from relay.http.fields import get as header
from relay.http.request_path import bounded
from relay.observe.record import Record, user_agent
from relay.policy import admission as A
from relay.policy.affinity import NO_WANT, Want, want_of
from relay.policy.budget import BudgetExceeded, Reservation
from relay.policy.outcome import Next, after_hold
from relay.policy.routing import NoRoute, Pool, Route
from relay.proxy import endpoints, settle
from relay.proxy.app_view import AppView
from relay.proxy.attempt import PoolBusy, Retry, open_exchange, take_slot, unavailable
from relay.proxy.client import ClientConn
from relay.proxy.client_writer import Drain
from relay.proxy.exchange import Exchange, Hop
from relay.proxy.health import DOWN, READY, UNKNOWN
from relay.proxy.ledger import Ledger
from relay.proxy.reply import Reply
from relay.proxy.request import Request
from relay.proxy.upstreams import Upstream
from relay.stream import dialect
from relay.stream.content_hold import Hold, error_of

# The longest a keyed request waits for its admission record before it is served without
# one (JSON line `admission_not_durable`). Serving is the choice: the in-memory budget still
# holds every limit, and only a crash in that window could give a key back what it spent,
# whereas refusing would turn a locked or failing database into an outage of keyed traffic.
ADMIT_WAIT_S = 0.5

_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
# The members the per-request code compares, as module names: an enum member looked up on its
# class costs Python 3.11 far more than a global.
DONE = Outcome.DONE
DRAINED = Drain.DRAINED
# No member left out: one set for every request (an empty frozenset is 216 bytes, kept by the
# frames of a request while it waits for its upstream's head).
_NONE_LEFT_OUT: frozenset[str] = frozenset()


class Ended(msgspec.Struct, frozen=True, gc=False):
    """The request's answer is written: whether the client connection may stay."""

    keep_alive: bool


class Streaming(msgspec.Struct, frozen=True, gc=False):
    """The exchange still relays its body to the client, or holds it until its first content
    event with no other candidate left: `handle` waits for its end."""

    exchange: Exchange


Relayed = Ended | Streaming


# The code of a refusal by the limit it met: the limits that act now have their own.
_LIMIT_CODES = {
    "concurrent_requests": Code.CONCURRENCY_EXCEEDED,
    "minute_requests": Code.RATE_LIMIT_EXCEEDED,
    "minute_tokens": Code.RATE_LIMIT_EXCEEDED,
}


def exceeded(exc: BudgetExceeded) -> RelayError:
    """The 429 of a key's limit: which limit, the figures, when to retry."""
    return RelayError(
        _LIMIT_CODES.get(exc.limit, Code.BUDGET_EXCEEDED),
        str(exc),
        exc.details(),
        [(b"Retry-After", b"%d" % exc.retry_after)],
    )


class Dispatcher:
    def __init__(self, app: AppView) -> None:
        self.app = app
        # Generated ids: a random prefix per process and a counter (24 hex digits, unique,
        # no system call per request as os.urandom would make).
        self._id_prefix = os.urandom(6).hex().encode()
        self._id_count = itertools.count(1)

    def request_id(self, headers: Headers) -> bytes:
        given = header(headers, b"x-request-id")
        if given is not None and _REQUEST_ID.match(given):
            return given
        return self.new_id()

    def new_id(self) -> bytes:
        return b"%s%012x" % (self._id_prefix, next(self._id_count))

    # ---- entry -------------------------------------------------------------------------
    async def handle(self, client: ClientConn, req: Request) -> None:
        app = self.app
        t0 = time.perf_counter()
        rid = self.request_id(req.headers)
        rec = Record(
            ts=time.time(),
            request_id=rid.decode(),
            # The name the upstream routes on, bounded: echoed, stored and logged.
            path=req.path,
            method=bounded(req.method.decode("latin-1"), 32),
            client_addr=client.peer_host,
            user_agent=user_agent(req.headers),
        )
        keep_alive = req.keep_alive
        ledger = Ledger(app.cors.headers(req.headers), dialect.from_path(req.path))
        out = client.out
        try:
            if app.cors.is_preflight(req.method, req.headers):
                # Before any key is asked for.
                out.send_answer(app.cors.preflight(req.headers, rid, keep_alive))
                return
            own = endpoints.claim(app, client.peer_host, req, ledger)
            if own is not None:
                await endpoints.answer(own, app, out, client.peer_host, req, rid, ledger.cors)
                return
            relayed = await self._serve(client, req, rid, rec, ledger, t0)
            if isinstance(relayed, Ended):
                keep_alive = relayed.keep_alive
            else:
                # The body streams to the client: its end is waited for here, with no frame
                # but this one (the request was sent: not kept either).
                ex = relayed.exchange
                del req, relayed
                await ex.done
                up = ledger.up
                assert up is not None
                keep_alive = await self._ended(client, ledger, up, ex, False)
        except RelayError as err:
            keep_alive = self._answer_error(client, rid, err, keep_alive, ledger)
        except asyncio.CancelledError:
            keep_alive = False
            self._cancelled(client, rid, ledger)
        except Exception as exc:
            # A bug: the client still gets an answer, the row is written.
            keep_alive = False
            self._bug(client, rid, rec, ledger, exc)
        finally:
            reply = ledger.reply
            if reply is not None:
                reply.close()
            if ledger.answered is not None or ledger.cut is not None or ledger.exchange is not None:
                # Once per request.
                settle.settle(app, out, rec, ledger, t0)
            client.finish(keep_alive)

    def _cancelled(self, client: ClientConn, rid: bytes, ledger: Ledger) -> None:
        """The task was cancelled (the client left, or the drain's last step): the row still
        says what reached the client, and a client that got nothing yet gets an answer."""
        draining = self.app.draining and not client.out.gone
        ex = ledger.exchange
        if ex is not None and ex.ending is not None:
            # The exchange had ended (its response waited for the client to read it): the
            # row says what it came to; its upstream connection is not reused.
            ex.conn.abort()
            return
        ledger.cut = Outcome.SHUTDOWN if draining else Outcome.CLIENT_CLOSED
        if ex is not None:
            # It ends: its timers stop, its figures stay.
            ex.shutdown()
        if draining and not ledger.content_out:
            # Nothing but comments went out.
            self._answer_error(client, rid, shutting_down(), False, ledger)

    def _bug(
        self, client: ClientConn, rid: bytes, rec: Record, ledger: Ledger, exc: Exception
    ) -> None:
        self.app.log.event(
            "internal_error",
            request_id=rec.request_id,
            error=f"{type(exc).__name__}: {exc}"[:300],
        )
        ledger.bug = True
        if ledger.exchange is not None:
            ledger.exchange.conn.abort()
        if not ledger.content_out:
            err = RelayError(Code.INTERNAL_ERROR, "internal relay error")
            self._answer_error(client, rid, err, False, ledger)

    def _answer_error(
        self, client: ClientConn, rid: bytes, err: RelayError, keep_alive: bool, ledger: Ledger
    ) -> bool:
        """Answer with `err`: over HTTP, or in-band when a 200 event stream is out already
        (heartbeats). Whether the connection may stay."""
        ledger.answered = err
        reply = ledger.reply
        if reply is not None:
            reply.close()
            if reply.committed:
                api = ledger.stream_api
                return reply.fail(err.message, err.type, err.code, api) and keep_alive
        keep_alive = keep_alive and err.status < 500 and err.status != 408
        client.out.answer(err.status, err.body(), rid, keep_alive, err.headers + ledger.cors)
        return keep_alive

    # ---- admission and relay -------------------------------------------------------------
    async def _serve(
        self, client: ClientConn, req: Request, rid: bytes, rec: Record, ledger: Ledger,
        t0: float,
    ) -> Relayed:  # fmt: skip
        app = self.app
        if app.otel is not None:
            # The span starts with the request (it ends in settlement).
            ledger.trace = app.otel.begin(req.headers, rec)
        if app.auth.enabled and not ledger.admin:
            rec.key_id = req.key_id or app.auth.identify(req.headers)
            if rec.key_id is None:
                raise RelayError(Code.INVALID_API_KEY, "missing or unknown API key")
        # The request keeps the upstreams it was routed among: a reload (SIGHUP) that
        # removes a fallback meanwhile must not leave a candidate with no upstream behind
        # its name.
        upstreams = app.upstreams
        # A large body gives the other streams their turn between its passes.
        large = len(req.body) > A.LARGE_BODY
        if large:
            await asyncio.sleep(0)
        peek, route = self._routed(req, rec, ledger)
        if large:
            await asyncio.sleep(0)
        self._reserve(req, rec, ledger, peek)
        # What the body said is in the record and the ledger: not kept while the request waits.
        del peek
        route_want = NO_WANT
        if ledger.generates and len(route.pool.members) > 1:
            # Where in the pool the conversation is cached: what the model reads, hashed.
            route_want = want_of(ledger.api, req.body)
            if large:
                await asyncio.sleep(0)
        res = ledger.reservation
        if res is not None and not res.empty:
            # On disk before any slot or upstream.
            await self._admit(rec, ledger, res, route.pool, route_want)
        reply = ledger.reply = Reply(
            app.loop,
            client.out,
            Hold(rid, ledger.cors, req.http11, req.keep_alive),
            app.config.dispatcher.heartbeat_s if rec.stream else 0.0,
            app.deadlines,
        )
        reply.start()
        return await self._relay(client, req, rid, rec, ledger, upstreams, route, route_want, t0)

    async def _relay(
        self, client: ClientConn, req: Request, rid: bytes, rec: Record, ledger: Ledger,
        upstreams: Mapping[str, Upstream], route: Route, route_want: Want, t0: float,
    ) -> Relayed:  # fmt: skip
        """Each candidate in turn, its pool's members each once, until one serves: a failure
        before the first content event moves on (`Retry`), the last one's error is the
        answer."""
        last: Retry | None = None
        candidates = route.candidates
        attempts = 0
        for c, pool in enumerate(candidates):
            later = candidates[c + 1] if c < len(candidates) - 1 else None
            want = route_want if c == 0 else NO_WANT
            tried: list[str] = []
            while True:
                ready, down = self._eligible(upstreams, pool, tried)
                if not ready:
                    if down is not None and not tried:
                        # Probed often while down: the pool's turn passes at once.
                        last = self._down(rec, ledger, down, pool, later)
                    break
                more = later is not None or len(ready) > 1
                rec.fallback_attempts = attempts
                attempts += 1
                exclude = frozenset(m for m in pool.members if m not in ready) or _NONE_LEFT_OUT
                try:
                    return await self._attempt(
                        client, req, rid, rec, ledger, upstreams, pool, want, exclude, more, t0
                    )
                except Retry as retry:
                    last = retry
                    if not self._retried(rec, ledger, retry, pool, len(ready) > 1, later, tried):
                        break
        # Every candidate failed: the last one's error is the answer.
        assert last is not None
        raise last.err

    def _retried(
        self, rec: Record, ledger: Ledger, retry: Retry, pool: Pool, others: bool,
        later: Pool | None, tried: list[str],
    ) -> bool:  # fmt: skip
        """An attempt failed before content: its slot back, its member tried; whether another
        member of the pool is next (`others` left and the pool was not busy), and the log of
        what comes next, if anything."""
        reply = ledger.reply
        assert reply is not None
        reply.retry()
        ledger.release_slot()
        up = ledger.up
        assert up is not None
        tried.append(up.name)
        # A busy pool has no other member to try; a member that failed does.
        again = others and not isinstance(retry, PoolBusy)
        nxt = pool if again else later
        if nxt is not None:
            self._fell_back(rec, ledger, up, nxt.name, retry.err)
            # (The last candidate's exchange is settlement's, its stall included.)
            ledger.exchange = None
        return again

    def _eligible(
        self, upstreams: Mapping[str, Upstream], pool: Pool, tried: list[str]
    ) -> tuple[list[str], Upstream | None]:
        """The members of `pool` a request may try now (not tried yet; a member down or
        loading is passed by while another is ready, since probes watch it), and the first
        down member, when that is why none is left."""
        probing = self.app.config.dispatcher.health_interval_s > 0
        members = pool.members
        if len(members) == 1 and not tried:
            # One upstream, the usual pool.
            up = upstreams.get(members[0])
            if up is None:
                return [], None
            probe = up.health.probe
            if probe is DOWN and probing:
                return [], up
            return [up.name], None
        ready: list[str] = []
        loading: list[str] = []
        down: Upstream | None = None
        for name in pool.members:
            up = upstreams.get(name)
            if up is None or name in tried:
                continue
            probe = up.health.probe
            if probe is READY or probe is UNKNOWN or not probing:
                ready.append(name)
            elif probe is DOWN:
                down = down or up
            else:
                loading.append(name)
        # A loading member answers for itself (503) when it is all there is.
        return ready or loading, down

    def _down(
        self, rec: Record, ledger: Ledger, up: Upstream, pool: Pool, later: Pool | None
    ) -> Retry:
        """A pool whose members are all down: its turn passes (the next candidate's, or the
        answer)."""
        err = up.health.last_error
        retry = unavailable(up, f"upstream {pool.name} is down: {err}", error=err)
        ledger.up = up
        if later is not None:
            self._fell_back(rec, ledger, up, later.name, retry.err)
        return retry

    def _routed(self, req: Request, rec: Record, ledger: Ledger) -> tuple[A.Peek, Route]:
        """What the body says (model, stream, limits) and where it is routed: the checks
        before any slot or upstream (400, 404)."""
        path = req.path
        peek = A.peek_body(req.method, req.headers, req.body, A.json_route(path))
        rec.model, rec.stream = bounded(peek.model, A.MAX_ECHO), bool(peek.stream)
        # The public name, whole (model_map looks it up).
        ledger.model = peek.model
        if ledger.trace is not None:
            ledger.trace.max_tokens = A.completion_limit(peek, path)
        try:
            route = self.app.router.candidates(peek.model)
        except NoRoute:
            raise RelayError(
                Code.MODEL_NOT_FOUND,
                f"no upstream serves model {rec.model!r}",
                {"model": rec.model},
            ) from None
        # The pool's first member until one is chosen.
        rec.upstream_requested = route.pool.members[0]
        rec.pool = route.pool.name
        return peek, route

    def _reserve(self, req: Request, rec: Record, ledger: Ledger, peek: A.Peek) -> None:
        """The request's estimates and its key's reservation (400 for uncountable prompts,
        429 for a spent key)."""
        app = self.app
        path = req.path
        cap = app.config.budget.default_max_tokens
        prompt_est, completion_est, completions, prompts = A.estimates(req.body, peek, cap, path)
        budgeted = rec.key_id is not None and app.budgets.limits_tokens(rec.key_id)
        if budgeted and prompts > A.MAX_PROMPTS:
            # Counted up to there: at least that many.
            raise RelayError(
                Code.BAD_REQUEST,
                f"more than {A.MAX_PROMPTS} prompts in one request: a token budget cannot "
                "reserve them",
            )
        if budgeted and A.json_route(path) and A.completion_limit(peek, path) is None:
            # The upstream must honour what is reserved.
            req.body = A.with_limit(req.body, peek, cap, path)
        # Any POST but a known cheap route.
        ledger.generates = A.generates(req.method, path)
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

    def _fell_back(
        self, rec: Record, ledger: Ledger, up: Upstream, next_name: str, err: RelayError
    ) -> None:
        """A candidate failed and the next one takes over: its metrics, span and log say so."""
        if ledger.generates:
            up.metrics.request_done(False, err.code)
        else:
            up.metrics.other_request_done()
        ex = ledger.exchange
        summary = ex.summary if ex is not None else None
        if summary is not None and summary.stall is not None:
            # It stalled before content: its stall is its own, though the request goes on.
            up.metrics.stall(summary.stall.reason)
        if ledger.trace is not None:
            ledger.trace.fallback(up.name, next_name, err.code)
        self.app.log.event(
            "fallback",
            request_id=rec.request_id,
            upstream=up.name,
            next=next_name,
            reason=err.code,
            error=err.details.get("error"),
        )

    async def _attempt(
        self, client: ClientConn, req: Request, rid: bytes, rec: Record, ledger: Ledger,
        upstreams: Mapping[str, Upstream], pool: Pool, want: Want, exclude: frozenset[str],
        more: bool, t0: float,
    ) -> Relayed:  # fmt: skip
        """keep-alive once the exchange ended, or the exchange whose body streams on: on the
        member of `pool` (but `exclude`) that gives it a slot, or for a request that takes
        none, the first."""
        app = self.app
        rec.pool = pool.name
        # Kept: a config reload may remove it from app.upstreams meanwhile. Until a slot is
        # given, the first member stands for the pool (a busy pool's figures are its).
        up = ledger.up = upstreams[next(m for m in pool.members if m not in exclude)]
        if ledger.generates:
            up = ledger.up = upstreams[await take_slot(app, pool, want, exclude, rec, ledger)]
            if not up.health.usable():
                # It went down while the request waited.
                err = up.health.last_error
                raise unavailable(up, f"upstream {up.name} is down: {err}", error=err)
        if rec.fallback_attempts == 0:
            rec.upstream_requested = up.name
        hop = Hop(
            up.name,
            rec.model or "",
            more,
            up.metrics,
            t0,
            (rec.queue_ms or 0.0) if ledger.generates else 0.0,
        )
        ex = await open_exchange(app, client, req, up, rid, ledger, hop)
        if not ex.body_started:
            # A 429 or 5xx with another candidate left.
            status = ex.head_resp.status_code if ex.head_resp is not None else 0
            ex.conn.abort()
            client.exchange = None
            raise unavailable(up, f"upstream {up.name} answered {status}", status=status)
        reply = ledger.reply
        assert reply is not None
        if more and ex.ending is None and not reply.open:
            # The first content event is out, or the exchange ended (a failure before it is
            # the next candidate's turn).
            await ex.past_hold()
        if ex.ending is None:
            # Streaming, nothing is swapped any more (or, with no other candidate, held until
            # the first content event, whose failure `handle` answers as this frame would):
            # `handle` waits for the end, only its frame stays with the stream, not the
            # admission's, nor the request.
            return Streaming(ex)
        return Ended(await self._ended(client, ledger, up, ex, more))

    async def _ended(
        self, client: ClientConn, ledger: Ledger, up: Upstream, ex: Exchange, more: bool
    ) -> bool:
        """The exchange is over: whether the client connection stays (or the next candidate's
        turn: `Retry`, only while the hold is not open)."""
        await ex.done
        client.exchange = None
        summary = ex.summary
        reply = ledger.reply
        assert summary is not None and reply is not None
        if summary.sse:
            ledger.api = summary.api
        if not reply.open:
            # Ended while nothing but comments reached the client.
            self._failed_before_content(ledger, reply, up, ex, more)
        keep_alive = ex.client_keep_alive
        if summary.ending is DONE and not summary.whole:
            # The whole response went out (the client read to its end: `whole`).
            drain = await client.out.drained(self.app.config.dispatcher.write_timeout_s)
            if drain is not DRAINED:
                # The response never reached the client whole.
                timeout = drain is Drain.TIMEOUT
                ledger.drained = Outcome.CLIENT_WRITE_TIMEOUT if timeout else Outcome.CLIENT_CLOSED
                keep_alive = False
        up.pool.release(ex.conn, summary.reusable)
        return keep_alive and not client.out.gone

    def _failed_before_content(
        self, ledger: Ledger, reply: Reply, up: Upstream, ex: Exchange, more: bool
    ) -> None:
        """An exchange that ended while nothing but comments reached the client: the next
        candidate's turn (`Retry`), or the error the request is answered with (raised), as
        `policy.outcome.after_hold` says."""
        summary = ex.summary
        assert summary is not None
        then = after_hold(summary.ending, reply.committed, more)
        if then is Next.SERVED:
            return
        if then is Next.CANNOT_CONTINUE:
            status = summary.status
            sse = 200 <= status < 300
            raise upstream_error(
                status,
                error_of(summary.body) if summary.body is not None else None,
                Code.UPSTREAM_BAD_RESPONSE if sse else f"upstream_{status}",
                f"upstream {up.name} answered {status}"
                + (" without an event stream" if sse else ""),
            )
        if then is Next.UPSTREAM_ERROR:
            # The upstream's own words, in-band.
            raise upstream_error(
                summary.status,
                reply.error(),
                Code.UPSTREAM_ERROR,
                f"upstream {up.name} answered with an error",
            )
        err = RelayError(
            Code.UPSTREAM_UNAVAILABLE,
            "upstream failed before the first content event",
            {"upstream": up.name, "error": summary.ending},
        )
        raise Retry(err) if then is Next.RETRY else err

    async def _admit(
        self, rec: Record, ledger: Ledger, res: Reservation, pool: Pool, want: Want
    ) -> None:
        """A key with limits: its admission is on disk before the upstream is contacted (a
        crash then cannot give the key back what it spent; `store.admissions`). With a
        shared store it is the reservation itself, taken in the database (429 when the key
        is spent across all relays; `store.postgres`)."""
        store = self.app.store
        ledger.admission = admission_id = store.next_admission_id()
        if ledger.generates:
            # A worker asks for the slot with the admission (relay.workers.ahead).
            self.app.balancer.ahead(admission_id, pool, want, rec.key_id)
        reserved = res.tokens
        prompt = min(ledger.prompt_est, reserved)
        try:
            await store.admit(admission_id, rec, prompt, reserved - prompt, ADMIT_WAIT_S, res=res)
        except BudgetExceeded as exc:
            # No lease taken: the row is a plain 429's.
            ledger.admission = None
            raise exceeded(exc) from None
        except RuntimeError as exc:
            # The database fails: served, the budget still holds.
            self.app.log.event(
                "admission_not_durable", request_id=rec.request_id, error=str(exc)[:300]
            )
        except TimeoutError:
            # Locked (a backup?): the same.
            self.app.log.event(
                "admission_not_durable",
                request_id=rec.request_id,
                error=f"not committed within {ADMIT_WAIT_S}s",
            )

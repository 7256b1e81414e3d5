"""The life of one request: admission, candidates, relay, and settlement exactly once.

Admission (the head was already judged by the client connection, `admission.head_check`):
internal endpoints -> key (401) -> body peek (400) -> route (404) -> budget
reservation (429) -> per candidate: slot (503) -> upstream (502/504) -> relay. Before the
first content event reaches the client a retryable failure moves on to the next candidate;
after it nothing is swapped. Every admitted request ends in `_settle`, once.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time

import msgspec

from relay.errors import RelayError, shutting_down, upstream_error
from relay.http.fields import get as header
from relay.http.request_path import bounded
from relay.http.to_upstream import request_bytes, upstream_request_headers
from relay.http.upstream_url import TargetError
from relay.observe import ui_page as ui
from relay.observe import ui_state
from relay.observe.record import Record, user_agent
from relay.observe.row_timings import round3
from relay.policy import admin_access as access
from relay.policy import admission as A
from relay.policy.budget import BudgetExceeded
from relay.policy.model_map import served_name, with_model
from relay.policy.routing import NoRoute, model_list
from relay.proxy import settle
from relay.proxy.body_memory import BodyBytes
from relay.proxy.exchange import Exchange
from relay.proxy.health import DOWN
from relay.proxy.pool import ConnectError
from relay.proxy.slots import Busy, SlotsClosed
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


class _Retry(Exception):
    """A failure before the first content event: the next candidate may serve."""

    def __init__(self, err: RelayError | None, response: bytes | None = None) -> None:
        super().__init__(err.message if err else "retry")
        self.err = err


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
        state = {"slot": None, "reservation": None, "ex": None, "hold": None, "cors": cors}
        try:
            if app.cors.is_preflight(req.method, req.headers):  # before any key is asked for
                if not client.gone:
                    client.transport.write(app.cors.preflight(req.headers, rid, keep_alive))
                return
            if self._internal(client, req, rid, state):
                return
            keep_alive = await self._serve(client, req, rid, rec, state, t0, path)
            if keep_alive is None:  # the body streams to the client: wait for its end here,
                del req  # with no frame but this one (the request was sent: not kept either)
                await state["ex"].done
                keep_alive = await self._ended(client, rec, state, state["up"], state["ex"], False)
        except RelayError as err:
            keep_alive = self._answer_error(client, rid, rec, err, keep_alive, state)
        except asyncio.CancelledError:
            keep_alive = False
            self._cancelled(client, rid, rec, state)
        except Exception as exc:  # a bug: the client still gets an answer, the row is written
            app.log.event(
                "internal_error",
                request_id=rec.request_id,
                error=f"{type(exc).__name__}: {exc}"[:300],
            )
            ex = state["ex"]
            if ex is not None:
                ex.conn.abort()
            rec.outcome = rec.error_code = "internal_error"
            keep_alive = False
            hold = state["hold"]
            if hold is None or not hold.open:
                self._answer_error(
                    client,
                    rid,
                    rec,
                    RelayError("internal_error", "internal relay error"),
                    False,
                    state,
                )
        finally:
            if state["hold"] is not None:
                state["hold"].close()
            if rec.outcome is not None or rec.status is not None:
                settle.settle(app, client, rec, state, t0)  # once per request
            client.finish(keep_alive)

    def _cancelled(self, client, rid: bytes, rec: Record, state: dict) -> None:
        """The task was cancelled (client gone, or the drain's last step): the row still says
        what reached the client, and a client that got nothing yet gets an answer."""
        draining = self.app.draining and not client.gone
        ex, hold = state["ex"], state["hold"]
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
                client.respond(err.status, err.body(), rid, False, state["cors"])

    def _answer_error(
        self, client, rid, rec, err: RelayError, keep_alive: bool, state: dict
    ) -> bool:
        rec.status = err.status
        rec.error_code = rec.error_code or err.code
        why = err.details.get("error")
        if rec.error is None and isinstance(why, str) and why:
            rec.error = bounded(why)  # e.g. the TLS reason of a refused certificate
        rec.outcome = rec.outcome or "error"
        hold = state["hold"]
        if hold is not None:
            hold.close()
            if hold.committed:  # a 200 event stream is out (heartbeats): the error goes in it
                return hold.fail(err.message, err.type, err.code) and keep_alive
        keep_alive = keep_alive and err.status < 500 and err.status != 408
        client.respond(err.status, err.body(), rid, keep_alive, err.headers + state["cors"])
        return keep_alive

    # ---- admission and relay -------------------------------------------------------------
    async def _serve(
        self, client, req, rid: bytes, rec: Record, state: dict, t0: float, path: str
    ) -> bool | None:
        app = self.app
        if app.auth.enabled and not state.get("admin"):
            rec.key_id = req.key_id or app.auth.identify(req.headers)
            if rec.key_id is None:
                raise RelayError("invalid_api_key", "missing or unknown API key")
        slot_path = A.generates(req.method, path)  # any POST but a known cheap route
        peek = A.peek_body(req.method, req.headers, req.body, A.json_route(path))
        rec.model, rec.stream = bounded(peek.model, A.MAX_ECHO), bool(peek.stream)
        state["model"] = peek.model  # the public name, whole (model_map looks it up)
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
        cap = app.config.budget.default_max_tokens
        prompt_est, completion_est, completions = A.estimates(req.body, peek, cap, path)
        if (
            A.json_route(path)
            and rec.key_id is not None
            and A.completion_limit(peek, path) is None
            and app.budgets.limits_tokens(rec.key_id)
        ):
            # the upstream must honour what is reserved
            req.body = A.with_limit(req.body, peek, cap, path)
        state["generates"] = slot_path
        state["completion_est"] = completion_est
        state["completions"] = completions
        state["prompt_est"] = prompt_est
        if rec.key_id is not None:
            try:
                state["reservation"] = app.budgets.reserve(
                    rec.key_id, prompt_est + completion_est, time.time()
                )
            except BudgetExceeded as exc:
                raise exceeded(exc) from None
        res = state["reservation"]
        if res is not None and not res.settled:  # on disk before any slot or upstream
            await self._admit(rec, state, res)
        hold = state["hold"] = Hold(
            app.loop,
            client,
            rid,
            app.config.dispatcher.heartbeat_s if rec.stream else 0.0,
            state["cors"],
        )
        hold.start()
        last: _Retry | None = None
        for i, name in enumerate(candidates):
            up = upstreams[name]
            more = i < len(candidates) - 1
            rec.fallback_attempts = i
            hold.more = more
            try:
                return await self._attempt(client, req, rid, rec, state, up, slot_path, more, t0)
            except _Retry as retry:
                last = retry
                hold.retry()
                settle.release_slot(state)
                state["tried"] = name
                if more:  # the attempt failed on this upstream: its metrics say so
                    up.metrics.request_done(False, retry.err.code)
                    app.log.event(
                        "fallback",
                        request_id=rec.request_id,
                        upstream=name,
                        next=candidates[i + 1],
                        reason=retry.err.code,
                        error=retry.err.details.get("error"),
                    )
        raise last.err

    async def _attempt(
        self, client, req, rid, rec: Record, state, up, slot_path: bool, more: bool, t0: float
    ) -> bool | None:
        """keep-alive once the exchange ended; None while its body streams to the client."""
        app = self.app
        d = app.config.dispatcher
        state["up"] = up  # (a config reload may remove it from app.upstreams meanwhile)
        if up.health.probe == DOWN and d.health_interval_s > 0:  # probed often while down
            raise _Retry(
                RelayError(
                    "upstream_unavailable",
                    f"upstream {up.name} is down: {up.health.last_error}",
                    {"upstream": up.name, "error": up.health.last_error},
                )
            )
        ex = await self._start(client, req, rid, rec, state, up, slot_path, more, t0)
        state["ex"] = ex
        if not ex.body_started:  # 429/5xx with another candidate left
            status = ex.head_resp.status_code
            ex.conn.abort()
            client.exchange = None
            raise _Retry(
                RelayError(
                    "upstream_unavailable",
                    f"upstream {up.name} answered {status}",
                    {"upstream": up.name, "status": status},
                )
            )
        if ex.outcome is None and not state["hold"].open:
            await ex.opened()  # the first content event is out, or the exchange ended
        if ex.outcome is None:  # streaming, nothing is swapped any more: `handle` waits for
            return None  # the end (only its frame stays with a long stream, not the admission's)
        return await self._ended(client, rec, state, up, ex, more)

    async def _ended(self, client, rec: Record, state, up, ex: Exchange, more: bool) -> bool:
        """The exchange is over: what the row says, and whether the client connection stays
        (or the next candidate's turn: `_Retry`, only while the hold is not open)."""
        await ex.done
        client.exchange = None
        rec.outcome = ex.outcome
        hold = state["hold"]
        if not hold.open:  # ended while nothing but comments reached the client
            if ex.outcome in (E.DROPPED, E.BAD_FRAMING, E.STALL, E.ERROR_EVENT, E.SHUTDOWN):
                err = RelayError(
                    "upstream_unavailable",
                    "upstream failed before the first content event",
                    {"upstream": up.name, "error": ex.outcome},
                )
                if more and ex.outcome != E.SHUTDOWN:
                    raise _Retry(err)
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
        if ex.outcome == E.DONE:
            drain = await client.drained(self.app.config.dispatcher.write_timeout_s)
            if drain != "drained":  # the response never reached the client whole
                rec.outcome = E.CLIENT_SLOW if drain == "timeout" else E.CLIENT_GONE
                keep_alive = False
        up.pool.release(ex.conn, ex.reusable)
        return keep_alive and not client.gone

    async def _start(
        self, client, req, rid, rec: Record, state, up, slot_path: bool, more: bool, t0: float
    ) -> Exchange:
        """Wait for a slot, then open the exchange (up to its response head)."""
        d = self.app.config.dispatcher
        if slot_path:
            q0 = time.perf_counter()
            try:
                state["slot"] = await up.slots.acquire(d.pool_timeout_s)
            except SlotsClosed:  # the relay began draining while this request queued
                raise shutting_down() from None
            except Busy as exc:
                retry_after = max(1, int(d.pool_timeout_s + 0.999))
                raise _Retry(
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
        on_content = lambda e, up=up: up.metrics.observe_ttft(  # noqa: E731
            e.first_content_at - t0, time.monotonic()
        )
        return await self._open(client, req, up, rid, rec, more, on_content, state)

    async def _admit(self, rec: Record, state: dict, res) -> None:
        """A key with limits: its admission is on disk before the upstream is contacted (a
        crash then cannot give the key back what it spent; relay/admission.py). With a
        shared store it is the reservation itself, taken in the database (429 when the key
        is spent across all relays; relay/store_pg.py)."""
        store = self.app.store
        state["admission"] = admission_id = store.next_admission_id()
        reserved = res.tokens
        prompt = min(state.get("prompt_est", 0), reserved)
        try:
            await store.admit(admission_id, rec, prompt, reserved - prompt, ADMIT_WAIT_S, res=res)
        except BudgetExceeded as exc:  # no lease taken: the row is a plain 429's
            state["admission"] = None
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

    async def _open(
        self, client, req, up, rid: bytes, rec: Record, more: bool, on_content, state: dict
    ) -> Exchange:
        """Connect (pooled or new), send the request, wait for the response head.

        The exchange starts relaying the body as soon as the head is in, without waiting for
        this coroutine to wake up; only a 429/5xx with another candidate left is held back.

        A pooled connection that turns out dead before one response byte is retried once on
        a fresh connection: llama-server closes after every stream.
        """
        d = self.app.config.dispatcher
        try:
            target = up.target.join(req.target)  # under the URL's path prefix, if any
        except TargetError as exc:
            raise RelayError(
                "bad_request", f"upstream {up.name}: {exc}", {"upstream": up.name}
            ) from None
        body = req.body
        name = served_name(up.cfg.model_map, state.get("model"))
        if name is not None:  # this upstream knows the model by another name
            body = with_model(body, name)
        # the caller's credential is the upstream's to check unless the relay checked it
        # (API keys, or its admin key on an admin call) or sends its own
        auth = self.app.auth
        mine = auth.enabled or (state.get("admin") and auth.admin is not None)
        head = upstream_request_headers(
            req.headers,
            up.host_header,
            len(body),
            rid,
            up.auth,
            up.static,
            pass_credentials=not mine and up.auth is None,
        )
        fresh = False
        while True:
            if self.app.draining:  # no upstream stream starts once the drain began
                raise shutting_down()
            try:
                conn, reused = await up.pool.acquire(d.connect_timeout_s, fresh=fresh)
            except ConnectError as exc:
                up.health.connect_failed(str(exc))
                raise _Retry(
                    RelayError(
                        "upstream_unavailable",
                        f"upstream {up.name} is unavailable: {exc}",
                        {"upstream": up.name, "error": str(exc)},
                    )
                ) from None
            ex = Exchange(
                self.app.loop,
                conn,
                client,
                req.method,
                rid,
                self.app.policy,
                d.write_timeout_s,
                rec.path,
                rec.model or "",
                up.name,
                state["hold"],
                self.app.deadlines,
            )
            ex.on_content = on_content
            state["ex"] = ex
            conn.used = True
            conn.handler = ex
            client.exchange = ex
            conn.transport.write(request_bytes(req.method, target, head, body))
            timer = self.app.loop.call_later(d.direct_read_timeout_s, ex.head_timeout)
            try:
                await ex.head_fut
                ex.head_fut = None  # (seen: not kept for the stream)
                up.health.answered()
                return ex
            except E.UpstreamGone as exc:
                conn.abort()
                if reused and exc.silent and not fresh:
                    fresh = True
                    ex.head_fut = None  # (it holds the exception, whose frames hold `ex`)
                    continue
                raise _Retry(
                    RelayError(
                        "upstream_unavailable", str(exc), {"upstream": up.name, "error": "closed"}
                    )
                ) from None
            except E.UpstreamBadHead as exc:
                conn.abort()
                raise _Retry(
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
                raise _Retry(
                    RelayError(
                        "upstream_timeout",
                        f"upstream {up.name} sent no response head within "
                        f"{d.direct_read_timeout_s}s",
                        {"upstream": up.name},
                    )
                ) from None
            except BaseException:
                client.exchange = None
                raise
            finally:
                timer.cancel()

    # ---- endpoints the relay answers itself ---------------------------------------------
    def _internal(self, client, req, rid: bytes, state: dict) -> bool:
        app = self.app
        cors = state["cors"]
        path = req.path  # normalised and bounded (it is echoed in a 404)
        if ui.is_page(path):
            ui.answer(app.auth, client, req, rid)
            return True
        relay_admin = access.is_relay_admin(path)
        if relay_admin or access.is_upstream_admin(req.method, path):
            refused = access.admin_refusal(app.auth, req.headers, client.peer_host)
            if refused is not None:
                raise RelayError(*refused)
            state["admin"] = True  # an admin call: no API key needed on top
        if relay_admin:
            now = time.monotonic()
            for up in app.upstreams.values():
                up.refresh_metrics()
            app.registry.rows_dropped = app.store.rows_dropped
            app.registry.rows_pending = app.store.pending
            app.registry.rows_spilled = getattr(app.store, "spilled", None)
            if path == "/metrics":
                client.respond(
                    200,
                    app.registry.prometheus(now),
                    rid,
                    req.keep_alive,
                    cors,
                    content_type=b"text/plain; version=0.0.4; charset=utf-8",
                )
            elif path == "/api/slots/metrics":
                client.respond(200, app.registry.json(now), rid, req.keep_alive, cors)
            elif path == ui.STATE_PATH:
                client.respond(
                    200,
                    msgspec.json.encode(ui_state.state(app, time.time(), now)),
                    rid,
                    req.keep_alive,
                    cors + ui.NO_STORE,
                )
            else:
                raise RelayError("not_found", f"no such endpoint {path}")
            return True
        if path in ("/v1/models", "/models") and req.method == b"GET" and app.router.models:
            if app.auth.enabled and app.auth.identify(req.headers) is None:
                raise RelayError("invalid_api_key", "missing or unknown API key")
            client.respond(200, model_list(app.router.models), rid, req.keep_alive, cors)
            return True
        return False

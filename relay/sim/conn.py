"""One client connection of the simulator: h11 request parsing, routing, the raw-byte answer.

`SimConnection` is the asyncio.Protocol the Simulator's server makes for each connection. h11
parses its requests one at a time (pipelined ones wait); each is recorded as a SimRequest,
routed by method and percent-decoded path, and answered: a Content-Length body (after the
delays its knobs ask for), or a stream that a Gen (gen.py) paces, on the OpenAI routes, the
native /completion, Anthropic's /v1/messages and OpenAI's /v1/responses. A generation first
asks the state for a slot (state.SimState.begin): it runs once it has one (or none, see
state.py), its delays counted from then and its first token after the prefill of the prompt
tokens its slot's cache does not spare. Keep-alive as llama-server's: at most 100 requests, an
idle timeout, and the connection closed after every stream (unless SimDefaults.keep_streams).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Protocol, cast
from urllib.parse import unquote

import h11
import msgspec

from relay.sim import plan as P
from relay.sim import wire as W
from relay.sim.completion import timings
from relay.sim.endpoints import metrics_body, misc_body
from relay.sim.frames import StreamFrames, any_nonstream_body
from relay.sim.gen import Gen
from relay.sim.state import SimRequest, SimState, SlotAsk
from relay.sim.wire import Json, Kind, Route

# The routes that generate, each with the body kind of its name.
GEN_ROUTES = (Route.CHAT, Route.TEXT, Route.NATIVE, Route.MESSAGES, Route.RESPONSES)
# What a model still loading refuses: generation, health and embeddings.
_LOADING_ROUTES = (*GEN_ROUTES, Route.HEALTH, Route.EMBEDDINGS)
_ROUTES = {
    ("GET", "/health"): Route.HEALTH,
    ("GET", "/v1/health"): Route.HEALTH,
    ("GET", "/v1/models"): Route.MODELS,
    ("GET", "/models"): Route.MODELS,
    ("GET", "/props"): Route.PROPS,
    ("GET", "/slots"): Route.SLOTS,
    ("GET", "/metrics"): Route.METRICS,
    ("POST", "/v1/chat/completions"): Route.CHAT,
    ("POST", "/chat/completions"): Route.CHAT,
    ("POST", "/v1/completions"): Route.TEXT,
    ("POST", "/completions"): Route.TEXT,
    ("POST", "/completion"): Route.NATIVE,
    ("POST", "/v1/messages"): Route.MESSAGES,
    ("POST", "/v1/messages/count_tokens"): Route.COUNT_TOKENS,
    ("POST", "/v1/responses"): Route.RESPONSES,
    ("POST", "/responses"): Route.RESPONSES,
    ("POST", "/v1/responses/input_tokens"): Route.INPUT_TOKENS,
    ("POST", "/responses/input_tokens"): Route.INPUT_TOKENS,
    ("POST", "/tokenize"): Route.TOKENIZE,
    ("POST", "/detokenize"): Route.DETOKENIZE,
    ("POST", "/v1/embeddings"): Route.EMBEDDINGS,
    ("POST", "/embeddings"): Route.EMBEDDINGS,
}
# llama-server's middleware answers it before any route, members in its own order (message,
# type, code: captured in health_loading.http), not in the order of a handler's errors.
_LOADING = b'{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'


class _Pending(Protocol):
    """What a connection's response waits on (a timer, a Gen, _STALLED); cancelled on close."""

    def cancel(self) -> None: ...


class _Stalled:
    """A response that never comes: nothing to cancel."""

    def cancel(self) -> None:
        pass


_STALLED = _Stalled()
# A generation waiting for a slot: the state's queue drops it when its request ends.
_WAITING = _Stalled()


class SimConnection(asyncio.Protocol):
    """One client connection: its h11 state, the request it answers (`req`) and what that
    answer waits on (`active`); `keep_alive` says whether the connection stays open after it."""

    # Set by connection_made, which asyncio calls before the rest.
    transport: asyncio.Transport

    def __init__(self, sim: SimState, loop: asyncio.AbstractEventLoop) -> None:
        self.sim = sim
        self.loop = loop
        self.h11 = h11.Connection(h11.SERVER)
        self.paused = False
        self.closing = False
        self.active: _Pending | None = None
        self.req: SimRequest | None = None
        self.idle: asyncio.TimerHandle | None = None
        self.nreq = 0
        self._cur: h11.Request | None = None
        self._body: list[bytes] = []
        self._in_process = False
        self.keep_alive = True

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A server's connections are stream transports (asyncio's, uvloop's or TLS ones).
        self.transport = cast(asyncio.Transport, transport)
        self.sim.track(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        try:
            self.h11.receive_data(data)
        except RuntimeError:
            return
        if self.active is None:
            self._process()
            if self.active is None:
                self._arm_idle()

    def eof_received(self) -> bool:
        self._peer_gone()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.sim.untrack(self)
        if self.idle is not None:
            self.idle.cancel()
        self._peer_gone()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if isinstance(self.active, Gen):
            self.active.resume()

    # -- lifecycle helpers
    def _peer_gone(self) -> None:
        if self.active is not None:
            self.active.cancel()
            self.active = None
        req = self.req
        if req is not None and not req.closed.is_set():
            if not self.closing:
                req.peer_closed_at = self.loop.time()
            self._end(req)

    def _end(self, req: SimRequest) -> None:
        if not req.closed.is_set():
            req.closed.set()
            if req.is_generation:
                self.sim.active_generations -= 1
                self.sim.end(req)

    def _arm_idle(self) -> None:
        if not self.closing and self.idle is None:
            self.idle = self.loop.call_later(self.sim.keepalive_timeout, self.close)

    def close(self, abort: bool = False) -> None:
        self.closing = True
        if self.active is not None:
            self.active.cancel()
            self.active = None
        if self.req is not None:
            self._end(self.req)
        if abort:
            self.transport.abort()
        else:
            self.transport.close()

    def abort(self) -> None:
        self.close(abort=True)

    def finish_stream(self) -> None:
        """Streamed responses: mark finished, then close (llama-server closes after every stream)."""
        req = self.req
        # A stream runs only while its request is the connection's.
        assert req is not None
        if self.sim.defaults.keep_streams:
            self._complete(req, self.keep_alive)
            return
        req.finished = True
        self.active = None
        self.close()

    def _complete(self, req: SimRequest, keep: bool) -> None:
        req.finished = True
        self.active = None
        if not keep:
            self.close()
            return
        self._end(req)
        self.req = None
        tail, closed = self.h11.trailing_data
        self.h11 = h11.Connection(h11.SERVER)
        if tail:
            self.h11.receive_data(tail)
        if closed:
            self.h11.receive_data(b"")
        if not self._in_process:
            self._process()
        if self.active is None:
            self._arm_idle()

    # -- request handling
    def _process(self) -> None:
        self._in_process = True
        try:
            while self.active is None and not self.closing:
                try:
                    ev = self.h11.next_event()
                except h11.RemoteProtocolError as e:
                    self.req = None
                    self.transport.write(self._simple(400, W.error_body(400, str(e)), close=True))
                    self.close()
                    return
                if isinstance(ev, h11.Request):
                    self._cur, self._body = ev, []
                    if self.h11.they_are_waiting_for_100_continue:
                        self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                elif isinstance(ev, h11.Data):
                    self._body.append(ev.data)
                elif isinstance(ev, h11.EndOfMessage):
                    self._dispatch()
                elif isinstance(ev, h11.ConnectionClosed):
                    self.close()
                    return
                else:
                    # NEED_DATA or PAUSED: wait for more bytes, or for this answer to end.
                    return
        finally:
            self._in_process = False

    @staticmethod
    def _simple(
        status: int,
        payload: bytes,
        ctype: bytes = W.JSON_CT,
        close: bool = False,
        extra: tuple[bytes, ...] = (),
    ) -> bytes:
        return W.head(status, ctype, length=len(payload), close=close, extra=extra) + payload

    def _respond(
        self,
        req: SimRequest,
        status: int,
        payload: bytes | Callable[[], bytes],
        ctype: bytes = W.JSON_CT,
        delay: float = 0.0,
        extra: tuple[bytes, ...] = (),
        setup: Callable[[], None] | None = None,
    ) -> None:
        """A Content-Length response after ``delay`` s (its payload may be a callable, built
        at send time)."""
        if delay > 0:
            self.active = self.loop.call_at(
                req.started_at + delay,
                self._respond,
                req,
                status,
                payload,
                ctype,
                0.0,
                extra,
                setup,
            )
            return
        if setup is not None:
            setup()
        keep = status < 400 and self.keep_alive
        out = payload() if callable(payload) else payload
        req.status = status
        self.transport.write(self._simple(status, out, ctype, not keep, extra))
        self._complete(req, keep)

    def _dispatch(self) -> None:
        ev = self._cur
        # h11 ends a message only after the Request that began it.
        assert ev is not None
        req = self._record(ev)
        # llama-server (cpp-httplib) percent-decodes the path before routing.
        route = _ROUTES.get((req.method, unquote(req.path.split("?", 1)[0])))
        if route is None:
            return self._respond(req, 404, W.NOT_FOUND_BODY)
        if self.sim.loading and route in _LOADING_ROUTES:
            return self._respond(req, 503, _LOADING)
        body: Json = {}
        if req.method == "POST":
            decoded = _decode(req.body)
            if isinstance(decoded, P.Refusal):
                return self._respond(req, decoded.status, decoded.body)
            body = req.json = decoded
        err = P.error_reply(body, self.sim.defaults)
        if err is not None:
            return self._respond(req, err.status, W.error_body(err.status), delay=err.delay)
        refusal = P.request_error(route, body)
        if refusal is not None:
            return self._respond(req, refusal.status, refusal.body)
        if route in GEN_ROUTES:
            return self._generate(req, Kind(route), body)
        self._answer(req, route, body)

    def _record(self, ev: h11.Request) -> SimRequest:
        """The request `ev` began, with the body read since, as the one this connection
        answers; and whether the connection stays open after it (llama-server's keep-alive:
        not for HTTP/1.0, a ``Connection: close``, or past 100 requests)."""
        self.nreq += 1
        req = SimRequest(
            method=ev.method.decode(),
            path=ev.target.decode("latin-1"),
            headers=list(ev.headers),
            body=b"".join(self._body),
            started_at=self.loop.time(),
        )
        self.sim.requests.append(req)
        self.req = req
        conn_hdr = b",".join(v for k, v in ev.headers if k == b"connection").lower()
        self.keep_alive = not (
            b"close" in conn_hdr or ev.http_version == b"1.0" or self.nreq >= 100
        )
        return req

    def _answer(self, req: SimRequest, route: Route, body: Json) -> None:
        """The answer of a route that does not generate: /metrics' text, or a JSON body."""
        sim = self.sim
        if route == Route.METRICS:
            return self._respond(
                req,
                200,
                metrics_body(sim.metrics_values()),
                ctype=W.METRICS_CT,
                extra=(b"Process-Start-Time-Unix: %d" % int(sim.start_time),),
            )
        out = misc_body(route, body, sim.defaults.model, int(sim.start_time), sim.slot_views())
        self._respond(req, 200, out)

    def _generate(self, req: SimRequest, kind: Kind, body: Json) -> None:
        sim = self.sim
        p = P.make_plan(kind, body, sim.defaults)
        req.is_generation = True
        sim.active_generations += 1
        self.active = _WAITING
        waited = False

        def start(cache_n: int) -> None:
            # One that waited for a slot counts its delays from the slot; one that did not
            # from its request.
            at = self.loop.time() if waited else req.started_at
            self._run(req, dataclasses.replace(p, cache_n=cache_n), body, at)

        def reply(made: int) -> list[int]:
            return P.reply_tokens(p, made)

        sim.begin(req, SlotAsk(p.tokens, p.cache_prompt, p.limit, reply, start))
        waited = True

    def _run(self, req: SimRequest, p: P.Plan, body: Json, at: float) -> None:
        """The generation runs, its delays counted from `at`."""
        self.active = None
        if p.error_event:
            self._error_stream(req, p, at)
        elif p.stream:
            self._stream(req, p, body, at)
        else:
            self._whole(req, p, at)

    def _slot(self, req: SimRequest) -> int:
        """The slot a generation holds, as ``id_slot`` (0 for one run without a slot)."""
        lease = req.lease
        return lease.slot.id if lease is not None and lease.slot is not None else 0

    def _error_stream(self, req: SimRequest, p: P.Plan, at: float) -> None:
        """The error_event knob: a 200 stream holding only an {"error": ...} event."""
        req.status = 200
        out = W.SSE_HEAD + W.chunk(W.ERROR_EVENT) + W.TERMINATOR

        def send() -> None:
            self.transport.write(out)
            self.finish_stream()

        self.active = self.loop.call_at(at + p.head_delay, send)

    def _stream(self, req: SimRequest, p: P.Plan, body: Json, at: float) -> None:
        """A streamed generation, paced by a Gen."""
        req.status = 200
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        empty = (
            timings(p.processed, p.predicted_n, 0.0, p.cache_n, p.prompt_ms) if p.n == 0 else None
        )
        frames = StreamFrames(
            p.kind,
            self.sim.defaults.model,
            p.prompt_n,
            include_usage,
            shape=p.shape,
            text_n=p.text_n,
            tool=p.tool,
            empty_timings=empty,
            cache_n=p.cache_n,
            slot=self._slot(req),
        )
        g = Gen(self, req, p, frames, at)
        self.active = g
        g.start()

    def _whole(self, req: SimRequest, p: P.Plan, at: float) -> None:
        """A non-streamed generation: its Content-Length body once the whole generation's time
        has passed (the prefill, then the tokens), unless the stall or drop knob stops it
        first."""
        sim = self.sim
        n = p.n or 0
        gen_s = p.ftd + max(n - 1, 0) * p.interval
        if p.stall_after is not None and (p.drop_after is None or p.stall_after <= p.drop_after):
            self.active = _STALLED
            return
        if p.drop_after is not None:
            self.active = self.loop.call_at(
                at + p.head_delay + p.prefill + p.ftd + p.drop_after * p.interval, self.abort
            )
            return

        def count() -> None:
            req.tokens_sent = n
            sim.tokens_sent_total += n
            req.completion_tokens = p.predicted_n

        def build() -> bytes:
            return any_nonstream_body(
                p.kind,
                sim.defaults.model,
                p.prompt_n,
                n,
                p.predicted_n,
                p.finish,
                timings(p.processed, p.predicted_n, gen_s * 1000.0, p.cache_n, p.prompt_ms),
                p.stop_word,
                p.settings,
                p.prompt,
                p.text_n,
                p.tool,
                p.cache_n,
                self._slot(req),
            )

        delay = at - req.started_at + p.head_delay + p.prefill + gen_s
        self._respond(req, 200, build, delay=delay, setup=count)


def _decode(raw: bytes) -> Json | P.Refusal:
    """A POST body as a JSON object, or the 400 answer to one that is not."""
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        return P.Refusal(
            400, W.error_body(400, f"[json.exception.parse_error.101] parse error: {e}")
        )
    if not isinstance(data, dict):
        return P.Refusal(400, W.error_body(400, "request body must be a JSON object"))
    return data

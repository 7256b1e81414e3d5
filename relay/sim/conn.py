"""One client connection of the simulator: h11 request parsing, routing, the raw-byte answer.

`SimConnection` is the asyncio.Protocol the Simulator's server makes for each connection. h11
parses its requests one at a time (pipelined ones wait); each is recorded as a SimRequest,
routed by method and percent-decoded path, and answered: a Content-Length body (after the
delays its knobs ask for), or a stream that a Gen (gen.py) paces, on the OpenAI routes, the
native /completion, Anthropic's /v1/messages and OpenAI's /v1/responses. Keep-alive as llama-server's:
at most 100 requests, an idle timeout, and the connection closed after every stream (unless
SimDefaults.keep_streams).
"""

from __future__ import annotations

import asyncio
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
from relay.sim.state import SimRequest, SimState

GEN_ROUTES = ("chat", "text", "native", "messages", "responses")
_ROUTES = {
    ("GET", "/health"): "health",
    ("GET", "/v1/health"): "health",
    ("GET", "/v1/models"): "models",
    ("GET", "/models"): "models",
    ("GET", "/props"): "props",
    ("GET", "/slots"): "slots",
    ("GET", "/metrics"): "metrics",
    ("POST", "/v1/chat/completions"): "chat",
    ("POST", "/chat/completions"): "chat",
    ("POST", "/v1/completions"): "text",
    ("POST", "/completions"): "text",
    ("POST", "/completion"): "native",
    ("POST", "/v1/messages"): "messages",
    ("POST", "/v1/messages/count_tokens"): "count_tokens",
    ("POST", "/v1/responses"): "responses",
    ("POST", "/responses"): "responses",
    ("POST", "/v1/responses/input_tokens"): "input_tokens",
    ("POST", "/responses/input_tokens"): "input_tokens",
    ("POST", "/tokenize"): "tokenize",
    ("POST", "/detokenize"): "detokenize",
    ("POST", "/v1/embeddings"): "embeddings",
    ("POST", "/embeddings"): "embeddings",
}
_LOADING = W.error_body(503, "Loading model", "unavailable_error")


class _Pending(Protocol):
    """What a connection's response waits on (a timer, a Gen, _STALLED); cancelled on close."""

    def cancel(self) -> None: ...


class _Stalled:
    """A response that never comes: nothing to cancel."""

    def cancel(self) -> None:
        pass


_STALLED = _Stalled()


class SimConnection(asyncio.Protocol):
    transport: asyncio.Transport  # set by connection_made, which asyncio calls before the rest

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
        self._keep = True

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a server's stream transport
        self.sim.connections_opened += 1
        self.sim._conns.add(self)
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
        self.sim._conns.discard(self)
        self.sim.connections_closed += 1
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
            if req._gen:
                self.sim.active_generations -= 1

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
        assert req is not None  # a stream runs only while its request is the connection's
        if self.sim.defaults.keep_streams:
            self._complete(req, self._keep)
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
                else:  # NEED_DATA / PAUSED
                    return
        finally:
            self._in_process = False

    @staticmethod
    def _simple(
        status: int,
        body: bytes,
        ctype: bytes = W.JSON_CT,
        close: bool = False,
        extra: tuple[bytes, ...] = (),
    ) -> bytes:
        return W.head(status, ctype, length=len(body), close=close, extra=extra) + body

    def _respond(
        self,
        req: SimRequest,
        status: int,
        body: bytes | Callable[[], bytes],
        ctype: bytes = W.JSON_CT,
        delay: float = 0.0,
        extra: tuple[bytes, ...] = (),
        setup: Callable[[], None] | None = None,
    ) -> None:
        """Content-Length response (body may be a callable built at send time), after ``delay`` s."""
        if delay > 0:
            self.active = self.loop.call_at(
                req.started_at + delay, self._respond, req, status, body, ctype, 0.0, extra, setup
            )
            return
        if setup is not None:
            setup()
        keep = status < 400 and self._keep
        out = body() if callable(body) else body
        req.status = status
        self.transport.write(self._simple(status, out, ctype, not keep, extra))
        self._complete(req, keep)

    def _dispatch(self) -> None:
        ev, sim = self._cur, self.sim
        assert ev is not None  # h11 ends a message only after the Request that began it
        self.nreq += 1
        body = b"".join(self._body)
        req = SimRequest(
            method=ev.method.decode(),
            path=ev.target.decode("latin-1"),
            headers=list(ev.headers),
            body=body,
            started_at=self.loop.time(),
        )
        sim.requests.append(req)
        self.req = req
        conn_hdr = b",".join(v for k, v in ev.headers if k == b"connection").lower()
        self._keep = not (b"close" in conn_hdr or ev.http_version == b"1.0" or self.nreq >= 100)
        # llama-server (cpp-httplib) percent-decodes the path before routing
        route = _ROUTES.get((req.method, unquote(req.path.split("?", 1)[0])))
        if route is None:
            return self._respond(req, 404, W.NOT_FOUND_BODY)
        if sim.loading and (route in GEN_ROUTES or route in ("health", "embeddings")):
            return self._respond(req, 503, _LOADING)
        data: dict = {}
        if req.method == "POST":
            try:
                data = msgspec.json.decode(body)
            except msgspec.DecodeError as e:
                return self._respond(
                    req,
                    400,
                    W.error_body(400, f"[json.exception.parse_error.101] parse error: {e}"),
                )
            if not isinstance(data, dict):
                return self._respond(
                    req, 400, W.error_body(400, "request body must be a JSON object")
                )
            req.json = data
        d = sim.defaults
        err = P.error_reply(data, d)
        if err is not None:
            status, delay = err
            return self._respond(req, status, W.error_body(status), delay=delay)
        bad = P.request_error(route, data)
        if bad is not None:
            return self._respond(req, bad[0], bad[1])
        if route in GEN_ROUTES:
            return self._generate(req, route, data)
        if route == "metrics":
            return self._respond(
                req,
                200,
                metrics_body(sim.metrics_values()),
                ctype=W.METRICS_CT,
                extra=(b"Process-Start-Time-Unix: %d" % int(sim.start_time),),
            )
        out = misc_body(
            route, data, d.model, int(sim.start_time), sim.parallel, sim.active_generations
        )
        self._respond(req, 200, out)

    def _generate(self, req: SimRequest, route: str, data: dict) -> None:
        sim = self.sim
        p = P.make_plan(route, data, sim.defaults)
        req._gen = True
        sim.active_generations += 1
        sim.prompt_tokens_total += p.prompt_n
        if p.error_event:
            req.status = 200
            out = W.SSE_HEAD + W.chunk(W.ERROR_EVENT) + W.TERMINATOR

            def send() -> None:
                self.transport.write(out)
                self.finish_stream()

            self.active = self.loop.call_at(req.started_at + p.head_delay, send)
            return
        if p.stream:
            req.status = 200
            include_usage = (
                isinstance(data.get("stream_options"), dict)
                and data["stream_options"].get("include_usage") is True
            )
            empty = timings(p.prompt_n, p.predicted_n, 0.0) if p.n == 0 else None
            frames = StreamFrames(
                p.kind,
                sim.defaults.model,
                p.prompt_n,
                include_usage,
                shape=p.shape,
                text_n=p.text_n,
                tool=p.tool,
                empty_timings=empty,
            )
            g = Gen(self, req, p, frames)
            self.active = g
            g.start()
            return
        # non-streamed
        n = p.n or 0
        gen_s = p.ftd + max(n - 1, 0) * p.interval
        if p.stall_after is not None and (p.drop_after is None or p.stall_after <= p.drop_after):
            self.active = _STALLED
            return
        if p.drop_after is not None:
            self.active = self.loop.call_at(
                req.started_at + p.head_delay + p.ftd + p.drop_after * p.interval, self.abort
            )
            return

        def count() -> None:
            req.tokens_sent = n
            sim.tokens_sent_total += n
            req.completion_tokens = p.predicted_n

        def body() -> bytes:
            return any_nonstream_body(
                p.kind,
                sim.defaults.model,
                p.prompt_n,
                n,
                p.predicted_n,
                p.finish,
                timings(p.prompt_n, p.predicted_n, gen_s * 1000.0),
                p.stop_word,
                p.settings,
                p.prompt,
                p.text_n,
                p.tool,
            )

        self._respond(req, 200, body, delay=p.head_delay + gen_s, setup=count)

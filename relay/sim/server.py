"""Built-in llama-server simulator: asyncio.Protocol + h11 request parsing, raw-byte responses.

Wire shape follows the real llama-server captures (see relay/sim_frames.py). Streams are paced
with loop.call_at chains (relay/sim_gen.py: token i due at t0 + i*interval, no drift), one
transport.write per event, and production stops while the transport is paused. Per-request
knobs come from an optional ``"sim": {...}`` object in the JSON request body (relay/sim_plan.py).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
import types
from dataclasses import dataclass, field
from urllib.parse import unquote

import h11
import msgspec

from relay.sim import frames as F
from relay.sim import plan as P
from relay.sim.gen import SSE_HEAD, Gen
from relay.sim.shapes import SHAPES

GEN_ROUTES = ("chat", "text", "native")
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
    ("POST", "/tokenize"): "tokenize",
    ("POST", "/detokenize"): "detokenize",
    ("POST", "/v1/embeddings"): "embeddings",
    ("POST", "/embeddings"): "embeddings",
}
_LOADING = F.error_body(503, "Loading model", "unavailable_error")
_STALLED = types.SimpleNamespace(cancel=lambda: None)  # a response that never comes


@dataclass
class SimDefaults:
    model: str = "models/tiny.gguf"
    tokens: int = 16
    interval_ms: float = 0.0
    first_token_delay_ms: float = 0.0
    head_delay_ms: float = 0.0
    keep_streams: bool = False  # keep the connection after a stream (as hosted APIs do)
    shape: str = "llama"  # chat chunks: llama-server's, vLLM's or OpenAI's (relay/sim_shapes.py)
    events_per_chunk: int = 1
    chunks_per_write: int = 1


@dataclass(eq=False)
class SimRequest:
    method: str
    path: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    json: dict | None = None
    started_at: float = 0.0
    tokens_sent: int = 0
    completion_tokens: int | None = None
    finished: bool = False
    peer_closed_at: float | None = None
    status: int | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _gen: bool = field(default=False, repr=False)


class _Conn(asyncio.Protocol):
    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.loop = sim._loop
        self.transport: asyncio.Transport | None = None
        self.h11 = h11.Connection(h11.SERVER)
        self.paused = False
        self.closing = False
        self.active = None
        self.req: SimRequest | None = None
        self.idle = None
        self.nreq = 0
        self._cur: h11.Request | None = None
        self._body: list[bytes] = []
        self._in_process = False
        self._keep = True

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
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

    def connection_lost(self, exc) -> None:
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
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

    def abort(self) -> None:
        self.close(abort=True)

    def finish_stream(self) -> None:
        """Streamed responses: mark finished, then close (llama-server closes after every stream)."""
        if self.sim.defaults.keep_streams:
            self._complete(self._keep)
            return
        self.req.finished = True
        self.active = None
        self.close()

    def _complete(self, keep: bool) -> None:
        req = self.req
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
                    self.transport.write(self._simple(400, F.error_body(400, str(e)), close=True))
                    self.close()
                    return
                t = type(ev)
                if t is h11.Request:
                    self._cur, self._body = ev, []
                    if self.h11.they_are_waiting_for_100_continue:
                        self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                elif t is h11.Data:
                    self._body.append(ev.data)
                elif t is h11.EndOfMessage:
                    self._dispatch()
                elif t is h11.ConnectionClosed:
                    self.close()
                    return
                else:  # NEED_DATA / PAUSED
                    return
        finally:
            self._in_process = False

    def _simple(
        self,
        status: int,
        body: bytes,
        ctype: bytes = F.JSON_CT,
        close: bool = False,
        extra: tuple = (),
    ) -> bytes:
        if self.req is not None:
            self.req.status = status
        return F.head(status, ctype, length=len(body), close=close, extra=extra) + body

    def _respond(
        self,
        status: int,
        body,
        ctype: bytes = F.JSON_CT,
        delay: float = 0.0,
        extra: tuple = (),
        setup=None,
    ) -> None:
        """Content-Length response (body may be a callable built at send time), after ``delay`` s."""
        if delay > 0:
            self.active = self.loop.call_at(
                self.req.started_at + delay, self._respond, status, body, ctype, 0.0, extra, setup
            )
            return
        if setup is not None:
            setup()
        keep = status < 400 and self._keep
        self.transport.write(
            self._simple(status, body() if callable(body) else body, ctype, not keep, extra)
        )
        self._complete(keep)

    def _dispatch(self) -> None:
        ev, sim = self._cur, self.sim
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
            return self._respond(404, F.NOT_FOUND_BODY)
        if sim.loading and (route in GEN_ROUTES or route in ("health", "embeddings")):
            return self._respond(503, _LOADING)
        data: dict = {}
        if req.method == "POST":
            try:
                data = msgspec.json.decode(body)
            except msgspec.DecodeError as e:
                return self._respond(
                    400, F.error_body(400, f"[json.exception.parse_error.101] parse error: {e}")
                )
            if not isinstance(data, dict):
                return self._respond(400, F.error_body(400, "request body must be a JSON object"))
            req.json = data
        knobs = data.get("sim") if isinstance(data.get("sim"), dict) else {}
        d = sim.defaults
        if P.as_int(knobs.get("status")) is not None and knobs["status"] >= 400:
            return self._respond(
                knobs["status"],
                F.error_body(knobs["status"]),
                delay=P.as_num(knobs.get("head_delay_ms"), d.head_delay_ms) / 1000.0,
            )
        if route in GEN_ROUTES:
            return self._generate(route, data, knobs)
        if route == "metrics":
            return self._respond(
                200,
                F.metrics_body(sim.metrics_values()),
                ctype=F.METRICS_CT,
                extra=(b"Process-Start-Time-Unix: %d" % int(sim.start_time),),
            )
        out = F.misc_body(
            route, data, d.model, int(sim.start_time), sim.parallel, sim.active_generations
        )
        self._respond(200, out)

    def _generate(self, route: str, data: dict, knobs: dict) -> None:
        sim, req = self.sim, self.req
        p = P.make_plan(route, data, sim.defaults)
        req._gen = True
        sim.active_generations += 1
        sim.prompt_tokens_total += p.prompt_n
        if knobs.get("error_event"):
            req.status = 200
            out = SSE_HEAD + F.chunk(F.ERROR_EVENT) + F.TERMINATOR

            def send():
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
            g = Gen(
                self,
                req,
                p,
                F.StreamFrames(
                    p.kind, sim.defaults.model, p.prompt_n, include_usage, shape=p.shape
                ),
            )
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
            return F.nonstream_body(
                p.kind,
                sim.defaults.model,
                p.prompt_n,
                n,
                p.predicted_n,
                p.finish,
                F.timings(p.prompt_n, p.predicted_n, gen_s * 1000.0),
                p.stop_word,
                p.settings,
                p.prompt,
            )

        self._respond(200, body, delay=p.head_delay + gen_s, setup=count)


class Simulator:
    """In-process fake llama-server. ``await start()``; ``port`` is the bound port afterwards."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, defaults: SimDefaults | None = None, ssl=None
    ) -> None:
        self.host, self.port = host, port
        self.ssl = ssl  # an ssl.SSLContext: served over TLS (connections_opened = handshakes)
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
        self._conns: set[_Conn] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl else 'http'}://{self.host}:{self.port}"

    def metrics_values(self) -> dict[str, float]:
        busy = self.active_generations
        return {
            "prompt_tokens_total": self.prompt_tokens_total,
            "tokens_predicted_total": self.tokens_sent_total,
            "n_decode_total": self.tokens_sent_total,
            "requests_processing": min(busy, self.parallel),
            "requests_deferred": max(0, busy - self.parallel),
        }

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            lambda: _Conn(self),
            self.host,
            self.port,
            reuse_address=True,
            backlog=4096,
            ssl=self.ssl,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.abort()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except (TimeoutError, Exception):
                pass
            self._server = None

    async def __aenter__(self) -> Simulator:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()


async def _serve(args: argparse.Namespace) -> None:
    ctx = None
    if args.tls_cert:
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    sim = Simulator(
        args.host,
        args.port,
        SimDefaults(
            model=args.model,
            tokens=args.tokens,
            interval_ms=args.interval_ms,
            first_token_delay_ms=args.first_token_delay_ms,
            head_delay_ms=args.head_delay_ms,
            keep_streams=args.keep_alive_streams,
            shape=args.shape,
            events_per_chunk=args.events_per_chunk,
            chunks_per_write=args.chunks_per_write,
        ),
        ssl=ctx,
    )
    await sim.start()
    print(
        F.jdump({"event": "sim_listening", "host": args.host, "port": sim.port}).decode(),
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(s, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        await sim.stop()


SIM_KNOBS_HELP = """\
per-request knobs: a request body may carry "sim": {...} overriding the flags for it:
  tokens                 int    tokens to generate (capped by n_predict/max_tokens); default --tokens
  interval_ms            float  ms between streamed tokens; default --interval-ms
  first_token_delay_ms   float  ms from the head to the first token; default --first-token-delay-ms
  head_delay_ms          float  ms before the response head; default --head-delay-ms
  status                 int    answer this HTTP status (>= 400) with an error body; default none
  error_event            bool   a 200 SSE stream holding only an {"error": ...} event; default false
  stall_after            int    stop sending after this many tokens, keep the connection; default none
  stall_mid_line         bool   with stall_after: stop inside a `data:` line; default false
  stall_mid_chunk        bool   with stall_after: stop inside a chunk; default false
  drop_after             int    close the connection after this many tokens; default none
  chatty                 bool   stream without end (interval_ms, or 10 ms); default false
  content_length_stream  bool   a stream framed by Content-Length, not chunked; default false
  body_kind              str    "octet": an application/octet-stream body; default the route's
  eos_event              bool   an empty EOS event ends a text stream; default false (true on /completion)
  shape                  str    chat chunks: "llama", "vllm" or "openai"; default --shape
  events_per_chunk       int    content events in one chunk (1..4096); default --events-per-chunk
  chunks_per_write       int    chunks in one write (1..4096); default --chunks-per-write
"""


def _count(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 4096:
        raise argparse.ArgumentTypeError("must be 1..4096")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="relay sim",
        description="llama-server simulator: OpenAI chat/completions, "
        "/completion, /health, /props, /slots, /metrics, /tokenize, embeddings, with "
        "deterministic text and exact usage/timings.",
        epilog=SIM_KNOBS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    ap.add_argument(
        "--port",
        type=int,
        default=8081,
        help="listen port, 0 for any free one (default %(default)s)",
    )
    ap.add_argument(
        "--tokens",
        type=int,
        default=16,
        help="tokens generated when the request sets no limit (count, default %(default)s)",
    )
    ap.add_argument(
        "--interval-ms",
        type=float,
        default=0.0,
        help="gap between two streamed tokens (milliseconds, default %(default)s)",
    )
    ap.add_argument(
        "--first-token-delay-ms",
        type=float,
        default=0.0,
        help="from the response head to the first token (milliseconds, default %(default)s)",
    )
    ap.add_argument(
        "--head-delay-ms",
        type=float,
        default=0.0,
        help="from the request to the response head (milliseconds, default %(default)s)",
    )
    ap.add_argument(
        "--model", default="models/tiny.gguf", help="model name it reports (default %(default)s)"
    )
    ap.add_argument(
        "--tls-cert", help="PEM certificate chain: serve over TLS (default: plain HTTP)"
    )
    ap.add_argument("--tls-key", help="PEM private key of --tls-cert (default: none)")
    ap.add_argument(
        "--keep-alive-streams",
        action="store_true",
        help="keep the connection after a stream (a hosted API), not close it "
        "(default: close, as llama-server does)",
    )
    ap.add_argument(
        "--shape",
        choices=SHAPES,
        default="llama",
        help="chat chunk shape: llama-server's, vLLM's (logprobs, usage null with "
        "include_usage), or OpenAI's (also service_tier, obfuscation padding) "
        "(default %(default)s)",
    )
    ap.add_argument(
        "--events-per-chunk",
        type=_count,
        default=1,
        help="content events coalesced in one chunk (count, default %(default)s)",
    )
    ap.add_argument(
        "--chunks-per-write",
        type=_count,
        default=1,
        help="chunks sent in one write, i.e. one read for the peer (count, default %(default)s)",
    )
    if argv and argv[0] == "sim":
        argv = argv[1:]
    args = ap.parse_args(argv)
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        try:
            runner.run(_serve(args))
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

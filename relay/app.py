"""The relay process: listener, upstreams, and the life of one request (admission to settlement)."""

from __future__ import annotations

import asyncio
import os
import re
import time

import h11
import msgspec

from relay import exchange as X
from relay import headers as hdr
from relay.client import ClientConn, Request
from relay.config import Config, ConfigError, UpstreamConfig, parse_url
from relay.errors import RelayError
from relay.log import Log
from relay.stall import StallPolicy
from relay.upstream import ConnectError, Pool

_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")


class _Peek(msgspec.Struct):
    """The few request fields the relay reads; everything else is skipped by the decoder."""

    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    n_predict: int | None = None


_peek = msgspec.json.Decoder(_Peek)


def peek_body(req: Request) -> _Peek:
    if req.method != b"POST" or not req.body:
        return _Peek()
    ctype = (hdr.get(req.headers, b"content-type") or b"application/json").lower()
    if b"json" not in ctype:
        return _Peek()
    try:
        return _peek.decode(req.body)
    except msgspec.ValidationError as exc:
        raise RelayError("bad_request", f"invalid request field: {exc}") from None
    except msgspec.DecodeError as exc:
        raise RelayError("invalid_json", f"request body is not valid JSON: {exc}") from None


class Upstream:
    def __init__(self, cfg: UpstreamConfig, keepalive_s: float) -> None:
        self.cfg = cfg
        self.name = cfg.name
        host, port = parse_url(cfg.url)
        self.host_header = (host if port == 80 else f"{host}:{port}").encode()
        self.pool = Pool(host, port, keepalive_s)
        self.auth: tuple[bytes, bytes] | None = None
        if cfg.auth_header:
            value = os.environ.get(cfg.auth_value_env or "")
            if value is None:
                raise ConfigError(
                    f"upstream.{cfg.name}.auth_value_env: environment variable "
                    f"{cfg.auth_value_env} is not set")
            self.auth = (cfg.auth_header.encode(), value.encode())


class App:
    def __init__(self, config: Config, log: Log | None = None) -> None:
        if not config.upstream:
            raise ConfigError("upstream: at least one [[upstream]] is required")
        self.config = config
        self.log = log or Log()
        d = config.dispatcher
        self.policy = StallPolicy(d.stream_idle_timeout_s, d.stream_total_timeout_s,
                                  d.direct_read_timeout_s)
        self.upstreams = [Upstream(u, d.upstream_keepalive_s) for u in config.upstream]
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.AbstractServer | None = None
        self.clients: set[ClientConn] = set()
        self.tasks: set[asyncio.Task] = set()
        self.draining = False
        self.port = 0

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        s = self.config.server
        self.server = await self.loop.create_server(
            lambda: ClientConn(self), s.host, s.port, backlog=4096, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]
        self.log.event("relay_listening", host=s.host, port=self.port,
                       upstreams=[u.name for u in self.upstreams])

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then close everything."""
        if drain_timeout_s is None:
            drain_timeout_s = self.config.server.drain_timeout_s
        self.draining = True
        if self.server is not None:
            self.server.close()
        for client in list(self.clients):
            if not client.busy and not client.gone:
                client.gone = True
                client.transport.close()
        pending = {t for t in self.tasks if not t.done()}
        self.log.event("relay_draining", in_flight=len(pending), timeout_s=drain_timeout_s)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=drain_timeout_s)
        for client in list(self.clients):
            if client.exchange is not None:
                client.exchange.shutdown()
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        for up in self.upstreams:
            up.pool.close()
        for client in list(self.clients):
            if client.transport is not None:
                client.transport.close()
        self.log.event("relay_stopped", unfinished=len([t for t in pending if not t.done()]))

    # ---- one request -------------------------------------------------------------------
    def request_id(self, req: Request) -> bytes:
        given = hdr.get(req.headers, b"x-request-id")
        if given is not None and _REQUEST_ID.match(given):
            return given
        return os.urandom(12).hex().encode()

    def route(self, path: str, model: str | None) -> Upstream:
        return self.upstreams[0]

    async def handle(self, client: ClientConn, req: Request) -> None:
        loop = self.loop
        task = asyncio.current_task()
        self.tasks.add(task)
        t0 = time.perf_counter()
        rid = self.request_id(req)
        path = req.target.split(b"?", 1)[0].decode("latin-1")
        info = {"request_id": rid.decode(), "method": req.method.decode("latin-1"),
                "path": path, "status": None, "upstream": None, "outcome": None}
        ex = None
        keep_alive = req.keep_alive
        try:
            peek = peek_body(req)
            up = self.route(path, peek.model)
            info["upstream"] = up.name
            ex = await self._open(client, req, up, rid, path, peek.model or "")
            resp = ex.head_resp
            ex.start_body(resp)
            client.exchange = ex if ex.outcome is None else None
            await ex.done
            client.exchange = None
            info["status"] = ex.status
            info["outcome"] = ex.outcome
            if not ex.head_sent and ex.outcome in (X.DROPPED, X.BAD_FRAMING, X.SHUTDOWN):
                raise RelayError("upstream_unavailable",
                                 "upstream closed the stream before any content",
                                 {"upstream": up.name, "error": ex.outcome})
            keep_alive = ex.client_keep_alive
            up.pool.release(ex.conn, ex.reusable)
        except RelayError as err:
            info["status"] = err.status
            info["outcome"] = info["outcome"] or "error"
            info["error_code"] = err.code
            keep_alive = keep_alive and err.status < 500 and err.status != 408
            client.respond(err.status, err.body(), rid, keep_alive, err.headers)
            if ex is not None:
                ex.conn.abort()
        except asyncio.CancelledError:
            info["outcome"] = X.CLIENT_GONE
            keep_alive = False
            if ex is not None:
                ex.conn.abort()
        finally:
            self.tasks.discard(task)
            client.exchange = None
            if ex is not None:
                info.update(self._stream_fields(ex, t0))
                if ex.outcome == X.STALL:
                    self.log.event("stream_stall_guard_tripped", reason=ex.stall_reason,
                                   elapsed_s=ex.stall_elapsed, upstream=ex.upstream_name,
                                   request_id=info["request_id"])
            info["client_closed"] = client.gone or info["outcome"] == X.CLIENT_GONE
            info["ms"] = round((time.perf_counter() - t0) * 1000, 3)
            self.log.event("access", **info)
            client.finish(keep_alive)

    def _stream_fields(self, ex: X.Exchange, t0: float) -> dict:
        out = {"bytes_out": ex.bytes_out}
        if ex.first_content_at is not None:
            out["ttft_ms"] = round((ex.first_content_at - t0) * 1000, 3)
        if ex.scanner is not None:
            out["content_events"] = ex.scanner.content_events
        if ex.outcome == X.STALL:
            out["error_code"] = f"stream_stall_{ex.stall_reason}"
        return out

    async def _open(self, client: ClientConn, req: Request, up: Upstream, rid: bytes,
                    path: str, model: str) -> X.Exchange:
        """Connect (pooled or new), send the request, wait for the response head.

        A pooled connection that turns out dead before one response byte is retried once on
        a fresh connection: llama-server closes after every stream.
        """
        d = self.config.dispatcher
        head = hdr.upstream_request_headers(req.headers, up.host_header, len(req.body), rid,
                                            up.auth)
        fresh = False
        while True:
            try:
                conn, reused = await up.pool.acquire(d.connect_timeout_s, fresh=fresh)
            except ConnectError as exc:
                raise RelayError("upstream_unavailable", f"upstream {up.name} is unavailable",
                                 {"upstream": up.name, "error": str(exc)}) from None
            ex = X.Exchange(self.loop, conn, client, req.method, rid, self.policy,
                            d.write_timeout_s, path, model, up.name)
            conn.handler = ex
            client.exchange = ex
            try:
                conn.transport.write(ex.request_bytes(req.target, head, req.body))
            except h11.LocalProtocolError as exc:
                conn.abort()
                raise RelayError("bad_request", f"request cannot be forwarded: {exc}") from None
            try:
                ex.head_resp = await asyncio.wait_for(ex.head_fut, d.direct_read_timeout_s)
                return ex
            except X.UpstreamGone as exc:
                conn.abort()
                if reused and exc.silent and not fresh:
                    fresh = True
                    continue
                raise RelayError("upstream_unavailable", str(exc),
                                 {"upstream": up.name, "error": "closed"}) from None
            except X.UpstreamBadHead as exc:
                conn.abort()
                raise RelayError("upstream_bad_response", "upstream sent a malformed response",
                                 {"upstream": up.name, "error": str(exc)[:200]}) from None
            except X.ClientGone:
                raise asyncio.CancelledError from None
            except (TimeoutError, asyncio.TimeoutError):
                conn.abort()
                raise RelayError(
                    "upstream_timeout",
                    f"upstream {up.name} sent no response head within "
                    f"{d.direct_read_timeout_s}s",
                    {"upstream": up.name}) from None

    def rejected(self, client: ClientConn, err: RelayError) -> None:
        """A request refused before it was read whole (400/408/413/431)."""
        self.log.event("access", request_id=None, status=err.status, outcome="rejected",
                       error_code=err.code)

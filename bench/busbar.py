"""python -m bench busbar: what a proxy adds to one request at a time, the Busbar way.

    .venv/bin/python -m bench busbar                       # 3 repeats, ~9 min; appends to bench/RESULTS.md
    .venv/bin/python -m bench busbar --repeat 1 --streams 5 --ttft-streams 20 --requests 20 --output /tmp/b.md

Busbar's open gateway benchmark (github.com/GetBusbar/benchmarking, `stream/run.sh`; the one
agentgateway, Bifrost and LiteLLM publish their added latency from) runs a mock upstream that
answers a streamed chat completion with a role chunk and 64 content deltas of 16 bytes paced
20 ms apart, drives it at concurrency 1, directly and through the gateway, and reports the
gateway's quantile minus the direct one: added TTFT p50/p99 and added inter-frame gap
p50/p99; for a whole response, the added latency at concurrency 1 against a mock that answers
at once. This harness does the same with the relay, nginx and HAProxy side by side, in one
run:

- The mock upstream (`python -m bench.busbar upstream`, its own process, uvloop) answers
  `POST /v1/chat/completions` on a kept connection, as an OpenAI-style server does:
  streamed, a `text/event-stream` head, the role chunk and the first content chunk at once
  as the request is read, then content chunk i at (first + i x 20 ms), the finish, usage
  and `[DONE]` with the last; each content delta's 16 bytes are the hex CLOCK_REALTIME
  nanoseconds at which it is written (stamped just before the write), so every chunk carries
  its own write time through any proxy. Not streamed, one chat.completion JSON (64 x 16
  bytes of content) with a Content-Length, at once.
- The client is this process: one kept connection per target, TCP_NODELAY, and the
  kernel's receive stamp of every read (SO_TIMESTAMPNS, CLOCK_REALTIME, as
  tests/support/timed_client.py: the client's own wake-up is not the proxy's). Requests go
  one at a time, the targets alternating request by request (the order rotating each
  round), direct among them, so drift of the machine lands on every target alike.
- TTFT = arrival of the first content event - the time just before the request was
  written; over the 64-chunk streams and `--ttft-streams` short ones (`--ttft-chunks`
  content chunks), pooled: at concurrency 1 the first token's path is the same. Per chunk =
  arrival - its write stamp, for content chunks 2..64 of the long streams (the first is
  the TTFT's). Gap = arrival of chunk i - arrival of chunk i-1 (Busbar's inter-frame
  figure). Whole body = the read completing a non-streamed answer - the request written.
  Added = the target's quantile - direct's, in the same repeat.
- Targets: direct; `relay serve` (bench/relay_conf.py's config, one process, uvloop as it
  runs by default); nginx (bench/nginx.py's config: 1 worker, proxy_buffering off, upstream
  keepalive); HAProxy (1 thread, `mode http`, `option http-no-delay` so that small SSE
  chunks are not held for coalescing, `http-reuse always`). A fresh proxy of each per
  repeat, warmed with a few requests first.

The report gives each repeat's absolute and added figures, their medians, relay ÷ nginx and
relay ÷ HAProxy, the proxies' CPU per request, what the relay's `Server-Timing` said
(docs/benchmarking.md), and the goals of issue 35 (added TTFT p99 under 0.5 ms, added per
chunk p99 under 20 µs), printed, not asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import nginx, procs, relay_conf, report, transit

HOST = "127.0.0.1"
TARGETS = ("direct", "relay", "nginx", "haproxy")
PROXIES = TARGETS[1:]
CHUNKS = 64
INTERVAL_MS = 20.0
QS = (50.0, 99.0)
# Figures: (key, label); all in µs.
FIGS = (
    ("ttft", "TTFT"),
    ("chunk", "per chunk"),
    ("gap", "gap"),
    ("whole", "whole body"),
)
# The relay's Server-Timing metrics (docs/benchmarking.md).
METRICS = ("relay", "queue", "upstream", "hold")
GOAL_TTFT_P99_US = 500.0
GOAL_CHUNK_US = 20.0

# -- the mock upstream ------------------------------------------------------------------------

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
HEALTH = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"status":"ok"}'
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Frames:
    """One answer's events in OpenAI's chat.completion.chunk shape; a content delta is the
    16 hex digits of its write time in ns (CLOCK_REALTIME)."""

    def __init__(self, rid: int, created: int):
        self.pre = (
            b'data: {"id":"chatcmpl-busbar%d","object":"chat.completion.chunk","created":%d,'
            b'"model":"m","choices":[{"index":0,"delta":' % (rid, created)
        )

    def role(self) -> bytes:
        return self.pre + b'{"role":"assistant","content":""},"finish_reason":null}]}\n\n'

    def content(self, t_ns: int) -> bytes:
        return self.pre + b'{"content":"%016x"},"finish_reason":null}]}\n\n' % t_ns

    def final(self, n: int, usage: bool) -> bytes:
        out = _chunk(self.pre + b'{},"finish_reason":"length"}]}\n\n')
        if usage:
            out += _chunk(
                self.pre[: self.pre.index(b'"choices"')]
                + b'"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":%d,'
                b'"total_tokens":%d}}\n\n' % (n, n + 8)
            )
        return out + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def whole_answer(rid: int, n: int) -> bytes:
    text = b"0123456789abcdef" * n
    body = (
        b'{"id":"chatcmpl-busbar%d","object":"chat.completion","created":%d,"model":"m",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":"%s"},'
        b'"finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":%d,'
        b'"total_tokens":%d}}' % (rid, int(time.time()), text, n, n + 8)
    )
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


class MockConn(asyncio.Protocol):
    """One kept connection: requests one after the other (a stream's end frees it)."""

    rid = 0

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.tr: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, tr):
        self.tr = tr
        tr.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc):
        if self.timer is not None:
            self.timer.cancel()

    def data_received(self, data: bytes):
        self.buf += data
        self._next()

    def _next(self):
        while not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
            method, target = head[0].split(" ")[:2]
            self._answer(method, target.split("?")[0], body)

    def _answer(self, method: str, path: str, body: bytes):
        if method == "GET" and path in ("/health", "/v1/health"):
            self.tr.write(HEALTH)
            return
        if method != "POST" or not path.endswith("/chat/completions"):
            self.tr.write(NOT_FOUND)
            return
        req = json.loads(body or b"{}")
        knobs = req.get("busbar") or {}
        n = max(1, int(knobs.get("chunks") or CHUNKS))
        MockConn.rid += 1
        if not req.get("stream"):
            self.tr.write(whole_answer(MockConn.rid, n))
            return
        opts = req.get("stream_options") or {}
        f = Frames(MockConn.rid, int(time.time()))
        usage = bool(opts.get("include_usage"))
        first = SSE_HEAD + _chunk(f.role()) + _chunk(f.content(time.time_ns()))
        if n == 1:
            self.tr.write(first + f.final(n, usage))
            return
        self.tr.write(first)
        self.busy = True
        interval = float(knobs.get("interval_ms") or INTERVAL_MS) / 1000
        start = self.loop.time()

        def step(i: int):
            data = _chunk(f.content(time.time_ns()))
            if i + 1 == n:
                self.timer = None
                self.tr.write(data + f.final(n, usage))
                self.busy = False
                self._next()
                return
            self.tr.write(data)
            self.timer = self.loop.call_at(start + (i + 1) * interval, step, i + 1)

        self.timer = self.loop.call_at(start + interval, step, 1)


def _loop_factory():
    try:
        import uvloop

        return uvloop.new_event_loop
    except ImportError:
        return None


def upstream_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.busbar upstream")
    p.add_argument("--host", default=HOST)
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)

    async def serve():
        srv = await asyncio.get_running_loop().create_server(MockConn, a.host, a.port)
        port = srv.sockets[0].getsockname()[1]
        print(json.dumps({"event": "busbar_upstream_listening", "port": port}), flush=True)
        await asyncio.Event().wait()

    with asyncio.Runner(loop_factory=_loop_factory()) as r:
        r.run(serve())
    return 0


# -- HAProxy ----------------------------------------------------------------------------------

HAPROXY_CONF = """\
# generated by bench/busbar.py
global
    nbthread 1
    maxconn 4096
    pidfile {tmp}/haproxy.pid

defaults
    mode http
    # Without it HAProxy asks the kernel to coalesce small writes (MSG_MORE): SSE chunks of
    # a few dozen bytes wait for more, up to ~200 ms.
    option http-no-delay
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    timeout http-keep-alive 65s

frontend fe
    bind {host}:{port}
    default_backend be

backend be
    http-reuse always
    server up {up_host}:{up_port}
"""


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)),
        None,
    )


def haproxy_version() -> str:
    b = haproxy_binary()
    if not b:
        return "not found"
    out = subprocess.run([b, "-v"], capture_output=True, text=True)
    line = (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "?"
    return line.replace("HAProxy version ", "").split(" - ")[0]


# -- the client -------------------------------------------------------------------------------

# Linux's SO_TIMESTAMPNS (SCM_TIMESTAMPNS is the same number), which Python does not name.
SO_TIMESTAMPNS = 35
TIMESPEC = struct.Struct("qq")
CONTENT = re.compile(rb'"content":"([0-9a-f]{16})"')
TIMING = re.compile(r"(\w+);dur=([0-9.]+)")


class Answer:
    """One request's answer as the client saw it (times in CLOCK_REALTIME ns)."""

    __slots__ = ("end", "error", "events", "head", "sent", "status", "timing", "unstamped")

    def __init__(self, sent: int):
        self.sent = sent
        self.status = 0
        self.head = 0
        self.end = 0
        # (write stamp, arrival) of each content event.
        self.events: list[tuple[int, int]] = []
        self.timing: dict[str, float] = {}
        self.error: str | None = None
        self.unstamped = 0


class Client:
    """A kept connection to one target; one request at a time."""

    def __init__(self, port: int):
        self.port = port
        self.sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        s = socket.create_connection((HOST, self.port), timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        return s

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _recv(self, a: Answer) -> tuple[bytes, int]:
        data, anc, _, _ = self.sock.recvmsg(262144, socket.CMSG_SPACE(TIMESPEC.size))
        for level, kind, value in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, ns = TIMESPEC.unpack(value[: TIMESPEC.size])
                return data, sec * 1_000_000_000 + ns
        a.unstamped += 1
        return data, time.time_ns()

    def ask(self, request: bytes) -> Answer:
        if self.sock is None:
            self.sock = self._connect()
        a = Answer(time.time_ns())
        try:
            self.sock.sendall(request)
            self._read(a)
        except (OSError, ValueError) as e:
            a.error = a.error or repr(e)
        if a.error:
            self.close()
        return a

    def _read(self, a: Answer):
        buf = b""
        while True:
            data, at = self._recv(a)
            if not data:
                a.error = "closed before the head"
                return
            buf += data
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
        a.head = at
        lines = buf[:end].decode("latin-1").split("\r\n")
        a.status = int(lines[0].split(" ")[1])
        headers = [ln.partition(":") for ln in lines[1:]]
        hs = [(k.strip().lower(), v.strip()) for k, _, v in headers]
        for k, v in hs:
            if k == "server-timing" and v.startswith("relay;"):
                a.timing = {m: float(d) for m, d in TIMING.findall(v)}
        chunked = any(k == "transfer-encoding" and "chunked" in v.lower() for k, v in hs)
        length = next((int(v) for k, v in hs if k == "content-length"), None)
        close = any(k == "connection" and "close" in v.lower() for k, v in hs)
        rest = buf[end + 4 :]
        if chunked:
            self._chunked(a, rest, at)
        elif length is not None:
            self._sized(a, rest, at, length)
        else:
            a.error = "neither chunked nor sized"
        if close:
            self.close()

    def _sized(self, a: Answer, body: bytes, at: int, length: int):
        while len(body) < length:
            data, at = self._recv(a)
            if not data:
                a.error = "closed within the body"
                return
            body += data
        a.end = at
        self._events(a, body, at)

    def _chunked(self, a: Answer, raw: bytes, at: int):
        """Whole chunks decoded as they come; each whole event stamped with the read that
        completed it."""
        pos, events = 0, b""
        while True:
            while True:
                j = raw.find(b"\r\n", pos)
                if j < 0:
                    break
                size = int(raw[pos:j].split(b";")[0], 16)
                if size == 0:
                    if raw.find(b"\r\n", j + 2) < 0:
                        break  # (the trailer's end is still to come)
                    a.end = at
                    self._events(a, events, at)
                    return
                if j + 2 + size + 2 > len(raw):
                    break
                events += raw[j + 2 : j + 2 + size]
                pos = j + 2 + size + 2
            k = events.rfind(b"\n\n")
            if k >= 0:
                self._events(a, events[: k + 2], at)
                events = events[k + 2 :]
            raw, pos = raw[pos:], 0
            data, at = self._recv(a)
            if not data:
                a.error = "closed within the body"
                return
            raw += data

    @staticmethod
    def _events(a: Answer, events: bytes, at: int):
        for m in CONTENT.finditer(events):
            a.events.append((int(m.group(1), 16), at))


def request_bytes(port: int, stream: bool, chunks: int, interval_ms: float) -> bytes:
    """A chat completion request of about 256 bytes of JSON (Busbar's PSIZE); `busbar` tells
    the mock how many content chunks, how far apart."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": ""}],
        "stream": stream,
        "max_tokens": chunks,
        "busbar": {"chunks": chunks, "interval_ms": interval_ms},
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    size = len(json.dumps(body, separators=(",", ":")))
    body["messages"][0]["content"] = "x" * max(0, 256 - size)
    data = json.dumps(body, separators=(",", ":")).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


# -- pure parts -------------------------------------------------------------------------------


def pct(sorted_values, p: float):
    """Nearest-rank percentile of an ascending sequence (None when empty)."""
    n = len(sorted_values)
    if not n:
        return None
    k = -(-p * n // 100)
    return sorted_values[min(n - 1, max(0, int(k) - 1))]


def quantiles(values) -> dict:
    v = sorted(values)
    return {**{f"p{p:g}": pct(v, p) for p in QS}, "n": len(v)}


def figures(answers: list[Answer], kind: str) -> dict[str, list[float]]:
    """The samples (µs) of one target's answers of one kind ("long", "short", "whole")."""
    out: dict[str, list[float]] = {"ttft": [], "chunk": [], "gap": [], "whole": []}
    for a in answers:
        if a.error or a.status != 200:
            continue
        if kind == "whole":
            out["whole"].append((a.end - a.sent) / 1e3)
            continue
        if not a.events:
            continue
        out["ttft"].append((a.events[0][1] - a.sent) / 1e3)
        if kind == "long":
            out["chunk"] += [(arr - w) / 1e3 for w, arr in a.events[1:]]
            out["gap"] += [
                (a.events[i][1] - a.events[i - 1][1]) / 1e3 for i in range(1, len(a.events))
            ]
    return out


def added(rows: list[dict], row: dict, fig: str, q: str):
    """row's quantile q of fig minus direct's, same repeat; None when either is missing."""
    d = next((x for x in rows if x["target"] == "direct" and x["repeat"] == row["repeat"]), None)
    a = row.get(fig, {}).get(q)
    b = d.get(fig, {}).get(q) if d else None
    return None if a is None or b is None else a - b


# -- orchestration ----------------------------------------------------------------------------


class Upstream:
    def __init__(self, logdir: Path):
        argv = [sys.executable, "-m", "bench.busbar", "upstream", "--host", HOST]
        self.proc = procs.Proc("busbar-upstream", argv, logdir)
        self.port = int(self.proc.wait_json_event("busbar_upstream_listening")["port"])
        self.proc.wait_http(HOST, self.port, "/health")
        self.url = f"http://{HOST}:{self.port}"

    def stop(self):
        self.proc.stop()


def start_proxy(target: str, up: Upstream, logdir: Path, a) -> procs.Proc | None:
    if target == "direct":
        return None
    port = procs.free_port(HOST)
    tmp = logdir / target
    tmp.mkdir(exist_ok=True)
    if target == "relay":
        conf = relay_conf.write(up.url, tmp, a.relay_config)
        argv = [sys.executable, "-m", "relay", "serve", "--config", str(conf)]
        argv += ["--host", HOST, "--port", str(port)] + shlex.split(a.relay_args or "")
        p = procs.Proc(target, argv, logdir)
    elif target == "nginx":
        conf = nginx.write_conf(tmp, HOST, port, HOST, up.port)
        p = procs.Proc(target, nginx.argv(tmp, conf), logdir)
    else:
        conf = tmp / "haproxy.cfg"
        conf.write_text(
            HAPROXY_CONF.format(tmp=tmp, host=HOST, port=port, up_host=HOST, up_port=up.port)
        )
        p = procs.Proc(target, [haproxy_binary(), "-db", "-f", str(conf)], logdir)
    p.port = port  # type: ignore[attr-defined]
    p.wait_http(HOST, port, "/health")
    return p


def run_repeat(rep: int, targets: list[str], up: Upstream, logdir: Path, a) -> list[dict]:
    """One repeat: fresh proxies, a warm-up, then the three kinds of requests, the targets
    alternating request by request."""
    proxies: dict[str, procs.Proc] = {}
    # Other work on the machine lands in every figure: wait (a while) for a quieter moment.
    quiet = transit.wait_quiet(up, None, a.quiet_pct, a.quiet_wait_s)
    try:
        for t in targets:
            p = start_proxy(t, up, logdir, a)
            if p is not None:
                proxies[t] = p
        clients = {t: Client(proxies[t].port if t in proxies else up.port) for t in targets}
        kinds = [
            ("long", True, a.chunks, a.streams),
            ("short", True, a.ttft_chunks, a.ttft_streams),
            ("whole", False, a.chunks, a.requests),
        ]
        for t in targets:  # warm-up: connections, pools, the relay's first-request paths
            for _, stream, chunks, _ in kinds:
                for _ in range(a.warmup):
                    req = request_bytes(clients[t].port, stream, min(chunks, 4), a.interval_ms)
                    clients[t].ask(req)
        cpu0 = {t: p.cpu_us() for t, p in proxies.items()}
        busy0, up0, me0, w0 = procs.system_busy_us(), up.proc.cpu_us(), _own_cpu_us(), time.time()
        got: dict[str, dict[str, list[Answer]]] = {t: {k[0]: [] for k in kinds} for t in targets}
        for kind, stream, chunks, n in kinds:
            reqs = {
                t: request_bytes(clients[t].port, stream, chunks, a.interval_ms) for t in targets
            }
            for i in range(n):
                k = i % len(targets)
                for t in targets[k:] + targets[:k]:
                    got[t][kind].append(clients[t].ask(reqs[t]))
            print(f"busbar:   [{rep + 1}] {kind}: {n} per target", file=sys.stderr, flush=True)
        wall = time.time() - w0
        cpu = {t: p.cpu_us() - cpu0[t] for t, p in proxies.items()}
        other = (
            procs.system_busy_us()
            - busy0
            - (up.proc.cpu_us() - up0)
            - sum(cpu.values())
            - (_own_cpu_us() - me0)
        )
        for c in clients.values():
            c.close()
    finally:
        for p in proxies.values():
            p.stop()
    rows = []
    for t in targets:
        answers = [x for k in got[t].values() for x in k]
        samples = {"ttft": [], "chunk": [], "gap": [], "whole": []}
        for kind, xs in got[t].items():
            for fig, vals in figures(xs, kind).items():
                samples[fig] += vals
        row = {"target": t, "repeat": rep, "requests": len(answers)}
        row.update({fig: quantiles(vals) for fig, vals in samples.items()})
        row["errors"] = sum(1 for x in answers if x.error or x.status != 200)
        row["error_samples"] = sorted(
            {x.error or f"status {x.status}" for x in answers if x.error or x.status != 200}
        )[:3]
        row["short_events"] = sum(
            1 for x in got[t]["long"] if not x.error and len(x.events) != a.chunks
        )
        row["unstamped"] = sum(x.unstamped for x in answers)
        if t in cpu:
            row["cpu_us_per_request"] = cpu[t] / max(1, len(answers))
        row["other_cpu_pct"] = max(0.0, other) / wall / 1e4
        row["quiet"] = quiet
        row["wall_s"] = wall
        timed = [
            x for k in ("long", "short") for x in got[t][k] if x.timing and x.events and not x.error
        ]
        if timed:
            row["server_timing"] = {
                m: quantiles([x.timing.get(m, 0.0) * 1e3 for x in timed]) for m in METRICS
            }
            # What a client taking out the upstream's share and the queue is left with: the
            # relay itself, and the client's way to it and back.
            row["ttft_less_upstream"] = quantiles(
                [
                    (x.events[0][1] - x.sent) / 1e3
                    - sum(x.timing.get(m, 0.0) for m in ("queue", "upstream", "hold")) * 1e3
                    for x in timed
                ]
            )
        rows.append(row)
    return rows


def _own_cpu_us() -> float:
    t = os.times()
    return (t.user + t.system) * 1e6


# -- the report -------------------------------------------------------------------------------


def _n(x, nd: int = 0) -> str:
    return "–" if x is None else f"{x:,.{nd}f}"


def _s(x, nd: int = 0) -> str:
    return "–" if x is None else f"{x:+,.{nd}f}"


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a, b):
    return None if a is None or b is None or b <= 0 else a / b


def commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "relay", "bench/*.py"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return rev + (" (with uncommitted changes)" if dirty else "")


def added_cells(rows, t, fig) -> tuple[list, list]:
    """Per-repeat added p50 and p99 of fig for target t."""
    rs = sorted((r for r in rows if r["target"] == t), key=lambda r: r["repeat"])
    return [added(rows, r, fig, "p50") for r in rs], [added(rows, r, fig, "p99") for r in rs]


def _cell(per: list) -> str:
    if len(per) == 1:
        return _s(per[0])
    return f"**{_s(_med(per))}** ({', '.join(_s(x) for x in per)})"


def summary_table(rows, targets) -> list[str]:
    out = [
        "| added over direct, µs | TTFT p50 | TTFT p99 | per chunk p50 | per chunk p99"
        " | gap p50 | gap p99 | whole body p50 | whole body p99 | proxy CPU µs/request |",
        "|" + "---|" * 10,
    ]
    for t in targets:
        if t == "direct":
            continue
        cells = []
        for fig, _ in FIGS:
            p50, p99 = added_cells(rows, t, fig)
            cells += [_cell(p50), _cell(p99)]
        cpu = [
            r.get("cpu_us_per_request")
            for r in sorted(rows, key=lambda r: r["repeat"])
            if r["target"] == t
        ]
        cells.append(
            f"{_n(_med(cpu))} ({', '.join(_n(x) for x in cpu)})" if len(cpu) > 1 else _n(_med(cpu))
        )
        out.append(f"| {t} | " + " | ".join(cells) + " |")
    return out


def ratio_table(rows, targets) -> list[str]:
    """The relay's added figures (and CPU) ÷ nginx's and ÷ HAProxy's, each repeat's ratio."""
    out = [
        "| relay ÷ | TTFT p50 | TTFT p99 | per chunk p50 | per chunk p99 | whole body p50"
        " | whole body p99 | proxy CPU per request |",
        "|" + "---|" * 8,
    ]
    reps = sorted({r["repeat"] for r in rows})
    for other in ("nginx", "haproxy"):
        if other not in targets or "relay" not in targets:
            continue
        cells = []
        for fig in ("ttft", "chunk", "whole"):
            for q in ("p50", "p99"):
                per = []
                for rep in reps:
                    mine = next(r for r in rows if r["target"] == "relay" and r["repeat"] == rep)
                    theirs = next(r for r in rows if r["target"] == other and r["repeat"] == rep)
                    per.append(_ratio(added(rows, mine, fig, q), added(rows, theirs, fig, q)))
                cells.append(_ratio_cell(per))
        per = []
        for rep in reps:
            mine = next(r for r in rows if r["target"] == "relay" and r["repeat"] == rep)
            theirs = next(r for r in rows if r["target"] == other and r["repeat"] == rep)
            per.append(_ratio(mine.get("cpu_us_per_request"), theirs.get("cpu_us_per_request")))
        cells.append(_ratio_cell(per))
        out.append(f"| {other} | " + " | ".join(cells) + " |")
    return out


def _ratio_cell(per: list) -> str:
    f = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
    if len(per) == 1:
        return f(per[0]) + "×"
    return f"**{f(_med(per))}×** ({', '.join(f(x) for x in per)})"


def repeat_table(rows, targets) -> list[str]:
    out = [
        "| repeat | target | requests | TTFT p50 | TTFT p99 | per chunk p50 | per chunk p99"
        " | gap p50 | gap p99 | whole p50 | whole p99 | errors | streams short of events"
        " | other CPU % before / during |",
        "|" + "---|" * 14,
    ]
    for r in sorted(rows, key=lambda r: (r["repeat"], targets.index(r["target"]))):
        cells = [str(r["repeat"] + 1), r["target"], str(r["requests"])]
        for fig, _ in FIGS:
            cells += [_n(r[fig]["p50"]), _n(r[fig]["p99"])]
        before = r.get("quiet", {}).get("other_pct")
        cells += [str(r["errors"]), str(r["short_events"])]
        cells.append(f"{_n(before)} / {_n(r['other_cpu_pct'])}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def timing_table(rows) -> list[str]:
    """The relay's Server-Timing beside what this run measured: upstream;dur + hold;dur
    estimates what a direct client would see as TTFT (direct TTFT, same repeat), and client
    TTFT − queue − upstream − hold what the relay itself took of it with the way to it and
    back (beside the added TTFT, same repeat)."""
    rs = sorted((r for r in rows if r.get("server_timing")), key=lambda r: r["repeat"])
    if not rs:
        return []
    out = [
        "| repeat | relay;dur p50 / p99 | queue;dur p50 / p99 | upstream;dur p50 / p99"
        " | hold;dur p50 / p99 | direct TTFT p50 / p99"
        " | client TTFT − queue − upstream − hold p50 / p99 | added TTFT p50 / p99 |",
        "|" + "---|" * 8,
    ]
    for r in rs:
        st, less = r["server_timing"], r["ttft_less_upstream"]
        d = next(x for x in rows if x["target"] == "direct" and x["repeat"] == r["repeat"])
        pair = lambda q: f"{_n(q['p50'])} / {_n(q['p99'])}"  # noqa: E731
        add = f"{_s(added(rows, r, 'ttft', 'p50'))} / {_s(added(rows, r, 'ttft', 'p99'))}"
        out.append(
            f"| {r['repeat'] + 1} | {pair(st['relay'])} | {pair(st['queue'])}"
            f" | {pair(st['upstream'])} | {pair(st['hold'])} | {pair(d['ttft'])}"
            f" | {pair(less)} | {add} |"
        )
    return out


def goals(rows) -> list[str]:
    _, t99 = added_cells(rows, "relay", "ttft")
    c50, c99 = added_cells(rows, "relay", "chunk")
    if not t99:
        return []
    mt, mc50, mc99 = _med(t99), _med(c50), _med(c99)
    ok = lambda x, g: "–" if x is None else ("met" if x < g else "not met")  # noqa: E731
    return [
        f"- added TTFT p99 under {GOAL_TTFT_P99_US:g} µs: {_s(mt)} µs, median of repeats"
        f" ({', '.join(_s(x) for x in t99)}): **{ok(mt, GOAL_TTFT_P99_US)}**",
        f"- added per chunk under {GOAL_CHUNK_US:g} µs: p50 {_s(mc50)} µs"
        f" (**{ok(mc50, GOAL_CHUNK_US)}**), p99 {_s(mc99)} µs"
        f" ({', '.join(_s(x) for x in c99)}; **{ok(mc99, GOAL_CHUNK_US)}**)",
    ]


def render(rows: list[dict], a, targets: list[str], command: str) -> str:
    out = [
        "# Busbar-style added latency at concurrency 1: relay, nginx, HAProxy (issue 35 item 4)",
        "",
    ]
    out += report.machine()
    out += [
        f"- haproxy: {haproxy_version()}",
        f"- commit: {commit()}",
        f"- command: `{command}`",
        f"- upstream: bench/busbar.py's mock (uvloop, kept connections): streamed, the role"
        f" and first content chunk at once, then one content chunk every {a.interval_ms:g} ms,"
        f" {a.chunks} in all, each delta the 16 hex digits of its write time; not streamed,"
        f" the whole JSON at once",
        f"- each repeat, per target, one at a time, alternating: {a.streams} streams of"
        f" {a.chunks} chunks, {a.ttft_streams} streams of {a.ttft_chunks} chunks (TTFT"
        f" samples), {a.requests} non-streamed requests; after {a.warmup} warm-up requests of"
        f" each kind; a fresh proxy each repeat",
        "- client: this process, one kept connection per target, kernel receive stamps"
        " (SO_TIMESTAMPNS); relay: `relay serve`, one process (uvloop), bench/relay_conf.py"
        + (f", `{a.relay_args}`" if a.relay_args else "")
        + "; nginx: bench/nginx.py's config (1 worker, proxy_buffering off); HAProxy: 1"
        " thread, mode http, option http-no-delay, http-reuse always",
        "",
        "## Added over direct (median of repeats, each repeat in brackets)",
        "",
    ]
    out += summary_table(rows, targets)
    out += ["", "The relay's figures ÷ nginx's and HAProxy's (same repeat):", ""]
    out += ratio_table(rows, targets)
    out += ["", "Goals of issue 35 for the relay (printed, not asserted):", ""]
    out += goals(rows)
    out += ["", "## Each repeat (absolute, µs)", ""]
    out += repeat_table(rows, targets)
    tt = timing_table(rows)
    if tt:
        out += [
            "",
            "## What the relay's Server-Timing said (its streamed answers, µs)",
            "",
            *tt,
        ]
    errs = [
        f"{r['target']}/{r['repeat'] + 1}: {'; '.join(r['error_samples'])}"
        for r in rows
        if r["errors"]
    ]
    unstamped = sum(r["unstamped"] for r in rows)
    out += [
        "",
        "Reading: TTFT = first content event's arrival − the request about to be written"
        " (long and short streams pooled); per chunk = arrival − the chunk's write stamp,"
        " chunks 2..N of the long streams; gap = arrival of chunk i − chunk i−1 (Busbar's"
        " inter-frame figure; ≈ the pace, the added gap ≈ 0 for a proxy that passes each"
        " chunk as it comes); whole body = the read completing a non-streamed answer − the"
        " request written. Arrivals are the kernel's receive stamps of the reads. Added ="
        " the target's quantile − direct's in the same repeat (Busbar's subtraction). Proxy"
        " CPU per request counts every request of the repeat (all kinds). Other CPU = the"
        " machine's busy time not used by the upstream, the proxies or the client, % of one"
        f" core, over 0.5 s before the repeat (after waiting up to {a.quiet_wait_s:g} s for"
        f" it to fall under {a.quiet_pct:g} %) and during it.",
        f"Errors: {sum(r['errors'] for r in rows)}"
        + (f" ({'; '.join(errs)})" if errs else "")
        + f"; reads without a kernel stamp: {unstamped}.",
        "",
    ]
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench busbar", description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--streams", type=int, default=30, help="long streams per target and repeat")
    p.add_argument("--chunks", type=int, default=CHUNKS, help="content chunks of a long stream")
    p.add_argument("--interval-ms", type=float, default=INTERVAL_MS, help="the mock's pace")
    p.add_argument("--ttft-streams", type=int, default=200, help="short streams (TTFT samples)")
    p.add_argument("--ttft-chunks", type=int, default=2, help="content chunks of a short stream")
    p.add_argument("--requests", type=int, default=200, help="non-streamed requests")
    p.add_argument("--warmup", type=int, default=5, help="warm-up requests of each kind")
    p.add_argument(
        "--quiet-pct",
        type=float,
        default=25.0,
        help="before each repeat wait until other work uses under this %% of a core",
    )
    p.add_argument("--quiet-wait-s", type=float, default=30.0, help="at most this long")
    p.add_argument("--relay-args", default="", help="more `relay serve` arguments")
    p.add_argument("--relay-config", help="TOML merged over the generated relay config")
    p.add_argument(
        "--output",
        default=str(Path(__file__).parent / "RESULTS.md"),
        help="the report is appended here",
    )
    p.add_argument("--json", help="also write the raw per-run rows here")
    p.add_argument("--keep-logs", action="store_true")
    return p.parse_args(argv)


def _public(argv: list[str]) -> list[str]:
    """The command's arguments without where its files went (no machine path in a report)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in ("--output", "--json"):
            skip = True
        elif not x.startswith(("--output=", "--json=")):
            out.append(x)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "upstream":
        return upstream_main(argv[1:])
    a = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    procs.raise_nofile()
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    if bad := [t for t in targets if t not in TARGETS]:
        raise SystemExit(f"unknown target: {bad}")
    if "direct" not in targets:
        targets.insert(0, "direct")
    missing = [
        t
        for t, ok in (("nginx", nginx.binary()), ("haproxy", haproxy_binary()))
        if t in targets and not ok
    ]
    for t in missing:
        print(f"busbar: {t} not found: left out", file=sys.stderr)
        targets.remove(t)
    logdir = Path(tempfile.mkdtemp(prefix="relay-busbar-"))
    rows: list[dict] = []
    up = None
    try:
        up = Upstream(logdir)
        for rep in range(a.repeat):
            print(f"busbar: repeat {rep + 1}/{a.repeat} ...", file=sys.stderr, flush=True)
            rows += run_repeat(rep, targets, up, logdir, a)
            if up.proc.popen.poll() is not None:
                raise RuntimeError(f"the upstream exited: {up.proc.tail()}")
    except KeyboardInterrupt:
        print("busbar: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"busbar: error: {e}\nbusbar: logs in {logdir}", file=sys.stderr)
        a.keep_logs = True
        return 2
    finally:
        if up:
            up.stop()
        procs.stop_all()
        if not a.keep_logs:
            shutil.rmtree(logdir, ignore_errors=True)
    command = "python -m bench busbar " + " ".join(shlex.quote(x) for x in _public(argv))
    text = render(rows, a, targets, command.strip())
    print(text)
    out = Path(a.output)
    prior = out.read_text() if out.exists() else ""
    out.write_text(prior + ("\n" if prior and not prior.endswith("\n\n") else "") + text)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(
        f"busbar: appended to {out} ({datetime.datetime.now(datetime.UTC):%H:%M:%S} UTC)",
        file=sys.stderr,
    )
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

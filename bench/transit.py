"""python -m bench.transit: the latency a proxy adds, per event and per request, measured.

    .venv/bin/python -m bench.transit --loads 64,256,512 --rate 50 --step-ms 20 \
        --duration-s 10 --tokens 100 --repeat 3 --targets direct,relay,nginx \
        --output bench/RESULTS-transit.md

A stamping upstream (``python -m bench.transit upstream``, its own process, the same one for
every target of a run) answers ``POST /v1/chat/completions`` with llama-server's chunks and,
as a batched GPU server does, ONE timer every ``step_ms`` writes the next event of every live
stream; each content event carries its send time, ``"t_ns":<CLOCK_MONOTONIC ns>``, stamped
just before that stream's write (the relay and nginx pass the bytes through). The first
content event goes out as soon as the request is read (prefill takes no time here), so TTFT
has no step quantisation in it. The client (``python -m bench.transit client``, one or more
processes) keeps N streams open through the target and records, for every content event,
transit = the receive stamp of the read that brought it − its send stamp (one clock: the
processes share CLOCK_MONOTONIC), and for every request TTFT = first content event − the
request about to be written. Added = target − direct, quantile by quantile, within a repeat.

Load: N slots; slot i's first stream starts at i/N of ``--ramp-s`` and carries (1 − i/N) of
``--tokens``, later streams carry ``--tokens`` each (cut to what fits before the end), so N
streams are live from the ramp to the end and requests arrive evenly, N ÷ stream length per
second. Transit counts events stamped after ``--warmup-s``; TTFT counts the requests after
the first wave (the ramp is a connection storm), or all when there are no others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

from bench import load as bload
from bench import nginx, procs, relay_conf, report

HOST = "127.0.0.1"
TARGETS = ("direct", "relay", "nginx", "relay_w2", "nginx_w2")
# relay_w2 / nginx_w2: `relay serve --workers 2` / nginx `worker_processes 2` (issue 24)
QS = (50.0, 99.0, 99.9)  # transit quantiles
TTFT_QS = (50.0, 99.0)
mono = time.monotonic_ns

# -- pure parts -------------------------------------------------------------------------------

STAMP = b'"t_ns":'
TOKENS = [b'" Hello"', b'" from"', b'" a"', b'" tiny"', b'" llama"', b'"."']


def stamps_in(buf: bytes, start: int = 0, end: int | None = None) -> list[int]:
    """The send stamps (``"t_ns":<int>``) in buf[start:end], in order: one per content event."""
    end = len(buf) if end is None else end
    out = []
    i = buf.find(STAMP, start, end)
    while i >= 0:
        i += len(STAMP)
        j = i
        while j < end and 48 <= buf[j] <= 57:
            j += 1
        if j > i:
            out.append(int(buf[i:j]))
        i = buf.find(STAMP, j, end)
    return out


def stamp_of(event: bytes) -> int | None:
    """The send stamp of one SSE event, None when it has none."""
    s = stamps_in(event)
    return s[0] if s else None


def pct(sorted_values, p: float):
    """Nearest-rank percentile of an ascending sequence (None when empty): the smallest value
    with at least p % of the values at or below it."""
    n = len(sorted_values)
    if not n:
        return None
    k = -(-p * n // 100)  # ceil(p * n / 100)
    return sorted_values[min(n - 1, max(0, int(k) - 1))]


def quantiles(values, ps=QS) -> dict:
    v = sorted(values)
    return {**{_qkey(p): pct(v, p) for p in ps}, "n": len(v)}


def _qkey(p: float) -> str:
    return f"p{p:g}"


def added(rows: list[dict], row: dict, kind: str, q: str):
    """row's quantile `q` of `kind` ("transit_us"/"ttft_ms") minus direct's, same load and
    repeat; None when either is missing."""
    d = next(
        (
            x
            for x in rows
            if x["target"] == "direct"
            and x["load"] == row["load"]
            and x["repeat"] == row["repeat"]
            and "skipped" not in x
        ),
        None,
    )
    a = row.get(kind, {}).get(q)
    b = d.get(kind, {}).get(q) if d else None
    return None if a is None or b is None else a - b


def added_table(rows: list[dict], load: int, targets) -> list[dict]:
    """Per proxy target: for each figure, the per-repeat added values and their median."""
    out = []
    for t in targets:
        if t == "direct":
            continue
        rs = sorted(
            (r for r in rows if r["target"] == t and r["load"] == load and "skipped" not in r),
            key=lambda r: r["repeat"],
        )
        if not rs:
            continue
        figs = {}
        for kind, qs in (("transit_us", QS), ("ttft_ms", TTFT_QS)):
            for p in qs:
                per = [added(rows, r, kind, _qkey(p)) for r in rs]
                ok = [x for x in per if x is not None]
                figs[f"{kind}:{_qkey(p)}"] = {
                    "per": per,
                    "median": statistics.median(ok) if ok else None,
                }
        out.append({"target": t, **figs})
    return out


def cpu_per_event(r: dict) -> float | None:
    """The proxy's CPU per content event of a run, µs: all its CPU over the run window (the
    requests' own work included) ÷ the content events it relayed; None for direct."""
    pct, events, wall = r.get("cpu_pct", {}).get("proxy"), r.get("content_events"), r.get("wall_s")
    if pct is None or not events or not wall or r["target"] == "direct":
        return None
    return pct * wall * 1e4 / events


def nginx_for(target: str) -> str | None:
    """The nginx a relay target is held against: the one with the same worker count."""
    return "nginx" + target[len("relay") :] if target.startswith("relay") else None


def cpu_table(rows: list[dict], load: int, targets) -> list[dict]:
    """Per proxy target: CPU per content event in each repeat and the median; a relay's
    ratio to its nginx's in the same repeat too."""
    by = {
        (r["target"], r["repeat"]): cpu_per_event(r)
        for r in rows
        if r["load"] == load and "skipped" not in r
    }
    repeats = sorted({rep for _, rep in by})
    out = []
    for t in targets:
        per = [by[(t, rep)] for rep in repeats if by.get((t, rep)) is not None]
        if not per:
            continue
        ng = nginx_for(t)
        ratios = [
            by[(t, rep)] / by[(ng, rep)]
            for rep in repeats
            if by.get((t, rep)) and by.get((ng, rep))
        ]
        out.append(
            {
                "target": t,
                "per": per,
                "median": statistics.median(per),
                "vs": ng if ratios else None,
                "ratios": ratios,
                "ratio": statistics.median(ratios) if ratios else None,
            }
        )
    return out


def render_cpu(rows: list[dict], load: int, targets) -> list[str]:
    out = [
        "| proxy | CPU per content event, µs | ÷ nginx's, same repeat |",
        "|---|---|---|",
    ]
    for c in cpu_table(rows, load, targets):
        per = ", ".join(f"{x:.2f}" for x in c["per"])
        ratio = (
            f"**{c['ratio']:.2f}×** ({', '.join(f'{x:.2f}' for x in c['ratios'])}) ÷ {c['vs']}"
            if c["ratio"] is not None
            else ""
        )
        out.append(f"| {c['target']} | **{c['median']:.2f}** ({per}) | {ratio} |")
    return out


def _n(x, nd: int) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _signed(x, nd: int) -> str:
    return "–" if x is None else f"{x:+.{nd}f}"


FIGS = [("transit_us", p, 0) for p in QS] + [("ttft_ms", p, 2) for p in TTFT_QS]


def _fig_cell(f: dict, nd: int) -> str:
    per = ", ".join(_signed(x, nd) for x in f["per"])
    return (
        f"**{_signed(f['median'], nd)}** ({per})" if len(f["per"]) > 1 else _signed(f["median"], nd)
    )


def render_load(rows: list[dict], load: int, targets, rate: float) -> list[str]:
    """One load's tables: every run's figures, then the added ones (median, each repeat)."""
    out = [
        f"### {load} streams × {rate:g} events/s ({load * rate:,.0f} events/s)",
        "",
        "| target | repeat | content events | transit p50 µs | p99 µs | p99.9 µs | TTFT p50 ms"
        " | TTFT p99 ms | requests | errors / short | upstream CPU % | proxy CPU % | client CPU %"
        " | other CPU % | client lag p99 ms |",
        "|" + "---|" * 15,
    ]
    for t in targets:
        for r in sorted(
            (r for r in rows if r["target"] == t and r["load"] == load), key=lambda r: r["repeat"]
        ):
            if "skipped" in r:
                out.append(f"| {t} | {r['repeat'] + 1} | {r['skipped']} |" + " |" * 12)
                continue
            tr, tt, c = r["transit_us"], r["ttft_ms"], r["cpu_pct"]
            out.append(
                "| "
                + " | ".join(
                    [
                        t,
                        str(r["repeat"] + 1),
                        str(r["content_events"]),
                        _n(tr["p50"], 0),
                        _n(tr["p99"], 0),
                        _n(tr["p99.9"], 0),
                        _n(tt["p50"], 2),
                        _n(tt["p99"], 2),
                        str(r["requests"]),
                        f"{r['errors']} / {r['mismatch']}",
                        _n(c["upstream"], 0),
                        _n(c.get("proxy"), 0) if t != "direct" else "–",
                        _n(c["clients"], 0),
                        _n(c["other"], 0),
                        _n(r.get("lag_p99_ms"), 1),
                    ]
                )
                + " |"
            )
    out += [
        "",
        "| added (target − direct) | transit p50 µs | transit p99 µs | transit p99.9 µs"
        " | TTFT p50 ms | TTFT p99 ms |",
        "|" + "---|" * 6,
    ]
    for a in added_table(rows, load, targets):
        cells = [_fig_cell(a[f"{k}:{_qkey(p)}"], nd) for k, p, nd in FIGS]
        out.append(f"| {a['target']} − direct | " + " | ".join(cells) + " |")
    return out + [""]


def summary_table(rows: list[dict], loads, targets) -> list[str]:
    out = [
        "| load (streams) | added | transit p50 µs | transit p99 µs | transit p99.9 µs"
        " | TTFT p50 ms | TTFT p99 ms |",
        "|" + "---|" * 7,
    ]
    for load in loads:
        for a in added_table(rows, load, targets):
            cells = [_signed(a[f"{k}:{_qkey(p)}"]["median"], nd) for k, p, nd in FIGS]
            out.append(f"| {load} | {a['target']} − direct | " + " | ".join(cells) + " |")
    return out


# -- the stamping upstream --------------------------------------------------------------------

HEAD = (
    b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nX-Accel-Buffering: no\r\n"
    b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Keep-Alive: timeout=5, max=100\r\n\r\n"
)
HEALTH = (
    b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: application/json; charset=utf-8\r\n"
    b'Content-Length: 15\r\nConnection: close\r\n\r\n{"status":"ok"}'
)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
CONTENT_PRE = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":'


def _chunk(ev: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(ev), ev)


class Frames:
    """llama-server's chat chunks (chat_stream_usage.http of tests/support/captures/llama-server/),
    each content event with ``"t_ns"`` added last."""

    def __init__(self, model: bytes, created: int, rid: bytes):
        self.post = (
            b'}}],"created":%d,"id":"%s","model":%s,"system_fingerprint":"b0-unknown",'
            b'"object":"chat.completion.chunk"' % (created, rid, model)
        )
        self.role = (
            b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
            b'"content":null' + self.post + b"}\n\n"
        )
        self.model, self.created, self.rid = model, created, rid

    def content(self, i: int, t_ns: int) -> bytes:
        return b'%s%s%s,"t_ns":%d}\n\n' % (CONTENT_PRE, TOKENS[i % 6], self.post, t_ns)

    def final(self, n: int) -> bytes:
        tail = b',"created":%d,"id":"%s","model":%s,"system_fingerprint":"b0-unknown",' % (
            self.created,
            self.rid,
            self.model,
        )
        fin = (
            b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}]'
            + tail
            + b'"object":"chat.completion.chunk"}\n\n'
        )
        use = (
            b'data: {"choices":[]'
            + tail
            + b'"object":"chat.completion.chunk","usage":{"completion_tokens":%d,'
            b'"prompt_tokens":4,"total_tokens":%d}}\n\n' % (n, n + 4)
        )
        return _chunk(fin) + _chunk(use) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class UpConn(asyncio.Protocol):
    def __init__(self, srv: StampServer):
        import h11

        self.srv, self.h = srv, h11.Connection(h11.SERVER)
        self.tr: asyncio.Transport | None = None
        self.req = None
        self.body = bytearray()
        self.left = self.sent = 0
        self.owed, self.per_step = 0.0, 1.0
        self.frames: Frames | None = None

    def connection_made(self, tr):
        self.tr = tr

    def data_received(self, data: bytes):
        import h11

        if self.frames is not None:
            return  # streaming: nothing more is read from this client
        self.h.receive_data(data)
        while True:
            try:
                ev = self.h.next_event()
            except h11.RemoteProtocolError:
                self.tr.close()
                return
            if ev is h11.NEED_DATA or ev is h11.PAUSED or isinstance(ev, h11.ConnectionClosed):
                return
            if isinstance(ev, h11.Request):
                self.req = ev
            elif isinstance(ev, h11.Data):
                self.body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                self.answer()
                return

    def answer(self):
        target = self.req.target.split(b"?")[0]
        if self.req.method == b"GET" and target in (b"/health", b"/v1/health"):
            self.tr.write(HEALTH)
            self.tr.close()
            return
        if self.req.method != b"POST" or not target.endswith(b"/chat/completions"):
            self.tr.write(NOT_FOUND)
            self.tr.close()
            return
        body = json.loads(self.body or b"{}")
        knobs = body.get("transit") or {}
        tokens = int(knobs.get("tokens") or body.get("max_tokens") or 16)
        rate = float(knobs.get("rate") or self.srv.rate)
        self.srv.rid += 1
        self.frames = f = Frames(
            json.dumps(body.get("model") or "m").encode(),
            int(time.time()),
            b"chatcmpl-transit%010d" % self.srv.rid,
        )
        self.per_step = rate * self.srv.step_ms / 1000.0
        self.left = tokens
        first = HEAD + _chunk(f.role + f.content(0, mono()))
        self.sent, self.left = 1, tokens - 1
        if self.left <= 0:
            self.tr.write(first + f.final(self.sent))
            self.tr.close()
            return
        self.tr.write(first)
        self.srv.live[self] = None

    def step(self):
        """One batch step: this stream's events owed by now, stamped just before the write."""
        self.owed += self.per_step
        k = min(int(self.owed), self.left)
        if k <= 0:
            return
        self.owed -= k
        f, i = self.frames, self.sent
        t = mono()
        data = (
            b"".join(_chunk(f.content(i + j, t)) for j in range(k))
            if k > 1
            else _chunk(f.content(i, t))
        )
        self.sent += k
        self.left -= k
        if self.left <= 0:
            self.tr.write(data + f.final(self.sent))
            self.tr.close()  # as llama-server: the connection ends with the stream
            self.srv.live.pop(self, None)
        else:
            self.tr.write(data)

    def connection_lost(self, exc):
        self.srv.live.pop(self, None)


class StampServer:
    """The batched upstream: one timer, every stream's next event at each step."""

    def __init__(self, step_ms: float = 20.0, rate: float = 50.0):
        self.step_ms, self.rate = step_ms, rate
        self.live: dict[UpConn, None] = {}
        self.rid = 0
        self.steps = self.late_steps = 0
        self.server: asyncio.Server | None = None
        self._next = 0.0
        self._timer: asyncio.TimerHandle | None = None

    async def start(self, host: str = HOST, port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: UpConn(self), host, port, backlog=4096)
        self._next = loop.time() + self.step_ms / 1000
        self._timer = loop.call_at(self._next, self._tick)
        return self.server.sockets[0].getsockname()[1]

    def _tick(self):
        loop = asyncio.get_running_loop()
        self.steps += 1
        for c in list(self.live):
            c.step()
        self._next += self.step_ms / 1000
        now = loop.time()
        if self._next < now:  # the step ran long: no catch-up burst, the next one now
            self.late_steps += 1
            self._next = now
        self._timer = loop.call_at(self._next, self._tick)

    async def stop(self):
        if self._timer:
            self._timer.cancel()
        for c in list(self.live):
            c.tr.abort()
        if self.server:
            self.server.close()
            await self.server.wait_closed()


def _loop_factory():
    try:
        import uvloop

        return uvloop.new_event_loop
    except ImportError:
        return None


def upstream_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transit upstream")
    p.add_argument("--host", default=HOST)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=50.0, help="default events/s per stream")
    a = p.parse_args(argv)

    async def serve():
        srv = StampServer(a.step_ms, a.rate)
        port = await srv.start(a.host, a.port)
        print(json.dumps({"event": "transit_upstream_listening", "port": port}), flush=True)
        await asyncio.Event().wait()

    with asyncio.Runner(loop_factory=_loop_factory()) as r:
        r.run(serve())
    return 0


# -- the client -------------------------------------------------------------------------------


class TStream(bload.Stream):
    """bench.load's stream (head, errors, end), with a leaner chunked decoder that records
    every content event's transit (stamp of the read that completed its chunk − its send
    stamp) and the request's TTFT, in ns."""

    def __init__(self, request: bytes, fut, tokens: int, sink: array, warm_ns: int):
        super().__init__(request, fut)
        self.tokens, self.sink, self.warm_ns = tokens, sink, warm_ns
        self.t_recv = self.t_sent_ns = 0
        self.t_first_ns: int | None = None
        self.min_transit: int | None = None

    def connection_made(self, tr):
        self.tr = tr
        self.t_sent_ns = mono()  # before the write, as bench.load times it
        tr.write(self.request)

    def data_received(self, data: bytes):
        self.t_recv = mono()
        if self.head is None and self.chunked:
            self._dechunk(data)
        else:
            super().data_received(data)  # the head, then _dechunk / _events below

    def _dechunk(self, data: bytes):
        """Whole chunks only (a partial one waits in cbuf for the read that completes it)."""
        buf = self.cbuf + data if self.cbuf else data
        pos, n = 0, len(buf)
        while pos < n:
            j = buf.find(b"\r\n", pos)
            if j < 0:
                break
            try:
                size = int(buf[pos:j].split(b";")[0], 16)
            except ValueError:
                return self._fail("bad chunk size")
            if size == 0:
                self.r.finished = True
                self.tr.close()
                return
            end = j + 2 + size
            if end + 2 > n:
                break
            self._events(buf, j + 2, end)
            pos = end + 2
        self.cbuf = buf[pos:]

    def _events(self, buf: bytes, start: int = 0, end: int | None = None):
        end = len(buf) if end is None else end
        if self.ebuf:
            buf = self.ebuf + buf[start:end]
            start, end = 0, len(buf)
        k = buf.rfind(b"\n\n", start, end)
        if k < 0:
            self.ebuf = buf[start:end]
            return
        self.ebuf = buf[k + 2 : end]
        r = self.r
        if buf.find(b"[DONE]", start, k) >= 0:
            r.done = True
        t = self.t_recv
        for s in stamps_in(buf, start, k):
            tr = t - s
            r.content += 1
            if self.t_first_ns is None:
                self.t_first_ns = t
            if self.min_transit is None or tr < self.min_transit:
                self.min_transit = tr
            if s >= self.warm_ns:
                self.sink.append(tr)


def transit_request(host: str, port: int, tokens: int, rate: float) -> bytes:
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": tokens,
            "stream_options": {"include_usage": True},
            "transit": {"tokens": tokens, "rate": rate},
        },
        separators=(",", ":"),
    ).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def client_run(a) -> dict:
    """Slots a.shard, a.shard + a.shards, ... of a.streams; see the module text."""
    loop = asyncio.get_running_loop()
    sink = array("q")
    t0 = a.t0_ns or mono() + 100_000_000
    end = t0 + int(a.duration_s * 1e9)
    warm = t0 + int(a.warmup_s * 1e9)
    streams: list[list] = []  # [requested, received, ttft_ns or None, first_wave, error]
    min_tr: list[int] = []
    reqs: dict[int, bytes] = {}
    lags: list[int] = []
    stop = False

    async def one(tokens: int, first: bool):
        req = reqs.get(tokens) or reqs.setdefault(
            tokens, transit_request(a.host, a.port, tokens, a.rate)
        )
        fut = loop.create_future()
        s = TStream(req, fut, tokens, sink, warm)
        try:
            await asyncio.wait_for(loop.create_connection(lambda: s, a.host, a.port), a.timeout)
            await asyncio.wait_for(fut, a.timeout)
        except (TimeoutError, OSError) as e:
            if s.tr is not None:
                s.tr.abort()
            s.r.error = s.r.error or ("timeout" if isinstance(e, TimeoutError) else repr(e))
        r = s.r
        if r.error is None and not (r.finished and r.done):
            r.error = f"incomplete: finished={r.finished} done={r.done} {r.sample[:160]!r}"
        ttft = None if s.t_first_ns is None else s.t_first_ns - s.t_sent_ns
        streams.append([tokens, r.content, ttft, first, r.error])
        if s.min_transit is not None:
            min_tr.append(s.min_transit)

    async def wave(i: int):
        # Every stream of a wave opens at its start, as a benchmark client's burst does.
        period = int(a.burst_period_s * 1e9)
        for w in range(a.burst):
            await asyncio.sleep(max(0.0, (t0 + w * period - mono()) / 1e9))
            await one(a.tokens, True)

    async def slot(i: int):
        if a.burst:
            return await wave(i)
        await asyncio.sleep(max(0.0, (t0 - mono()) / 1e9 + a.ramp_s * i / a.streams))
        first = True
        while True:
            fits = int((end - mono()) / 1e9 * a.rate)
            k = max(1, round(a.tokens * (1 - i / a.streams))) if first else a.tokens
            # A stream's first request goes even from a client whose interpreter started past
            # the run's end (a busy machine): a run with fewer streams than it names would
            # measure a lighter load than its label says.
            k = min(k, fits) if not first else max(1, min(k, fits))
            if k < 1:
                return
            t = mono()
            await one(k, first)
            first = False
            # a stream holds its slot k / rate seconds (its last event + one step): requests
            # arrive at N x rate / tokens per second, short streams near the end included
            await asyncio.sleep(max(0.0, (t + k * 1e9 / a.rate - mono()) / 1e9))

    async def lag_probe():  # the client's own loop lag: is it keeping up?
        while not stop:
            t = mono()
            await asyncio.sleep(0.005)
            lags.append(mono() - t - 5_000_000)

    await asyncio.sleep(max(0.0, (t0 - mono()) / 1e9))
    probe = asyncio.ensure_future(lag_probe())
    ru0, w0 = os.times(), mono()
    await asyncio.gather(*(slot(i) for i in range(a.shard, a.streams, a.shards)))
    ru1, wall = os.times(), (mono() - w0) / 1e9
    stop = True
    await probe
    if a.out:
        with open(a.out, "wb") as f:
            sink.tofile(f)
    errors = [s[4] for s in streams if s[4]]
    lags.sort()
    return {
        "requests": len(streams),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "mismatch": sum(1 for s in streams if not s[4] and s[0] != s[1]),
        "streams": [s[:4] for s in streams],
        "content_events": sum(s[1] for s in streams),
        "expected_events": sum(s[0] for s in streams),
        "transit_n": len(sink),
        "min_transit_ns": min(min_tr, default=None),
        "lag_p99_ms": (pct(lags, 99) or 0) / 1e6 if lags else None,
        "lag_max_ms": lags[-1] / 1e6 if lags else None,
        "cpu_s": (ru1.user + ru1.system) - (ru0.user + ru0.system),
        "wall_s": wall,
    }


def client_parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.transit client")
    p.add_argument("--host", default=HOST)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--streams", type=int, required=True, help="slots, all clients together")
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--rate", type=float, default=50.0)
    p.add_argument("--duration-s", type=float, required=True)
    p.add_argument("--ramp-s", type=float, default=0.5)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--t0-ns", type=int, default=0, help="CLOCK_MONOTONIC start (0: now+0.1 s)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", help="write the transit ns (int64, native order) here")
    p.add_argument("--burst", type=int, default=0, help="waves of every stream at once (0: none)")
    p.add_argument("--burst-period-s", type=float, default=2.0, help="wave start to wave start")
    return p.parse_args(argv)


def client_main(argv) -> int:
    a = client_parse(argv)
    procs.raise_nofile(max(4096, 4 * a.streams))
    with asyncio.Runner(loop_factory=_loop_factory()) as r:
        out = r.run(client_run(a))
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


# -- orchestration ----------------------------------------------------------------------------


class Upstream:
    def __init__(self, a, logdir: Path):
        self.host = HOST
        argv = [sys.executable, "-m", "bench.transit", "upstream", "--host", HOST]
        argv += ["--port", "0", "--step-ms", str(a.step_ms), "--rate", str(a.rate)]
        self.proc = procs.Proc("transit-upstream", argv, logdir)
        self.port = int(self.proc.wait_json_event("transit_upstream_listening")["port"])
        self.proc.wait_http(HOST, self.port, "/health")
        self.url = f"http://{HOST}:{self.port}"

    def stop(self):
        self.proc.stop()


def start_proxy(target: str, up: Upstream, logdir: Path, a) -> procs.Proc | None:
    if target == "direct":
        return None
    port = procs.free_port(HOST)
    if target.startswith("relay"):
        conf = relay_conf.write(up.url, logdir, a.relay_config)
        argv = [sys.executable, "-m", "relay", "serve", "--config", str(conf)]
        argv += ["--host", HOST, "--port", str(port)] + shlex.split(a.relay_args or "")
        if target == "relay_w2":
            argv += ["--workers", "2"]
        p = procs.Proc(target, argv, logdir)
    else:
        tmp = logdir / "nginx"
        workers = 2 if target == "nginx_w2" else a.nginx_workers
        conf = nginx.write_conf(tmp, HOST, port, up.host, up.port, workers=workers)
        p = procs.Proc(target, nginx.argv(tmp, conf), logdir)
    p.port = port  # type: ignore[attr-defined]
    p.wait_http(HOST, port, "/health")
    return p


def wait_quiet(up: Upstream, proxy, limit_pct: float, max_wait_s: float) -> dict:
    """Let start-up settle, then wait (at most max_wait_s) until the machine's CPU use by
    anything but upstream and proxy is under limit_pct of one core over 0.5 s: on a shared
    box other work lands in the figures."""
    if max_wait_s <= 0:
        time.sleep(0.1)
        return {}
    t_end = time.monotonic() + max_wait_s
    waited = 0.0
    while True:
        u0, p0, b0 = up.proc.cpu_us(), proxy.cpu_us() if proxy else 0.0, procs.system_busy_us()
        time.sleep(0.5)
        u1, p1, b1 = up.proc.cpu_us(), proxy.cpu_us() if proxy else 0.0, procs.system_busy_us()
        other = max(0.0, (b1 - b0) - (u1 - u0) - (p1 - p0)) / 0.5 / 1e4
        if other < limit_pct or time.monotonic() >= t_end:
            return {"other_pct": other, "waited_s": waited}
        waited += 0.5


def run_one(target: str, load: int, rep: int, up: Upstream, logdir: Path, a) -> dict:
    row: dict = {"target": target, "load": load, "repeat": rep}
    if target.startswith("nginx") and not nginx.binary():
        return {**row, "skipped": "nginx: not found"}
    proxy = start_proxy(target, up, logdir, a)
    try:
        row["quiet"] = wait_quiet(up, proxy, a.quiet_pct, a.quiet_wait_s)
        port = proxy.port if proxy else up.port  # type: ignore[attr-defined]
        t0 = mono() + int(a.client_start_s * 1e9)  # the clients' interpreters start meanwhile
        clients = []
        for j in range(a.clients):
            argv = [sys.executable, "-m", "bench.transit", "client", "--port", str(port)]
            argv += ["--streams", str(load), "--shard", str(j), "--shards", str(a.clients)]
            argv += ["--tokens", str(a.tokens), "--rate", str(a.rate)]
            argv += ["--duration-s", str(a.duration_s), "--ramp-s", str(a.ramp_s)]
            argv += ["--warmup-s", str(a.warmup_s), "--t0-ns", str(t0)]
            argv += ["--burst", str(a.burst), "--burst-period-s", str(burst_period(a))]
            argv += ["--out", str(logdir / f"transit-{j}.bin")]
            clients.append(procs.Proc(f"client{j}", argv, logdir))
        time.sleep(max(0.0, (t0 - mono()) / 1e9))
        u0, p0, b0, w0 = (
            up.proc.cpu_us(),
            proxy.cpu_us() if proxy else 0.0,
            procs.system_busy_us(),
            mono(),
        )
        for c in clients:
            c.popen.wait(a.duration_s + 3 * a.timeout)
        u1, p1, b1 = up.proc.cpu_us(), proxy.cpu_us() if proxy else 0.0, procs.system_busy_us()
        wall = (mono() - w0) / 1e9
        outs = []
        for j, c in enumerate(clients):
            lines = [ln for ln in c.out_path.read_text().splitlines() if ln.startswith("{")]
            if c.popen.returncode != 0 or not lines:
                raise RuntimeError(f"client {j} failed ({c.popen.returncode}): {c.tail()}")
            outs.append(json.loads(lines[-1]))
        transit = array("q")
        for j in range(a.clients):
            with open(logdir / f"transit-{j}.bin", "rb") as f:
                transit.frombytes(f.read())
    finally:
        if proxy:
            proxy.stop()
    streams = [s for o in outs for s in o["streams"]]
    # A burst's every request opened with the others: each one's TTFT is the figure.
    later = [s[2] for s in streams if s[2] is not None and not (s[3] and not a.burst)]
    ttft = later or [s[2] for s in streams if s[2] is not None]
    tq = quantiles(transit)
    fq = quantiles(ttft, TTFT_QS)
    client_cpu = sum(o["cpu_s"] for o in outs) * 1e6
    row.update(
        transit_us={k: (v / 1e3 if k != "n" and v is not None else v) for k, v in tq.items()},
        ttft_ms={k: (v / 1e6 if k != "n" and v is not None else v) for k, v in fq.items()},
        ttft_first_wave_only=not later,
        requests=len(streams),
        errors=sum(o["errors"] for o in outs),
        error_samples=sorted({e for o in outs for e in o["error_samples"]})[:5],
        mismatch=sum(o["mismatch"] for o in outs),
        content_events=sum(o["content_events"] for o in outs),
        expected_events=sum(o["expected_events"] for o in outs),
        min_transit_ns=min(
            (o["min_transit_ns"] for o in outs if o["min_transit_ns"] is not None), default=None
        ),
        lag_p99_ms=max((o["lag_p99_ms"] or 0) for o in outs),
        wall_s=wall,
        cpu_pct={
            "upstream": (u1 - u0) / wall / 1e4,
            "proxy": (p1 - p0) / wall / 1e4 if proxy else None,
            "clients": client_cpu / wall / 1e4,
            "client_max": max(o["cpu_s"] / o["wall_s"] for o in outs) * 100,
            "other": max(0.0, (b1 - b0) - (u1 - u0) - (p1 - p0) - client_cpu) / wall / 1e4,
        },
    )
    if target.startswith("nginx"):
        row["nginx_upstream_errors"] = nginx.upstream_errors(logdir / "nginx")
    return row


def run_quiet(target: str, load: int, rep: int, up: Upstream, logdir: Path, a) -> dict:
    """run_one, again (at most a.retries more times) while other work on the machine took
    over a.max_other_pct of a core during the run; the quietest attempt is kept."""
    best = None
    for attempt in range(a.retries + 1):
        row = run_one(target, load, rep, up, logdir, a)
        row["attempts"] = attempt + 1
        other = row.get("cpu_pct", {}).get("other", 0.0)
        if best is None or other < best.get("cpu_pct", {}).get("other", 0.0):
            best = row
        if other <= a.max_other_pct:
            break
        print(f"transit:   other work took {other:.0f} % of a core: again", file=sys.stderr)
    best["attempts"] = row["attempts"]
    return best


def brief(r: dict) -> str:
    if "skipped" in r:
        return r["skipped"]
    t, f, c = r["transit_us"], r["ttft_ms"], r["cpu_pct"]
    return (
        f"req={r['requests']} err={r['errors']} short={r['mismatch']} events={r['content_events']}"
        f" transit µs p50={_n(t['p50'], 0)} p99={_n(t['p99'], 0)} p99.9={_n(t['p99.9'], 0)}"
        f" ttft ms p50={_n(f['p50'], 2)} p99={_n(f['p99'], 2)} cpu% up={_n(c['upstream'], 0)}"
        f" proxy={_n(c['proxy'], 0)} client={_n(c['clients'], 0)} other={_n(c['other'], 0)}"
        f" lag99={_n(r['lag_p99_ms'], 1)}ms"
        + (f" [{'; '.join(r['error_samples'])}]" if r["error_samples"] else "")
    )


def render(rows: list[dict], a, loads, targets, command: str) -> str:
    out = ["# Added latency per event and per request: relay vs nginx vs direct", ""]
    out += report.machine()
    out += [
        f"- command: `{command}`",
        f"- upstream: bench.transit's stamping server (one process for the whole run), one"
        f" timer every {a.step_ms:g} ms writes the next event of every live stream; first"
        f" content event as soon as the request is read; {a.rate:g} events/s per stream,"
        f" {a.tokens} tokens a stream, connection closed after each stream (as llama-server)",
        f"- client: {a.clients} process(es), uvloop, raw sockets, a new connection per"
        f" stream; {a.duration_s:g} s per run, "
        + (
            f"{a.burst} waves of every stream opened at once, {burst_period(a):g} s apart,"
            f" transit from events stamped after {a.warmup_s:g} s, TTFT of every request"
            if a.burst
            else f"ramp {a.ramp_s:g} s, transit from events stamped after {a.warmup_s:g} s,"
            " TTFT of the requests after the first wave"
        ),
        "- relay: `relay serve` with bench/relay_conf.py's config (parallel 4096)"
        + (f", extra args `{a.relay_args}`" if a.relay_args else "")
        + f"; nginx: bench/nginx.py's config, worker_processes {a.nginx_workers}",
        f"- repeats: {a.repeat}, target order rotating per repeat",
        "",
        "## Added latency (medians over repeats)",
        "",
    ]
    out += summary_table(rows, loads, targets)
    out += ["", "Proxy CPU per content event (median of repeats, each repeat in brackets):", ""]
    for load in loads:
        out += [f"{load} streams:", ""] + render_cpu(rows, load, targets) + [""]
    out += ["## Per load (each repeat's figures)", ""]
    for load in loads:
        out += render_load(rows, load, targets, a.rate)
    bad = sum(r.get("errors", 0) + r.get("mismatch", 0) for r in rows)
    ng = sum(r.get("nginx_upstream_errors", 0) for r in rows)
    neg = [r["min_transit_ns"] for r in rows if (r.get("min_transit_ns") or 0) < 0]
    out += [
        f"Errors + streams with a wrong event count, all runs: **{bad}**; negative transits:"
        f" {len(neg)} run(s); nginx upstream errors logged (dead pooled connections, retried):"
        f" {ng}.",
    ]
    noisy = [r for r in rows if r.get("quiet", {}).get("other_pct", 0) >= a.quiet_pct]
    waited = sum(r.get("quiet", {}).get("waited_s", 0) for r in rows)
    out.append(
        f"Before each run the harness waited (at most {a.quiet_wait_s:g} s; {waited:.0f} s in"
        f" all) for other work on the machine to use under {a.quiet_pct:g} % of a core;"
        f" runs started without that: "
        + (
            ", ".join(
                f"{r['load']}/{r['target']}/{r['repeat'] + 1} ({r['quiet']['other_pct']:.0f} %)"
                for r in noisy
            )
            or "none"
        )
        + "."
    )
    again = [r for r in rows if r.get("attempts", 1) > 1]
    out.append(
        f"Runs measured again because other work took over {a.max_other_pct:g} % of a core"
        f" during them (at most {a.retries} more times, the quietest attempt kept): "
        + (
            ", ".join(
                f"{r['load']}/{r['target']}/{r['repeat'] + 1} x{r['attempts']}" for r in again
            )
            or "none"
        )
        + "."
    )
    for r in rows:
        if r.get("error_samples"):
            out.append(
                f"- {r['load']}/{r['target']}/{r['repeat'] + 1}: {'; '.join(r['error_samples'])}"
            )
    out += [
        "",
        "Reading: transit = read stamp in the client − send stamp in the upstream, one clock"
        " (CLOCK_MONOTONIC) for every process; every content event after the warm-up counts."
        " Added = target's quantile − direct's quantile in the same repeat (two runs, not paired"
        " events); bold is the median over repeats, then each repeat's. CPU % is of one core"
        " over the run window (2 cores = 200 %); other = the machine's busy time not used by"
        " upstream, proxy or client. CPU per content event = the proxy's CPU over the run"
        " window ÷ the content events of the run (its per-request work included). Client lag"
        " p99 = how late the client's own 5 ms sleep woke (uvloop's timers have 1 ms"
        " resolution): a client falling behind shows there.",
        "",
    ]
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.transit", description=__doc__.split("\n")[0])
    p.add_argument("--loads", default="64,256,512", help="concurrent streams, comma list")
    p.add_argument("--rate", type=float, default=50.0, help="events/s per stream")
    p.add_argument("--step-ms", type=float, default=20.0, help="the upstream's batch step")
    p.add_argument("--duration-s", type=float, default=10.0, help="per run")
    p.add_argument("--tokens", type=int, default=0, help="per stream (0: rate × duration)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--clients", type=int, default=2, help="client processes (the streams split)")
    p.add_argument("--ramp-s", type=float, default=0.5)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--client-start-s", type=float, default=0.7, help="spawn to t0")
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument(
        "--quiet-pct",
        type=float,
        default=25.0,
        help="before each run wait until other work uses under this %% of a core",
    )
    p.add_argument("--quiet-wait-s", type=float, default=60.0, help="at most this long")
    p.add_argument(
        "--max-other-pct",
        type=float,
        default=40.0,
        help="run again when other work took more than this %% of a core during the run",
    )
    p.add_argument("--retries", type=int, default=2, help="at most this many times again")
    p.add_argument("--relay-args", default="", help="more `relay serve` args, e.g. '--workers 2'")
    p.add_argument("--relay-config", help="TOML merged over the generated relay config")
    p.add_argument("--nginx-workers", type=int, default=1, help="nginx worker_processes")
    p.add_argument("--output", default=str(Path(__file__).parent / "RESULTS-transit.md"))
    p.add_argument("--json", help="also write the raw per-run rows here")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument(
        "--burst",
        type=int,
        default=0,
        help="waves of every stream opened at once instead of a ramp (0: the ramp)",
    )
    p.add_argument("--burst-gap-s", type=float, default=0.5, help="a wave's end to the next")
    a = p.parse_args(argv)
    if a.burst:
        a.tokens = a.tokens or max(1, round(a.rate))
        a.duration_s = a.burst * burst_period(a)
    a.tokens = a.tokens or max(1, round(a.rate * a.duration_s))
    return a


def burst_period(a) -> float:
    """A burst's wave start to the next: a stream's length, then the gap."""
    return a.tokens / a.rate + a.burst_gap_s if a.burst else 0.0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "upstream":
        return upstream_main(argv[1:])
    if argv and argv[0] == "client":
        return client_main(argv[1:])
    a = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    procs.raise_nofile()
    loads = [int(x) for x in a.loads.split(",") if x.strip()]
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    if bad := [t for t in targets if t not in TARGETS]:
        raise SystemExit(f"unknown target: {bad}")
    logdir = Path(tempfile.mkdtemp(prefix="relay-transit-"))
    rows: list[dict] = []
    up = None
    try:
        up = Upstream(a, logdir)
        for rep in range(a.repeat):
            k = rep % len(targets)
            for load in loads:
                for t in targets[k:] + targets[:k]:
                    print(
                        f"transit: [{rep + 1}/{a.repeat}] {load} -> {t} ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    row = run_quiet(t, load, rep, up, logdir, a)
                    rows.append(row)
                    print("transit:   " + brief(row), file=sys.stderr, flush=True)
                    if up.proc.popen.poll() is not None:
                        raise RuntimeError(f"the upstream exited: {up.proc.tail()}")
    except KeyboardInterrupt:
        print("transit: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"transit: error: {e}\ntransit: logs in {logdir}", file=sys.stderr)
        a.keep_logs = True
        return 2
    finally:
        if up:
            up.stop()
        procs.stop_all()
        if not a.keep_logs:
            import shutil

            shutil.rmtree(logdir, ignore_errors=True)
    cmd = "python -m bench.transit " + " ".join(shlex.quote(x) for x in argv)
    text = render(rows, a, loads, targets, cmd)
    print(text)
    Path(a.output).write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"transit: wrote {a.output}", file=sys.stderr)
    return 1 if any(r.get("errors") or r.get("mismatch") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

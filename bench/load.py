"""Load client: many concurrent SSE streams over raw asyncio sockets.

    python -m bench.load --port P --concurrency 200 --requests 200 \
        --max-tokens 500 --interval-ms 20

Each request is a fresh connection (``Connection: close``) that POSTs a
streaming chat completion.  Parsing is minimal: the HTTP head, chunked
transfer decoding, ``\\n\\n``-separated events counted, the first content
event (``"content":"``) timestamped for TTFT (measured from just before the
request is written to the socket).  Prints ONE JSON line with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import sys
import time

CONTENT_RE = re.compile(rb'"content"\s*:\s*"(?!")')  # (vLLM's, OpenAI's role delta: "")
now = time.perf_counter


class Result:
    __slots__ = (
        "content",
        "done",
        "error",
        "events",
        "finished",
        "max_gap",
        "sample",
        "status",
        "t_first",
        "t_last",
        "t_sent",
    )

    def __init__(self):
        self.error = None
        self.status = 0
        self.events = self.content = 0
        self.done = self.finished = False
        self.t_sent = self.t_first = self.t_last = None
        self.max_gap = 0.0
        self.sample = b""  # first bytes of the response, for diagnostics


class Stream(asyncio.Protocol):
    def __init__(self, request: bytes, fut: asyncio.Future):
        self.request, self.fut, self.r = request, fut, Result()
        self.head = b""  # None once the response head is parsed
        self.chunked = False
        self.cbuf = b""  # undecoded chunked bytes
        self.remain = 0  # bytes left in the current chunk
        self.crlf = False  # expecting the CRLF after chunk data
        self.ebuf = b""  # partial event
        self.tr = None

    def connection_made(self, tr):
        self.tr = tr
        # Timed before the write: on a VM the write can hand the CPU to the woken server,
        # which then answers before this process runs again; a stamp taken after the write
        # would miss that time (direct TTFT read 0.08 ms while the wire showed 0.6 ms).
        self.r.t_sent = now()
        tr.write(self.request)

    def data_received(self, data: bytes):
        if len(self.r.sample) < 240:
            self.r.sample += data[:240]
        if self.head is not None:
            self.head += data
            i = self.head.find(b"\r\n\r\n")
            if i < 0:
                if len(self.head) > 65536:
                    self._fail("response head too large")
                return
            head, data, self.head = self.head[:i], self.head[i + 4 :], None
            try:
                self.r.status = int(head.split(b" ", 2)[1])
            except (IndexError, ValueError):
                return self._fail(f"bad status line {head[:60]!r}")
            if self.r.status != 200:
                return self._fail(f"HTTP {self.r.status}")
            self.chunked = b"transfer-encoding: chunked" in head.lower()
        if self.chunked:
            self._dechunk(data)
        else:
            self._events(data)

    def _dechunk(self, data: bytes):
        buf, pos = self.cbuf + data if self.cbuf else data, 0
        n = len(buf)
        while pos < n:
            if self.remain:
                take = min(self.remain, n - pos)
                self._events(buf[pos : pos + take])
                pos += take
                self.remain -= take
                self.crlf = not self.remain
            elif self.crlf:
                if n - pos < 2:
                    break
                pos, self.crlf = pos + 2, False
            else:
                j = buf.find(b"\r\n", pos)
                if j < 0:
                    break
                try:
                    size = int(buf[pos:j].split(b";")[0], 16)
                except ValueError:
                    return self._fail("bad chunk size")
                pos = j + 2
                if size == 0:
                    self.r.finished = True
                    self.tr.close()
                    return
                self.remain = size
        self.cbuf = buf[pos:]

    def _events(self, data: bytes):
        parts = (self.ebuf + data).split(b"\n\n")
        self.ebuf = parts.pop()
        r = self.r
        for ev in parts:
            r.events += 1
            if b"[DONE]" in ev:
                r.done = True
            elif CONTENT_RE.search(ev):
                t = now()
                r.content += 1
                if r.t_first is None:
                    r.t_first = t
                else:
                    r.max_gap = max(r.max_gap, t - r.t_last)
                r.t_last = t

    def _fail(self, msg: str):
        if self.r.error is None:
            self.r.error = msg
        self.tr.close()

    def connection_lost(self, exc):
        if not self.chunked and self.r.done and self.r.error is None:
            self.r.finished = True  # close-delimited / content-length body
        if exc is not None and self.r.error is None and not self.r.finished:
            self.r.error = repr(exc)
        if not self.fut.done():
            self.fut.set_result(self.r)


def build_request(a) -> bytes:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": a.max_tokens,
    }
    if not a.no_sim:
        body["sim"] = {
            "tokens": a.max_tokens,
            "interval_ms": a.interval_ms,
            **json.loads(a.sim_knobs),
        }
    if a.include_usage:
        body["stream_options"] = {"include_usage": True}
    b = json.dumps(body, separators=(",", ":")).encode()
    return (
        f"POST {a.path} HTTP/1.1\r\nHost: {a.host}:{a.port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Connection: close\r\nContent-Length: {len(b)}\r\n\r\n"
    ).encode() + b


async def one(loop, a, request: bytes) -> Result:
    fut = loop.create_future()
    s = Stream(request, fut)
    try:
        await asyncio.wait_for(loop.create_connection(lambda: s, a.host, a.port), a.timeout)
        return await asyncio.wait_for(fut, a.timeout)
    except (TimeoutError, OSError) as e:
        if s.tr is not None:
            s.tr.abort()
        s.r.error = s.r.error or ("timeout" if isinstance(e, asyncio.TimeoutError) else repr(e))
        return s.r


async def run(a) -> dict:
    loop = asyncio.get_running_loop()
    request = build_request(a)
    results: list[Result] = []
    started = 0

    async def worker(i: int):
        nonlocal started
        await asyncio.sleep(a.ramp_s * i / max(1, a.concurrency))
        while started < a.requests:
            started += 1
            results.append(await one(loop, a, request))

    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), now()
    await asyncio.gather(*(worker(i) for i in range(min(a.concurrency, a.requests))))
    wall, ru1 = now() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return summarize(
        a, results, wall, (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    )


def pct(values: list[float], p: float):
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(-(-p * len(v) // 100)) - 1))]


def summarize(a, results: list[Result], wall: float, cpu: float) -> dict:
    errors = [r for r in results if r.error]
    incomplete = [
        r
        for r in results
        if not r.error
        and not (r.finished and r.done and (not a.expect or r.content == a.max_tokens))
    ]
    ttft = [(r.t_first - r.t_sent) * 1e3 for r in results if r.t_first is not None]
    rates = [
        (r.content - 1) / (r.t_last - r.t_first)
        for r in results
        if r.content > 1 and r.t_last > r.t_first
    ]
    # request written -> last content event: the rate a caller sees, TTFT included
    e2e = [
        r.content / (r.t_last - r.t_sent)
        for r in results
        if r.content and r.t_last is not None and r.t_last > r.t_sent
    ]
    gaps = [r.max_gap * 1e3 for r in results if r.content > 1]
    target = 1000.0 / a.interval_ms if a.interval_ms else None
    samples = sorted({r.error for r in errors})[:5]
    if incomplete:
        r = incomplete[0]
        samples.append(
            f"incomplete: finished={r.finished} done={r.done} content={r.content} "
            f"first bytes: {r.sample[:240]!r}"
        )
    return {
        "requests": len(results),
        "errors": len(errors),
        "incomplete": len(incomplete),
        "ok": len(results) - len(errors) - len(incomplete),
        "events": sum(r.events for r in results),
        "content_events": sum(r.content for r in results),
        "ttft_ms": {
            "p50": pct(ttft, 50),
            "p99": pct(ttft, 99),
            "n": len(ttft),
            "mean": sum(ttft) / len(ttft) if ttft else None,
        },
        "rate_tps": {
            "target": target,
            "mean": sum(rates) / len(rates) if rates else None,
            "min": min(rates, default=None),
            "p5": pct(rates, 5),
            "p50": pct(rates, 50),
            # too few tokens in a stream make its rate meaningless
            "late": sum(1 for x in rates if target and x < 0.9 * target)
            if a.max_tokens >= 10
            else None,
        },
        "stream_tps": {"p50": pct(e2e, 50), "p99_low": pct(e2e, 1), "n": len(e2e)},
        "throughput_tps": sum(r.content for r in results) / wall if wall else None,
        "max_gap_ms": {"p50": pct(gaps, 50), "max": max(gaps, default=None)},
        "wall_s": wall,
        "client_cpu_s": cpu,
        "client_cpu_frac": cpu / wall if wall else 0,
        "error_samples": samples,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", default="/v1/chat/completions")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--interval-ms", type=float, default=20)
    p.add_argument("--ramp-s", type=float, default=0.0, help="spread connection starts")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--no-sim", action="store_true", help="omit the sim knobs (real server)")
    p.add_argument(
        "--sim-knobs",
        default="{}",
        help='more sim knobs, JSON (e.g. {"shape": "openai", "events_per_chunk": 3})',
    )
    p.add_argument(
        "--include-usage",
        action="store_true",
        help="ask for stream_options.include_usage (a last usage chunk; vLLM and "
        "OpenAI then put usage: null in every chunk)",
    )
    p.add_argument(
        "--no-expect",
        dest="expect",
        action="store_false",
        help="do not require content events == max tokens",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        from bench.procs import raise_nofile

        raise_nofile(max(4096, 4 * a.concurrency))
    except (ImportError, OSError, ValueError):
        pass
    try:
        import uvloop

        factory, loop_name = uvloop.new_event_loop, "uvloop"
    except ImportError:
        factory, loop_name = None, "asyncio"
    with asyncio.Runner(loop_factory=factory) as runner:
        out = runner.run(run(a))
    out["loop"] = loop_name
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["client_cpu_total_s"] = ru.ru_utime + ru.ru_stime  # incl. interpreter start-up
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

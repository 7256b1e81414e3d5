"""Per-upstream counters and gauges, rendered as the JSON of `/api/slots/metrics` and as the
Prometheus text exposition format 0.0.4 of `/metrics`.

Pure: no I/O, no clocks. Every time-dependent method takes `now` (monotonic seconds, e.g.
loop.time()) so the sliding windows are tested by driving time explicitly.

Token-rate bucket rule (`tokens_per_sec`): time is cut into 1-second buckets, bucket
`b = floor(t)` holding the tokens added during [b, b+1). With `n = ceil(tps_window_s)` buckets,
the rate read at `now` is the sum of the n most recent *completed* buckets, i.e. those with
`floor(now) - n <= b < floor(now)`, divided by n. Tokens added in the current, still-open second
count from the next whole second on (at most one second of lag, never a partially filled bucket
diluting the rate). Example, n = 10, 10 tokens added at each of t = 0..9: read at t = 10.0 (or
10.999) sums buckets 0..9 -> 10.0; at t = 15 buckets 5..14 -> 5.0; at t = 20 and later -> 0.0.
"""

from __future__ import annotations

import math
from collections import deque

import msgspec

from relay.observe.prom_histogram import (
    E2E_BUCKETS,
    QUEUE_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    render_into,
)

STATES = ("ready", "serving", "loading", "down")
STALL_REASONS = ("total", "idle", "read")


class UpstreamMetrics:
    """Everything `/metrics` reports about one upstream. The relay sets `state`, `in_flight`
    and `queued` directly; the rest changes through the methods."""

    def __init__(
        self,
        name: str,
        parallel: int,
        tps_window_s: float = 10.0,
        ttft_window: int = 128,
        ttft_max_age_s: float = 60.0,
    ) -> None:
        if tps_window_s <= 0 or ttft_window <= 0:
            raise ValueError("tps_window_s and ttft_window must be positive")
        self.name = name
        self.parallel = parallel
        self.state = "ready"
        self.in_flight = 0
        self.queued = 0
        self._buckets_n = max(1, math.ceil(tps_window_s))
        self._buckets: deque[list[int]] = deque()  # [second, tokens], seconds ascending
        self._ttft: deque[tuple[float, float]] = deque(maxlen=ttft_window)  # (at, seconds)
        self._ttft_max_age_s = ttft_max_age_s
        self.tokens_total = 0
        self.requests_total = 0  # requests that generate (`ui_state.generating`) only
        self.requests_failed = 0
        self.other_requests_total = 0  # the others: GET /health, /v1/models, /props, tokenize...
        self.failures_by_code: dict[str, int] = {}
        self.stall_trips: dict[str, int] = dict.fromkeys(STALL_REASONS, 0)
        self.queue_wait_seconds_total = 0.0
        self.queue_wait_count = 0
        self.decoding_speed_tps: float | None = None
        self.kv_occupancy_pct: float | None = None
        self.ttft_hist = Histogram(TTFT_BUCKETS)
        self.tpot_hist = Histogram(TPOT_BUCKETS)
        self.e2e_hist = Histogram(E2E_BUCKETS)
        self.queue_hist = Histogram(QUEUE_BUCKETS)

    def observe_timings(
        self, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None
    ) -> None:
        """One settled request's latencies, into the histograms (None: not measured): of a
        request that generates only (the others are `other_request_done`'s)."""
        if ttft_s is not None:
            self.ttft_hist.observe(ttft_s)
        if tpot_s is not None:
            self.tpot_hist.observe(tpot_s)
        if e2e_s is not None:
            self.e2e_hist.observe(e2e_s)

    # -- token rate -------------------------------------------------------------------------
    def add_tokens(self, n: int, now: float) -> None:
        """Count `n` streamed tokens. A negative `n` (an exact count lower than the running
        estimate) corrects `tokens_total` only; the rate window keeps what was streamed."""
        self.tokens_total += n
        if n <= 0:
            return
        second = math.floor(now)
        buckets = self._buckets
        if not buckets or buckets[-1][0] < second:
            buckets.append([second, n])
        else:  # same second, or (misuse) a clock that went backwards: find or insert its bucket
            for i in range(len(buckets) - 1, -1, -1):
                if buckets[i][0] == second:
                    buckets[i][1] += n
                    break
                if buckets[i][0] < second:
                    buckets.insert(i + 1, [second, n])
                    break
            else:
                buckets.appendleft([second, n])
        self._prune_buckets(second)

    def _prune_buckets(self, current: int) -> None:
        oldest = current - self._buckets_n
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()

    def tokens_per_sec(self, now: float) -> float:
        current = math.floor(now)
        self._prune_buckets(current)
        total = sum(c for s, c in self._buckets if s < current)
        return total / self._buckets_n

    # -- time to first token ------------------------------------------------------------------
    def observe_ttft(self, seconds: float, now: float) -> None:
        self._ttft.append((now, seconds))
        self._prune_ttft(now)

    def _prune_ttft(self, now: float) -> None:
        while self._ttft and now - self._ttft[0][0] > self._ttft_max_age_s:
            self._ttft.popleft()

    def ttft(self, now: float) -> tuple[float | None, float | None]:
        """(last, mean) over the samples still in the window; (None, None) when it is empty."""
        self._prune_ttft(now)
        if not self._ttft:
            return None, None
        return self._ttft[-1][1], sum(s for _, s in self._ttft) / len(self._ttft)

    # -- counters -------------------------------------------------------------------------------
    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait_seconds_total += max(0.0, seconds)
        self.queue_wait_count += 1
        self.queue_hist.observe(seconds)

    def request_done(self, ok: bool, error_code: str | None) -> None:
        self.requests_total += 1
        if not ok:
            self.requests_failed += 1
            code = error_code or "unknown"
            self.failures_by_code[code] = self.failures_by_code.get(code, 0) + 1

    def other_request_done(self) -> None:
        """A request that generates nothing: counted apart, in no latency figure."""
        self.other_requests_total += 1

    def stall(self, reason: str) -> None:
        self.stall_trips[reason] = self.stall_trips.get(reason, 0) + 1

    def set_flm(self, decoding_speed_tps: float | None, kv_occupancy_pct: float | None) -> None:
        """Last FLM usage figures seen; None (or NaN) leaves the previous value."""
        if decoding_speed_tps is not None and not math.isnan(decoding_speed_tps):
            self.decoding_speed_tps = decoding_speed_tps
        if kv_occupancy_pct is not None and not math.isnan(kv_occupancy_pct):
            self.kv_occupancy_pct = kv_occupancy_pct

    def snapshot(self, now: float) -> dict:
        last, avg = self.ttft(now)
        out = {
            "name": self.name,
            "state": self.state,
            "parallel": self.parallel,
            "in_flight": self.in_flight,
            "queued": self.queued,
            "tokens_per_sec": self.tokens_per_sec(now),
            "ttft_seconds": last,
            "ttft_avg_seconds": avg,
            "requests_total": self.requests_total,
            "requests_failed": self.requests_failed,
            "other_requests_total": self.other_requests_total,
            "tokens_total": self.tokens_total,
            "stall_trips": dict(self.stall_trips),
            "queue_wait_seconds_total": self.queue_wait_seconds_total,
            "queue_wait_count": self.queue_wait_count,
            "failures_by_code": dict(self.failures_by_code),
        }
        if self.decoding_speed_tps is not None:
            out["decoding_speed_tps"] = self.decoding_speed_tps
        if self.kv_occupancy_pct is not None:
            out["kv_occupancy_pct"] = self.kv_occupancy_pct
        return out


# -- Prometheus text format -------------------------------------------------------------------
def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(v: int | float) -> str | None:
    """Ints as ints, floats via repr, infinities as +Inf/-Inf; None for NaN (never emitted)."""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return None
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class _Family:
    def __init__(self, name: str, kind: str, help_text: str) -> None:
        self.name, self.kind, self.help = name, kind, help_text
        self.lines: list[str] = []

    def add(self, value: int | float | None, suffix: str = "", **labels: str) -> None:
        if value is None:
            return
        text = _number(value)
        if text is None:
            return
        label_text = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels.items())
        self.lines.append(
            f"{self.name}{suffix}{{{label_text}}} {text}"
            if labels
            else f"{self.name}{suffix} {text}"
        )

    def render(self) -> str:
        return "".join(
            [
                f"# HELP {self.name} {self.help}\n# TYPE {self.name} {self.kind}\n",
                *(line + "\n" for line in self.lines),
            ]
        )


class Registry:
    """All upstreams' metrics plus the relay-wide counters."""

    def __init__(self) -> None:
        self._upstreams: dict[str, UpstreamMetrics] = {}
        self.rows_dropped = 0  # request rows lost because the log writer's queue was full
        # a shared (PostgreSQL) store: rows not yet committed, rows waiting in the spill file
        self.rows_pending = 0
        self.rows_spilled: int | None = None  # None: a SQLite store (neither is shown)
        self.requests_rejected: dict[str, int] = {}  # refused before any upstream, by status
        self.keys: dict[str, list[int]] = {}  # key id -> [requests, prompt, completion tokens]

    def key_used(
        self, key_id: str, prompt_tokens: int | None, completion_tokens: int | None
    ) -> None:
        c = self.keys.get(key_id)
        if c is None:
            c = self.keys[key_id] = [0, 0, 0]
        c[0] += 1
        c[1] += prompt_tokens or 0
        c[2] += completion_tokens or 0

    def add(self, m: UpstreamMetrics) -> None:
        if m.name in self._upstreams:
            raise ValueError(f"duplicate upstream {m.name!r}")
        self._upstreams[m.name] = m

    def set_upstreams(self, metrics: list[UpstreamMetrics]) -> None:
        """The upstreams after a config reload (a kept one keeps its counters)."""
        self._upstreams = {m.name: m for m in metrics}

    def get(self, name: str) -> UpstreamMetrics:
        return self._upstreams[name]

    def __iter__(self):
        return iter(self._upstreams.values())

    def rejected(self, code: int | str) -> None:
        key = str(code)
        self.requests_rejected[key] = self.requests_rejected.get(key, 0) + 1

    def json(self, now: float) -> bytes:
        return msgspec.json.encode({m.name: m.snapshot(now) for m in self})

    def prometheus(self, now: float) -> bytes:
        F = _Family
        up = F("relay_upstream_up", "gauge", "1 unless the upstream is down.")
        state = F("relay_upstream_state", "gauge", "1 for the upstream's current state.")
        parallel = F("relay_slots_parallel", "gauge", "Configured parallel slots.")
        in_flight = F("relay_slots_in_flight", "gauge", "Requests currently on the upstream.")
        queued = F("relay_queue_waiting", "gauge", "Requests waiting for a slot.")
        tps = F("relay_tokens_per_second", "gauge", "Streamed tokens per second, sliding window.")
        ttft = F("relay_ttft_seconds", "gauge", "Last time to first token.")
        ttft_avg = F("relay_ttft_avg_seconds", "gauge", "Mean time to first token, window.")
        requests = F("relay_requests_total", "counter", "Requests that generate, finished.")
        failed = F("relay_requests_failed_total", "counter", "Failed ones of those, by code.")
        other = F(
            "relay_other_requests_total",
            "counter",
            "Requests that generate nothing (/health, /v1/models, /props, tokenize...).",
        )
        tokens = F("relay_tokens_total", "counter", "Tokens streamed.")
        stalls = F("relay_stall_trips_total", "counter", "Stall guard trips by reason.")
        qwait = F("relay_queue_wait_seconds", "histogram", "Time requests waited for a slot.")
        ttft_h = F(
            "relay_time_to_first_token_seconds",
            "histogram",
            "Time to the first content event, per request.",
        )
        tpot_h = F(
            "relay_time_per_output_token_seconds",
            "histogram",
            "(last content - ttft) / (output tokens - 1), per request (vLLM's TPOT).",
        )
        e2e_h = F(
            "relay_e2e_request_latency_seconds",
            "histogram",
            "Request in to last byte out, per served request that generates.",
        )
        key_req = F("relay_key_requests_total", "counter", "Requests per API key.")
        key_tok = F("relay_key_tokens_total", "counter", "Tokens per API key, by kind.")
        speed = F("relay_decoding_speed_tps", "gauge", "FLM decoding speed, last seen.")
        kv = F("relay_kv_occupancy_percent", "gauge", "FLM KV token occupancy, last seen.")
        dropped = F("relay_rows_dropped_total", "counter", "Request rows dropped, queue full.")
        rejected = F(
            "relay_requests_rejected_total",
            "counter",
            "Requests refused before any upstream, by status.",
        )
        for m in self:
            u = m.name
            snap = m.snapshot(now)
            up.add(0 if m.state == "down" else 1, upstream=u)
            states = STATES if m.state in STATES else (*STATES, m.state)
            for s in states:
                state.add(1 if s == m.state else 0, upstream=u, state=s)
            parallel.add(m.parallel, upstream=u)
            in_flight.add(m.in_flight, upstream=u)
            queued.add(m.queued, upstream=u)
            tps.add(snap["tokens_per_sec"], upstream=u)
            ttft.add(snap["ttft_seconds"], upstream=u)
            ttft_avg.add(snap["ttft_avg_seconds"], upstream=u)
            requests.add(m.requests_total, upstream=u)
            other.add(m.other_requests_total, upstream=u)
            for code, n in sorted(m.failures_by_code.items()):
                failed.add(n, upstream=u, code=code)
            tokens.add(m.tokens_total, upstream=u)
            for reason, n in m.stall_trips.items():
                stalls.add(n, upstream=u, reason=reason)
            render_into(qwait, m.queue_hist, upstream=u)
            render_into(ttft_h, m.ttft_hist, upstream=u)
            render_into(tpot_h, m.tpot_hist, upstream=u)
            render_into(e2e_h, m.e2e_hist, upstream=u)
            speed.add(m.decoding_speed_tps, upstream=u)
            kv.add(m.kv_occupancy_pct, upstream=u)
        dropped.add(self.rows_dropped)
        for code, n in sorted(self.requests_rejected.items()):
            rejected.add(n, code=code)
        for key, (n, prompt, completion) in sorted(self.keys.items()):
            key_req.add(n, key=key)
            key_tok.add(prompt, key=key, kind="prompt")
            key_tok.add(completion, key=key, kind="completion")
        families: tuple[_Family, ...] = (
            up,
            state,
            parallel,
            in_flight,
            queued,
            tps,
            ttft,
            ttft_avg,
            requests,
            failed,
            other,
            tokens,
            stalls,
            qwait,
            ttft_h,
            tpot_h,
            e2e_h,
            speed,
            kv,
            dropped,
            rejected,
            key_req,
            key_tok,
        )
        if self.rows_spilled is not None:
            pending = F(
                "relay_rows_pending",
                "gauge",
                "Request rows accepted, not yet committed or spilled.",
            )
            spilled = F(
                "relay_rows_spilled",
                "gauge",
                "Request rows in the spill file, waiting for PostgreSQL.",
            )
            pending.add(self.rows_pending)
            spilled.add(self.rows_spilled)
            families += (pending, spilled)
        return "".join(f.render() for f in families).encode()

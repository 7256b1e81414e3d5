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
from collections.abc import Iterator
from enum import StrEnum
from typing import NotRequired, TypedDict

import msgspec

from relay.observe.prom_histogram import (
    E2E_BUCKETS,
    QUEUE_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    render_into,
)


class UpstreamState(StrEnum):
    """An upstream's state, as `relay_upstream_state{state=..}` and the JSON name it.
    `unknown`: not seen yet (no probe has answered, and no request reached it)."""

    READY = "ready"
    SERVING = "serving"
    LOADING = "loading"
    DOWN = "down"
    UNKNOWN = "unknown"


STATES = tuple(UpstreamState)
STALL_REASONS = ("total", "idle", "read")


class KeyOutcome(StrEnum):
    """What became of a request made with an API key, as `relay_key_requests_total{outcome=..}`
    names it: an upstream answered it (what the key's budget counts as a request), or the
    relay answered it itself (a 429, 404, 400, no upstream free or reachable)."""

    SERVED = "served"
    REFUSED = "refused"


class Snapshot(TypedDict):
    """One upstream's figures in the JSON of `/api/slots/metrics`, in this order."""

    name: str
    state: str
    parallel: int
    in_flight: int
    queued: int
    tokens_per_sec: float
    ttft_seconds: float | None
    ttft_avg_seconds: float | None
    requests_total: int
    requests_failed: int
    other_requests_total: int
    tokens_total: int
    stall_trips: dict[str, int]
    queue_wait_seconds_total: float
    queue_wait_count: int
    failures_by_code: dict[str, int]
    decoding_speed_tps: NotRequired[float]
    kv_occupancy_pct: NotRequired[float]


class UpstreamMetrics:
    """Everything `/metrics` reports about one upstream. The relay sets `state`, `in_flight`
    and `queued` directly; the rest changes through the methods.

    `requests_total` counts the requests that generate (`ui_state.generating`) only;
    `other_requests_total` the others (GET /health, /v1/models, /props, tokenize...)."""

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
        self.state: str = UpstreamState.UNKNOWN
        self.in_flight = 0
        self.queued = 0
        self._buckets_n = max(1, math.ceil(tps_window_s))
        # The token-rate window: [second, tokens], seconds ascending.
        self._buckets: deque[list[int]] = deque()
        # The recent TTFT samples: (at, seconds).
        self._ttft: deque[tuple[float, float]] = deque(maxlen=ttft_window)
        self._ttft_max_age_s = ttft_max_age_s
        self.tokens_total = 0
        self.requests_total = 0
        self.requests_failed = 0
        self.other_requests_total = 0
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
        # A later second opens a bucket; the same second, or (misuse) a clock that went
        # backwards, finds or inserts its own.
        if not buckets or buckets[-1][0] < second:
            buckets.append([second, n])
        else:
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
        """The last decoding speed (tokens/s) and KV cache occupancy (%) an upstream told in
        its `usage`, as FastFlowLM (FLM, a runtime for AMD Ryzen AI NPUs) sends them
        (`decoding_speed_tps`, `kv_token_occupancy_rate_percentage`); None (or NaN) leaves
        the previous value."""
        if decoding_speed_tps is not None and not math.isnan(decoding_speed_tps):
            self.decoding_speed_tps = decoding_speed_tps
        if kv_occupancy_pct is not None and not math.isnan(kv_occupancy_pct):
            self.kv_occupancy_pct = kv_occupancy_pct

    def snapshot(self, now: float) -> Snapshot:
        last, avg = self.ttft(now)
        out: Snapshot = {
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


class PoolFigures:
    """One pool's figures (docs/fleet.md): its members and the requests waiting in its queue,
    the decisions that placed its requests by why and the answers that showed a prefix
    expected cached was not (the slots' board sets these: the process holding the slots),
    and the prompt tokens of its served requests with those the members reused from their
    prompt caches (counted at settlement, summed over workers)."""

    __slots__ = ("cached_tokens", "members", "misses", "prompt_tokens", "routed", "waiting")

    def __init__(self) -> None:
        self.members: tuple[str, ...] = ()
        self.waiting = 0
        self.routed: dict[str, int] = {}
        self.misses = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    @property
    def hit_ratio(self) -> float | None:
        """Cached / prompt tokens; None before any prompt was counted."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


class Registry:
    """All upstreams' metrics plus the relay-wide counters.

    `rows_dropped` counts the request rows lost because the store's queue was full. A shared
    (PostgreSQL) store has rows not yet committed (`rows_pending`) and rows waiting in the
    spill file (`rows_spilled`); a SQLite store leaves `rows_spilled` None, and neither is
    shown. `requests_rejected` counts the requests refused before any upstream, by error
    code; `keys` the use of each API key: key id -> [requests served, requests refused,
    prompt tokens, completion tokens] (`KeyOutcome`); `pools` each pool's figures, by its
    name."""

    def __init__(self) -> None:
        self._upstreams: dict[str, UpstreamMetrics] = {}
        self.rows_dropped = 0
        self.rows_pending = 0
        self.rows_spilled: int | None = None
        self.requests_rejected: dict[str, int] = {}
        self.keys: dict[str, list[int]] = {}
        self.pools: dict[str, PoolFigures] = {}
        # Per key, live: [requests holding a slot, requests waiting for one] (the process
        # holding the slots sets them).
        self.key_live: dict[str, tuple[int, int]] = {}

    def pool(self, name: str) -> PoolFigures:
        figures = self.pools.get(name)
        if figures is None:
            figures = self.pools[name] = PoolFigures()
        return figures

    def pool_used(self, name: str, prompt_tokens: int, cached_tokens: int | None) -> None:
        """A served request of pool `name`: its prompt, and what was reused of it."""
        figures = self.pool(name)
        figures.prompt_tokens += prompt_tokens
        figures.cached_tokens += min(cached_tokens or 0, prompt_tokens)

    def key_used(
        self,
        key_id: str,
        outcome: KeyOutcome,
        prompt_tokens: int | None,
        completion_tokens: int | None,
    ) -> None:
        c = self.keys.get(key_id)
        if c is None:
            c = self.keys[key_id] = [0, 0, 0, 0]
        c[0 if outcome is KeyOutcome.SERVED else 1] += 1
        c[2] += prompt_tokens or 0
        c[3] += completion_tokens or 0

    def add(self, m: UpstreamMetrics) -> None:
        if m.name in self._upstreams:
            raise ValueError(f"duplicate upstream {m.name!r}")
        self._upstreams[m.name] = m

    def set_upstreams(self, metrics: list[UpstreamMetrics]) -> None:
        """The upstreams after a config reload (a kept one keeps its counters)."""
        self._upstreams = {m.name: m for m in metrics}

    def get(self, name: str) -> UpstreamMetrics:
        return self._upstreams[name]

    def __iter__(self) -> Iterator[UpstreamMetrics]:
        return iter(self._upstreams.values())

    def rejected(self, code: int | str) -> None:
        key = str(code)
        self.requests_rejected[key] = self.requests_rejected.get(key, 0) + 1

    def json(self, now: float) -> bytes:
        return msgspec.json.encode({m.name: m.snapshot(now) for m in self})

    def prometheus(self, now: float) -> bytes:
        text = _Exposition(shared_store=self.rows_spilled is not None)
        for m in self:
            text.upstream(m, now)
        text.relay_wide(self)
        return text.render()


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


class _Kind(StrEnum):
    """A metric family's `# TYPE`."""

    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


class _Family:
    def __init__(self, name: str, kind: _Kind, help_text: str) -> None:
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


class _Exposition:
    """The families of `/metrics`, in the order they are written: the upstreams' figures,
    then the relay-wide ones; a shared store's rows last."""

    def __init__(self, shared_store: bool) -> None:
        F, G, C, H = _Family, _Kind.GAUGE, _Kind.COUNTER, _Kind.HISTOGRAM
        self.up = F("relay_upstream_up", G, "1 unless the upstream is down.")
        self.upstream_state = F(
            "relay_upstream_state",
            G,
            "One series per state (ready, serving, loading, down): 1 for the current one.",
        )
        self.parallel = F("relay_slots_parallel", G, "Configured parallel slots.")
        self.in_flight = F("relay_slots_in_flight", G, "Requests currently on the upstream.")
        self.queued = F("relay_queue_waiting", G, "Requests waiting for a slot.")
        self.tps = F(
            "relay_tokens_per_second",
            G,
            "Output tokens per second over the last 10 whole seconds.",
        )
        self.ttft = F(
            "relay_ttft_seconds",
            G,
            "Time to first token of the last request that had one (none after 60 s).",
        )
        self.ttft_avg = F(
            "relay_ttft_avg_seconds",
            G,
            "Mean time to first token of the last 128 requests within 60 s.",
        )
        self.requests = F(
            "relay_requests_total",
            C,
            "Requests that generate, settled on this upstream (failed ones included).",
        )
        self.failed = F("relay_requests_failed_total", C, "Failed ones of those, by error code.")
        self.other = F(
            "relay_other_requests_total",
            C,
            "Requests that generate nothing (/health, /v1/models, /props, tokenize...).",
        )
        self.tokens = F(
            "relay_tokens_total",
            C,
            "Output tokens, streamed or not: as counted, corrected to the upstream's usage.",
        )
        self.stalls = F("relay_stall_trips_total", C, "Stall guard trips by reason.")
        self.qwait = F("relay_queue_wait_seconds", H, "Time requests waited for a slot.")
        self.ttft_h = F(
            "relay_time_to_first_token_seconds",
            H,
            "Time to the first content event, per request.",
        )
        self.tpot_h = F(
            "relay_time_per_output_token_seconds",
            H,
            "(last content - ttft) / (output tokens - 1), per request (vLLM's TPOT).",
        )
        self.e2e_h = F(
            "relay_e2e_request_latency_seconds",
            H,
            "Request in to last byte out, per served request that generates.",
        )
        self.speed = F(
            "relay_decoding_speed_tps",
            G,
            "Decoding speed in tokens/s the upstream last told in its usage"
            " (decoding_speed_tps, as FastFlowLM sends).",
        )
        self.kv = F(
            "relay_kv_occupancy_percent",
            G,
            "KV cache occupancy in percent the upstream last told in its usage"
            " (kv_token_occupancy_rate_percentage, as FastFlowLM sends).",
        )
        self.dropped = F("relay_rows_dropped_total", C, "Request rows dropped, queue full.")
        self.rejected = F(
            "relay_requests_rejected_total",
            C,
            "Requests refused before any upstream, by error code.",
        )
        self.key_req = F(
            "relay_key_requests_total",
            C,
            "Requests per API key, by outcome: served (an upstream answered; what the"
            " budget counts) or refused (the relay answered itself).",
        )
        self.key_tok = F(
            "relay_key_tokens_total",
            C,
            "Tokens per API key as charged, by kind (prompt, completion).",
        )
        self.key_in_flight = F(
            "relay_key_in_flight", G, "Requests of the API key holding a slot now."
        )
        self.key_queued = F(
            "relay_key_queued", G, "Requests of the API key waiting for a slot now."
        )
        self.pool_member = F(
            "relay_pool_member",
            G,
            "1 for each upstream of a pool (the upstreams serving one model).",
        )
        self.pool_waiting = F(
            "relay_pool_queue_waiting", G, "Requests waiting in the pool's queue."
        )
        self.pool_prompt = F(
            "relay_pool_prompt_tokens_total", C, "Prompt tokens of the pool's served requests."
        )
        self.pool_cached = F(
            "relay_pool_cached_tokens_total",
            C,
            "Prompt tokens the pool's members reused from their prompt caches.",
        )
        self.pool_hits = F(
            "relay_pool_cache_hit_ratio", G, "Cached / prompt tokens of the pool's served requests."
        )
        self.pool_routed = F(
            "relay_pool_routed_total", C, "Requests placed on a member of the pool, by why."
        )
        self.pool_misses = F(
            "relay_pool_cache_misses_total",
            C,
            "Answers showing a prefix expected in a member's cache was not there.",
        )
        self.families = [
            *(self.up, self.upstream_state, self.parallel, self.in_flight, self.queued, self.tps),
            *(self.ttft, self.ttft_avg, self.requests, self.failed, self.other, self.tokens),
            *(self.stalls, self.qwait, self.ttft_h, self.tpot_h, self.e2e_h, self.speed),
            *(self.kv, self.dropped, self.rejected, self.key_req, self.key_tok),
        ]
        self.pending: _Family | None = None
        self.spilled: _Family | None = None
        if shared_store:
            self.pending = F(
                "relay_rows_pending",
                G,
                "Request rows accepted, not yet committed or spilled.",
            )
            self.spilled = F(
                "relay_rows_spilled",
                G,
                "Request rows in the spill file, waiting for PostgreSQL.",
            )
            self.families += (self.pending, self.spilled)

    def upstream(self, m: UpstreamMetrics, now: float) -> None:
        u = m.name
        last, avg = m.ttft(now)
        self.up.add(0 if m.state == UpstreamState.DOWN else 1, upstream=u)
        states = STATES if m.state in STATES else (*STATES, m.state)
        for s in states:
            self.upstream_state.add(1 if s == m.state else 0, upstream=u, state=s)
        self.parallel.add(m.parallel, upstream=u)
        self.in_flight.add(m.in_flight, upstream=u)
        self.queued.add(m.queued, upstream=u)
        self.tps.add(m.tokens_per_sec(now), upstream=u)
        self.ttft.add(last, upstream=u)
        self.ttft_avg.add(avg, upstream=u)
        self.requests.add(m.requests_total, upstream=u)
        self.other.add(m.other_requests_total, upstream=u)
        for code, n in sorted(m.failures_by_code.items()):
            self.failed.add(n, upstream=u, code=code)
        self.tokens.add(m.tokens_total, upstream=u)
        for reason, n in m.stall_trips.items():
            self.stalls.add(n, upstream=u, reason=reason)
        render_into(self.qwait, m.queue_hist, upstream=u)
        render_into(self.ttft_h, m.ttft_hist, upstream=u)
        render_into(self.tpot_h, m.tpot_hist, upstream=u)
        render_into(self.e2e_h, m.e2e_hist, upstream=u)
        self.speed.add(m.decoding_speed_tps, upstream=u)
        self.kv.add(m.kv_occupancy_pct, upstream=u)

    def relay_wide(self, r: Registry) -> None:
        self.dropped.add(r.rows_dropped)
        for code, n in sorted(r.requests_rejected.items()):
            self.rejected.add(n, code=code)
        for key, (served, refused, prompt, completion) in sorted(r.keys.items()):
            self.key_req.add(served, key=key, outcome=KeyOutcome.SERVED)
            self.key_req.add(refused, key=key, outcome=KeyOutcome.REFUSED)
            self.key_tok.add(prompt, key=key, kind="prompt")
            self.key_tok.add(completion, key=key, kind="completion")
        if r.key_live:
            # Shown with keys (the process holding the slots sets them).
            self.families += (self.key_in_flight, self.key_queued)
        for key, (held, waiting) in sorted(r.key_live.items()):
            self.key_in_flight.add(held, key=key)
            self.key_queued.add(waiting, key=key)
        if r.pools:
            # Shown once a pool has figures (a pool of several members has from the start).
            self.families += (
                *(self.pool_member, self.pool_waiting, self.pool_prompt, self.pool_cached),
                *(self.pool_hits, self.pool_routed, self.pool_misses),
            )
        for name, p in sorted(r.pools.items()):
            for member in p.members:
                self.pool_member.add(1, pool=name, upstream=member)
            self.pool_waiting.add(p.waiting, pool=name)
            self.pool_prompt.add(p.prompt_tokens, pool=name)
            self.pool_cached.add(p.cached_tokens, pool=name)
            self.pool_hits.add(p.hit_ratio, pool=name)
            for why, n in sorted(p.routed.items()):
                self.pool_routed.add(n, pool=name, reason=why)
            self.pool_misses.add(p.misses, pool=name)
        if self.pending is not None:
            self.pending.add(r.rows_pending)
        if self.spilled is not None:
            self.spilled.add(r.rows_spilled)

    def render(self) -> bytes:
        return "".join(f.render() for f in self.families).encode()

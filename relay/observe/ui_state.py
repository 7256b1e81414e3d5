"""What the operator page (`GET /ui`) shows, kept off the body path.

- `generating(rec)`: whether a settled request could make its upstream generate
  (`admission.generates` on its method and path, the rule `relay report --bench` uses too).
  The page's request counts, latency figures and charts are of those; the others (`GET
  /health`, `/v1/models`, `/props`, tokenize, ...) are kept apart and shown on request.
- `Recent`: the last requests, bounded rings fed once per request at settlement (the ones that
  generate, and apart the last others).
- `Trend`: per upstream, model and kind (generating or not), the figures a benchmark shows,
  one point per `step_s` (5 s), `points` kept (72: 6 minutes): completed requests/s, error
  rate, TTFT p50/p99, TPOT mean, ITL p99 (every gap pooled), E2E p50, output tokens/s. Fed
  once per request at settlement (`add`); a point is closed by the relay's once-a-second
  sampler (`sample`), never by a stream. Definitions as in `relay report --bench`: latencies
  and throughputs over completed (`ok`) requests; a request's tokens are spread over its
  decode span (first token to last byte), so a long stream does not land in one step.
  Bounded: `SERIES_MAX` series, `KEEP_MAX` latencies per series and step (a uniform sample);
  `encoded()` is its JSON, built again only when a point changes, not at each poll.
- `budgets`: per key, its requests holding a slot and waiting for one now (the figures of the
  process holding the slots: `Registry.key_live`), and its windows' use against their limits.
- `state(app, ...)`: the JSON document of `/api/ui/state`, built only when someone asks.

Pure apart from reading the app's objects: tested without sockets.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import NamedTuple, Protocol, TypedDict

import msgspec

from relay.config import KeyConfig
from relay.observe.metrics import Registry, UpstreamMetrics
from relay.observe.record import RESERVED, Record
from relay.policy.admission import generates
from relay.policy.budget import WindowUsage
from relay.stream import itl as G

# The requests that generate kept for the page, newest first.
RECENT_MAX = 100
# The requests that generate nothing, kept apart (shown with `all`).
OTHER_MAX = 20
# The characters of a row's path the page shows.
PATH_CHARS = 120
# The (upstream, model, kind) series charted; a request of one more is only counted.
SERIES_MAX = 16
# The completed requests per series and step whose latencies are kept (a reservoir).
KEEP_MAX = 256

# One point's figures, in this order in the document (`trend.series[i][figure]`).
FIGURES = ("req_s", "err_pct", "ttft_p50", "ttft_p99", "tpot", "itl_p99", "e2e_p50", "tok_s")
_TOK = FIGURES.index("tok_s")
# One point: a figure of FIGURES each, None where nothing measured it.
Point = tuple[
    float, float | None, float | None, float | None, float | None, float | None, float | None, float
]
# The point of a step in which nothing settled.
_IDLE: Point = (0.0, None, None, None, None, None, None, 0.0)


# ---- what the page reads of the relay ----------------------------------------------------------
class MeteredUpstream(Protocol):
    """An upstream as the page reads it (`relay.proxy.upstreams.Upstream`)."""

    @property
    def metrics(self) -> UpstreamMetrics: ...

    def refresh_metrics(self) -> None: ...


class KeysConfig(Protocol):
    """The configuration's API keys (`relay.config.Config`)."""

    @property
    def key(self) -> Sequence[KeyConfig]: ...


# A key's use: window kind (daily, monthly) -> figure (requests, tokens, ...) -> count.
KeyUsage = Mapping[str, WindowUsage]


class BudgetUsage(Protocol):
    """The budgets' use of a key now (`relay.policy.budget.Budgets`)."""

    def usage(self, key_id: str, now: float, /) -> KeyUsage: ...


class DroppedRows(Protocol):
    """The store's count of the rows it dropped (`relay.store`)."""

    @property
    def rows_dropped(self) -> int: ...


class PageSource(Protocol):
    """What `state` reads of the relay: the App, or the workers' parent."""

    @property
    def upstreams(self) -> Mapping[str, MeteredUpstream]: ...

    @property
    def ui_recent(self) -> Recent: ...

    @property
    def ui_trend(self) -> Trend: ...

    @property
    def config(self) -> KeysConfig: ...

    @property
    def budgets(self) -> BudgetUsage: ...

    @property
    def store(self) -> DroppedRows: ...

    @property
    def registry(self) -> Registry: ...


# ---- the recent requests ------------------------------------------------------------------------
def generating(rec: Record) -> bool:
    """Whether a settled request could make its upstream generate; one with no method (refused
    before its head was read) is counted as one, as `relay report --bench` does."""
    method = rec.method
    return not method or generates(method.encode("latin-1", "replace"), rec.path)


def tokens_per_s(
    completion_tokens: int | None, ttft_ms: float | None, e2e_ms: float | None
) -> float | None:
    """Decode rate of one streamed request: tokens after the first over the time after it."""
    if not completion_tokens or completion_tokens < 2 or ttft_ms is None or e2e_ms is None:
        return None
    span = (e2e_ms - ttft_ms) / 1000.0
    return round((completion_tokens - 1) / span, 2) if span > 0 else None


# One settled request as the ring keeps it: ts, request id, key, model, upstream, method,
# path (bounded), status, ttft_ms, e2e_ms, completion tokens, outcome, error code, ok.
_Seen = tuple[
    float,
    str,
    str | None,
    str | None,
    str | None,
    str,
    str,
    int | None,
    float | None,
    float | None,
    int | None,
    str | None,
    str | None,
    bool,
]


class RecentRow(TypedDict):
    """One request in the page's tables (`recent`, `recent_other`)."""

    ts: float
    request_id: str
    key: str | None
    model: str | None
    upstream: str | None
    method: str
    path: str
    status: int | None
    ttft_ms: float | None
    e2e_ms: float | None
    tokens_per_s: float | None
    tokens: int | None
    outcome: str | None
    ok: bool


class Trended(StrEnum):
    """How a settled row goes into the page's trend: as a request that could make its
    upstream generate, as another (`/health`, tokenize, ...), or not at all (no upstream
    was involved: a refusal before any was chosen)."""

    GENERATING = "generating"
    OTHER = "other"
    NONE = "none"


class Recent:
    def __init__(self, size: int = RECENT_MAX, other_size: int = OTHER_MAX) -> None:
        self.ring: deque[_Seen] = deque(maxlen=size)
        self.other: deque[_Seen] = deque(maxlen=other_size)

    def add(self, rec: Record) -> None:
        """One settled request: a tuple, turned into a dict only when read."""
        path = rec.path
        (self.ring if generating(rec) else self.other).append(
            (
                rec.ts,
                rec.request_id,
                rec.key_id,
                rec.model,
                rec.upstream_served or rec.upstream_requested,
                rec.method,
                path if len(path) <= PATH_CHARS else path[:PATH_CHARS] + "…",
                rec.status,
                rec.ttft_ms,
                rec.e2e_ms,
                rec.completion_tokens,
                rec.outcome,
                rec.error_code,
                rec.ok,
            )
        )

    def rows(self, other: bool = False) -> list[RecentRow]:
        """Newest first: the requests that generate, or (`other`) those that do not."""
        out: list[RecentRow] = []
        for (
            ts,
            rid,
            key,
            model,
            up,
            method,
            path,
            status,
            ttft,
            e2e,
            tokens,
            outcome,
            code,
            ok,
        ) in reversed(self.other if other else self.ring):
            out.append(
                {
                    "ts": ts,
                    "request_id": rid,
                    "key": key,
                    "model": model,
                    "upstream": up,
                    "method": method,
                    "path": path,
                    "status": status,
                    "ttft_ms": ttft,
                    "e2e_ms": e2e,
                    "tokens_per_s": tokens_per_s(tokens, ttft, e2e),
                    "tokens": tokens,
                    "outcome": outcome if ok or not code else code,
                    "ok": bool(ok),
                }
            )
        return out


# ---- the trend -------------------------------------------------------------------------------
def percentile(values: list[float], p: float, digits: int = 3) -> float | None:
    """`values` sorted: linear interpolation between closest ranks (numpy's default, which
    `relay report --bench` uses too), rounded to `digits`."""
    if not values:
        return None
    pos = (len(values) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(values) - 1)
    return round(values[lo] + (values[hi] - values[lo]) * (pos - lo), digits)


class _Step:
    """One series' requests settled in the open step: `n` settled, `failed`, `ok_n`
    completed; `kept`, the (ttft, tpot, e2e) of up to KEEP_MAX completed ones; `buckets` and
    `zeros`, every gap of every completed stream (`stream.itl`); `tokens`, the output tokens
    decoded during the step (spread over the decode span: `Trend._spread`)."""

    __slots__ = ("buckets", "failed", "kept", "n", "ok_n", "tokens", "zeros")

    def __init__(self) -> None:
        self.n = 0
        self.failed = 0
        self.ok_n = 0
        self.kept: list[tuple[float | None, float | None, float | None]] = []
        self.buckets: dict[int, int] = {}
        self.zeros = 0
        self.tokens = 0.0

    def point(self, interval: float) -> Point:
        """The step's figures over `interval` seconds, rounded for the page: a chart needs no
        more, and the document stays small."""
        kept = self.kept
        ttft = sorted(t for t, _, _ in kept if t is not None)
        tpot = [t for _, t, _ in kept if t is not None]
        e2e = sorted(e for _, _, e in kept if e is not None)
        itl = G.quantile_of(self.buckets, self.zeros, 0.99)
        return (
            round(self.ok_n / interval, 3),
            round(100.0 * self.failed / self.n, 1) if self.n else None,
            percentile(ttft, 50, 1),
            percentile(ttft, 99, 1),
            round(sum(tpot) / len(tpot), 2) if tpot else None,
            None if itl is None else round(itl * 1000, 2),
            percentile(e2e, 50, 1),
            round(self.tokens / interval, 1),
        )


class SeriesKey(NamedTuple):
    upstream: str
    model: str | None
    generative: bool


class _Series:
    """One series: a column per figure, as long as `Trend.times` (idle before the series
    began); the open step; `idle`, the closed steps in a row with nothing settled."""

    __slots__ = ("cols", "idle", "step")

    def __init__(self, points: int, filled: int) -> None:
        self.cols: tuple[deque[float | None], ...] = tuple(
            deque([v] * filled, maxlen=points) for v in _IDLE
        )
        self.step = _Step()
        self.idle = 0


class TrendDoc(TypedDict):
    """The trend in the page's document: a shared time axis, one column per figure."""

    step_s: float
    window_s: float
    times: list[float]
    series: list[dict[str, object]]
    untracked: int


class Trend:
    """`times` holds the wall time at each point's end; `untracked` counts the requests of
    series beyond `series_max` (not charted); `_encoded` is `doc()` as JSON until the points
    change."""

    def __init__(self, step_s: float = 5.0, points: int = 72, series_max: int = SERIES_MAX) -> None:
        self.step_s = step_s
        self.points = points
        self.series_max = series_max
        self.times: deque[float] = deque(maxlen=points)
        self.series: dict[SeriesKey, _Series] = {}
        self.untracked = 0
        self.next_at = 0.0
        self._random = random.Random()
        self._encoded: msgspec.Raw | None = None

    def add(self, rec: Record, generative: bool) -> None:
        """One request settled on (or failed at) an upstream; `generative`: whether it could
        make its upstream generate (`generating`)."""
        up = rec.upstream_served or rec.upstream_requested
        if up is None:
            return
        key = SeriesKey(up, rec.model, generative)
        s = self.series.get(key)
        if s is None:
            self._encoded = None
            if len(self.series) >= self.series_max:
                self.untracked += 1
                return
            s = self.series[key] = _Series(self.points, len(self.times))
        st = s.step
        st.n += 1
        if not rec.ok:
            st.failed += 1
            return
        st.ok_n += 1
        # The gaps are pooled as they come (a few µs): a point costs no decoding.
        if rec.itl_hist:
            st.zeros += G.decode(rec.itl_hist, st.buckets)[1]
        self._keep(st, (rec.ttft_ms, rec.tpot_ms, rec.e2e_ms))
        # A reservation charged is no count of tokens.
        tokens = rec.completion_tokens
        if tokens and rec.tokens_source != RESERVED:
            self._spread(s, tokens, rec)

    def _keep(self, st: _Step, item: tuple[float | None, float | None, float | None]) -> None:
        """Keep a completed request's latencies: all of the step's first KEEP_MAX, then a
        uniform sample of them."""
        if len(st.kept) < KEEP_MAX:
            st.kept.append(item)
            return
        j = self._random.randrange(st.ok_n)
        if j < KEEP_MAX:
            st.kept[j] = item

    def _spread(self, s: _Series, tokens: int, rec: Record) -> None:
        """The request's output tokens over its decode span, from its first token (its start
        when not streamed) to its last byte: the part before the open step goes into the
        points already closed, as tokens/s of each (a figure never None, unlike the others
        of a point)."""
        end = rec.ts + (rec.total_ms or 0.0) / 1000.0
        start = rec.ts + (rec.ttft_ms or 0.0) / 1000.0
        times = self.times
        if end <= start or not times or start >= times[-1]:
            s.step.tokens += tokens
            return
        rate = tokens / (end - start)
        s.step.tokens += rate * max(0.0, end - times[-1])
        self._encoded = None
        col = s.cols[_TOK]
        for i in range(len(times) - 1, -1, -1):
            hi = times[i]
            lo = times[i - 1] if i else hi - self.step_s
            overlap = min(end, hi) - max(start, lo)
            if overlap > 0 and hi > lo:
                col[i] = round((col[i] or 0.0) + rate * overlap / (hi - lo), 1)
            if lo <= start:
                break

    def sample(self, wall: float, now: float, registry: Registry | None = None) -> None:
        """Called every second (`now`, `registry`: unused, the figures come from settled
        requests); closes one point per `step_s` for every series."""
        if wall < self.next_at:
            return
        self.next_at = wall + self.step_s
        self._encoded = None
        times = self.times
        interval = wall - times[-1] if times else self.step_s
        # A clock step, or the sampler held up: the step is taken as it should have been.
        if not 0 < interval < 3 * self.step_s:
            interval = self.step_s
        times.append(round(wall, 3))
        for key, s in list(self.series.items()):
            point = self._close(s, interval)
            if point is None:
                del self.series[key]
                continue
            for col, v in zip(s.cols, point):
                col.append(v)

    def _close(self, s: _Series, interval: float) -> Point | None:
        """The point a series' open step closes as; None when nothing settled in it over the
        whole window (the series is dropped). Tokens come with a request: a step without one
        has none."""
        st = s.step
        if st.n:
            s.idle = 0
            s.step = _Step()
            return st.point(interval)
        s.idle += 1
        if s.idle >= self.points:
            return None
        return _IDLE

    def doc(self) -> TrendDoc:
        """The series for the page: a shared time axis, one column per figure."""
        series: list[dict[str, object]] = []
        for key, s in sorted(
            self.series.items(),
            key=lambda kv: (not kv[0].generative, kv[0].upstream, kv[0].model or ""),
        ):
            row: dict[str, object] = {
                "upstream": key.upstream,
                "model": key.model,
                "generating": key.generative,
            }
            for name, col in zip(FIGURES, s.cols):
                row[name] = list(col)
            series.append(row)
        return {
            "step_s": self.step_s,
            "window_s": self.step_s * self.points,
            "times": list(self.times),
            "series": series,
            "untracked": self.untracked,
        }

    def encoded(self) -> msgspec.Raw:
        """`doc()` as JSON, built again only after the points changed (a poll a second, a
        point per 5 s)."""
        if self._encoded is None:
            self._encoded = msgspec.Raw(msgspec.json.encode(self.doc()))
        return self._encoded


# ---- budgets and the whole document --------------------------------------------------------
class BudgetWindow(TypedDict):
    window: str
    requests: int
    requests_limit: int
    tokens: int
    tokens_limit: int
    reserved_tokens: int


class KeyBudgets(TypedDict):
    """One key on the page: its requests holding a slot (`in_flight`) and waiting for one
    (`queued`) now, and its windows."""

    key: str
    in_flight: int
    queued: int
    windows: list[BudgetWindow]


def budgets(
    config_keys: Iterable[KeyConfig],
    usage_of: Callable[[str], KeyUsage],
    live: Mapping[str, tuple[int, int]] | None = None,
) -> list[KeyBudgets]:
    """Per key: its requests in flight and queued now (`live`: key -> (holding a slot,
    waiting), as `Registry.key_live` has them; none there: 0), and per window, used against
    limits (0 = no limit); keys without limits too."""
    out: list[KeyBudgets] = []
    live = live or {}
    for k in config_keys:
        limits = {
            "daily": (k.requests_per_day, k.tokens_per_day),
            "monthly": (k.requests_per_month, k.tokens_per_month),
        }
        used = usage_of(k.id)
        windows: list[BudgetWindow] = []
        for kind, (req_limit, tok_limit) in limits.items():
            if not (req_limit or tok_limit):
                continue
            u = used.get(kind)
            windows.append(
                {
                    "window": kind,
                    "requests": u.get("requests", 0) if u is not None else 0,
                    "requests_limit": req_limit,
                    "tokens": u.get("tokens", 0) if u is not None else 0,
                    "tokens_limit": tok_limit,
                    "reserved_tokens": u.get("reserved_tokens", 0) if u is not None else 0,
                }
            )
        in_flight, queued = live.get(k.id, (0, 0))
        out.append({"key": k.id, "in_flight": in_flight, "queued": queued, "windows": windows})
    return out


class UpstreamFigures(TypedDict):
    """One upstream on the page: the part of its `metrics.Snapshot` the page shows."""

    name: str
    state: str
    parallel: int
    in_flight: int
    queued: int
    tokens_per_sec: float
    ttft_avg_seconds: float | None
    requests_total: int
    requests_failed: int
    other_requests_total: int
    tokens_total: int
    stall_trips: dict[str, int]


class PoolRow(TypedDict):
    """One pool on the page: its members, the requests waiting in its queue, and its
    prompt-cache figures (the prompt tokens of its served requests, those reused from a
    member's cache, and the hit ratio: cached / prompt, None before any prompt)."""

    pool: str
    members: list[str]
    waiting: int
    prompt_tokens: int
    cached_tokens: int
    hit_ratio: float | None


class PageState(TypedDict):
    """The document of `/api/ui/state`."""

    now: float
    upstreams: list[UpstreamFigures]
    trend: msgspec.Raw
    recent: list[RecentRow]
    recent_other: list[RecentRow]
    budgets: list[KeyBudgets]
    pools: list[PoolRow]
    rows_dropped: int


def pools(registry: Registry) -> list[PoolRow]:
    """The pools the registry has figures of (the caller's `gauged()` just set their live
    ones), by name."""
    return [
        {
            "pool": name,
            "members": list(p.members),
            "waiting": p.waiting,
            "prompt_tokens": p.prompt_tokens,
            "cached_tokens": p.cached_tokens,
            "hit_ratio": None if p.hit_ratio is None else round(p.hit_ratio, 4),
        }
        for name, p in sorted(registry.pools.items())
    ]


def upstream_figures(up: MeteredUpstream, now: float) -> UpstreamFigures:
    up.refresh_metrics()
    snap = up.metrics.snapshot(now)
    return {
        "name": snap["name"],
        "state": snap["state"],
        "parallel": snap["parallel"],
        "in_flight": snap["in_flight"],
        "queued": snap["queued"],
        "tokens_per_sec": snap["tokens_per_sec"],
        "ttft_avg_seconds": snap["ttft_avg_seconds"],
        "requests_total": snap["requests_total"],
        "requests_failed": snap["requests_failed"],
        "other_requests_total": snap["other_requests_total"],
        "tokens_total": snap["tokens_total"],
        "stall_trips": snap["stall_trips"],
    }


def state(app: PageSource, wall: float, now: float) -> PageState:
    """Everything the page shows. The requests that generate nothing come apart (`recent_other`,
    `other_requests_total`, series with `generating` false): the page leaves them out of its
    counts, latency figures and charts unless asked (`/ui?all=1`, or its toggle). Each key's
    requests in flight and queued are `registry.key_live` as the caller's `gauged()` just set
    them (the figures of the process holding the slots: the parent, with workers), and so are
    the pools' live figures (`pools`)."""
    recent = app.ui_recent
    return {
        "now": wall,
        "upstreams": [upstream_figures(up, now) for up in app.upstreams.values()],
        "trend": app.ui_trend.encoded(),
        "recent": recent.rows(),
        "recent_other": recent.rows(other=True),
        "budgets": budgets(
            app.config.key, lambda k: app.budgets.usage(k, wall), app.registry.key_live
        ),
        "pools": pools(app.registry),
        "rows_dropped": app.store.rows_dropped,
    }

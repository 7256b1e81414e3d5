"""The whole relay's figures from its worker processes' own (relay.workers): pure.

Each worker keeps its `Registry` as one process does; the parent adds them up when a view
is asked for. One rule per kind of figure, read off the value itself, so a counter added
to `UpstreamMetrics` later is summed without being named here:

- numbers and dicts of numbers (counters, counts by code or reason): summed;
- histograms: their buckets, sums and counts summed;
- the token-rate window (`_buckets`, [second, tokens]): summed per second;
- the recent TTFT samples (`_ttft`, (at, seconds)): pooled in time order, newest kept;
- the live gauges (`state`, `in_flight`, `queued`, `parallel`) are the parent's, which holds
  the slots and the health; the FLM figures (last seen): a worker's that has one.

A worker that died leaves its last figures as a base the parent keeps adding in, so counters
never go back.
"""

from __future__ import annotations

from collections import deque
from typing import TypeGuard

from relay.observe.metrics import Registry, UpstreamMetrics
from relay.observe.prom_histogram import Histogram

# set by the process holding the slots and the health, not added up
_LIVE = frozenset({"name", "state", "in_flight", "queued", "parallel"})
# configuration, the same in every worker
_FIXED = frozenset({"_buckets_n", "_ttft_max_age_s"})
_LAST_SEEN = frozenset({"decoding_speed_tps", "kv_occupancy_pct"})


def absorb(into: UpstreamMetrics, part: UpstreamMetrics) -> None:
    """Add one worker's figures of an upstream to `into`."""
    for attr, value in vars_of(part).items():
        if attr in _LIVE or attr in _FIXED:
            continue
        if attr in _LAST_SEEN:
            if value is not None:
                setattr(into, attr, value)
        elif attr == "_buckets":
            into._buckets = _by_second(into._buckets, part._buckets)
        elif attr == "_ttft":
            into._ttft = _pooled(into._ttft, part._ttft)
        else:
            _add(into, attr, getattr(into, attr), value)


def _add(into: UpstreamMetrics, attr: str, mine: object, value: object) -> None:
    """Add `value`, a figure of a part, to `mine`, the same figure of `into`, by its kind."""
    if isinstance(value, Histogram) and isinstance(mine, Histogram):
        _add_histogram(mine, value)
    elif isinstance(value, dict) and isinstance(mine, dict):
        for k, n in value.items():
            mine[k] = mine.get(k, 0) + n
    elif _is_number(value) and _is_number(mine):
        setattr(into, attr, mine + value)
    else:
        raise TypeError(f"UpstreamMetrics.{attr}: no rule to add up {type(value).__name__}")


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def vars_of(obj: object) -> dict[str, object]:
    """An object's attributes, whether it has a __dict__ or __slots__."""
    if hasattr(obj, "__dict__"):
        return vars(obj)
    return {name: getattr(obj, name) for name in getattr(obj, "__slots__", ())}


def _add_histogram(into: Histogram, part: Histogram) -> None:
    if into.bounds != part.bounds:
        raise ValueError("histograms with different bounds cannot be added")
    into.counts = [a + b for a, b in zip(into.counts, part.counts)]
    into.sum += part.sum
    into.count += part.count


def _by_second(a: deque[list[int]], b: deque[list[int]]) -> deque[list[int]]:
    seconds: dict[int, int] = {}
    for second, n in (*a, *b):
        seconds[second] = seconds.get(second, 0) + n
    return deque([s, n] for s, n in sorted(seconds.items()))


def _pooled(
    a: deque[tuple[float, float]], b: deque[tuple[float, float]]
) -> deque[tuple[float, float]]:
    """Both windows' (at, seconds) samples in time order, the newest `a.maxlen` kept."""
    pooled = sorted([*a, *b])
    return deque(pooled[-(a.maxlen or len(pooled)) :], maxlen=a.maxlen)


def add_registry(into: Registry, part: Registry) -> None:
    """Add one worker's relay-wide counters (refusals, per-key use, pools' tokens) to `into`; its
    upstreams' figures are added by `absorb`, upstream by upstream."""
    for code, n in part.requests_rejected.items():
        into.requests_rejected[code] = into.requests_rejected.get(code, 0) + n
    for key, counts in part.keys.items():
        mine = into.keys.setdefault(key, [0] * len(counts))
        for i, n in enumerate(counts):
            mine[i] += n
    # A pool's tokens are counted where its requests settle; its members, queue and
    # decisions are the parent's, which holds the slots.
    for name, figures in part.pools.items():
        pool = into.pool(name)
        pool.prompt_tokens += figures.prompt_tokens
        pool.cached_tokens += figures.cached_tokens


def merged(parts: list[Registry], upstreams: dict[str, int]) -> Registry:
    """A fresh Registry: `upstreams` (name -> parallel) in that order, each the sum of the
    parts' figures of that name; names no longer configured are left out."""
    out = Registry()
    for name, parallel in upstreams.items():
        m = UpstreamMetrics(name, parallel)
        for part in parts:
            mine = part._upstreams.get(name)
            if mine is not None:
                absorb(m, mine)
        out.add(m)
    for part in parts:
        add_registry(out, part)
    return out

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
        mine = getattr(into, attr)
        if attr in _LAST_SEEN:
            if value is not None:
                setattr(into, attr, value)
        elif attr == "_buckets":
            into._buckets = _by_second(mine, value)
        elif attr == "_ttft":
            pooled = sorted([*mine, *value])
            into._ttft = deque(pooled[-(mine.maxlen or len(pooled)) :], maxlen=mine.maxlen)
        elif isinstance(value, Histogram):
            _add_histogram(mine, value)
        elif isinstance(value, dict):
            for k, n in value.items():
                mine[k] = mine.get(k, 0) + n
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"UpstreamMetrics.{attr}: no rule to add up {type(value).__name__}")
        else:
            setattr(into, attr, mine + value)


def vars_of(obj) -> dict:
    """An object's attributes, whether it has a __dict__ or __slots__."""
    if hasattr(obj, "__dict__"):
        return vars(obj)
    return {name: getattr(obj, name) for name in obj.__slots__}


def _add_histogram(into: Histogram, part: Histogram) -> None:
    if into.bounds != part.bounds:
        raise ValueError("histograms with different bounds cannot be added")
    into.counts = [a + b for a, b in zip(into.counts, part.counts)]
    into.sum += part.sum
    into.count += part.count


def _by_second(a: deque, b: deque) -> deque:
    seconds: dict[int, int] = {}
    for second, n in (*a, *b):
        seconds[second] = seconds.get(second, 0) + n
    return deque([s, n] for s, n in sorted(seconds.items()))


def add_registry(into: Registry, part: Registry) -> None:
    """Add one worker's relay-wide counters (refusals, per-key use) to `into`; its
    upstreams' figures are added by `absorb`, upstream by upstream."""
    for code, n in part.requests_rejected.items():
        into.requests_rejected[code] = into.requests_rejected.get(code, 0) + n
    for key, counts in part.keys.items():
        mine = into.keys.setdefault(key, [0] * len(counts))
        for i, n in enumerate(counts):
            mine[i] += n


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

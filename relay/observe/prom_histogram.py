"""Fixed-bucket latency histograms in Prometheus's shape (`_bucket{le=..}`, `_sum`, `_count`).

Observed once per request at settlement (never on the body path). The bucket bounds follow
vLLM's own histograms of the same figures, so a dashboard written for vLLM's
`vllm:time_to_first_token_seconds` reads relay's with only the name changed.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Protocol

# seconds (vLLM: vllm/engine/metrics.py / v1/metrics/loggers.py)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
QUEUE_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        # One count per bound, and a last one for the values above every bound (+Inf only).
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count `value` under the first bound it does not exceed (`le` is inclusive). A
        negative value counts as 0.0, and so does NaN: the test is max(0.0, value) without a
        builtin call."""
        if not value > 0.0:
            value = 0.0
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(le, observations <= le) for every bound, then (inf, count)."""
        out: list[tuple[float, int]] = []
        seen = 0
        for le, n in zip((*self.bounds, float("inf")), self.counts):
            seen += n
            out.append((le, seen))
        return out


class Samples(Protocol):
    """Where a histogram's samples go: a metric family of `relay.observe.metrics`."""

    def add(self, value: int | float | None, suffix: str = "", **labels: str) -> None: ...


def render_into(family: Samples, h: Histogram, **labels: str) -> None:
    """Add a histogram's samples to a metric family of kind "histogram"."""
    for le, n in h.cumulative():
        family.add(n, "_bucket", **labels, le="+Inf" if le == float("inf") else repr(le))
    family.add(h.sum, "_sum", **labels)
    family.add(h.count, "_count", **labels)

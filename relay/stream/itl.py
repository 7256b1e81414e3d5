"""Gaps between the content events of one stream (inter-token latency, ITL), kept bounded.

The body path adds one gap per content event from one high-resolution clock reading per read
(`time.perf_counter`, taken when the bytes are read: the loop's clock, which uvloop keeps in
whole milliseconds and reads once a turn, stays for the deadlines): a `frexp` and a dict
increment (`Gaps.add`). Nothing grows with the stream: gaps land in log-linear buckets, `SUB`
(32) per octave (a bucket is at most 3.1% wide, its midpoint within 1.6% of any gap in it, so
a quantile read as a midpoint is within 2% of the exact one), held in a dict of the buckets
actually hit (a steady stream hits a few; every bucket from 1 us to a day is under 1200), made
at the first gap: a stream that waits for its first or second token holds none. Gaps of
exactly 0 (several events in one read: a client sees them at once) are counted apart.

Encoded rows say `o32` first; rows written before (8 buckets per octave, no marker) are read
into the finer buckets at their buckets' midpoints (`decode`).

`quantile` and `encode` run once, at settlement. `merge`/`decode` pool several streams'
buckets (`relay report` pools every gap of every request, as vLLM's ITL does).
"""

from __future__ import annotations

from collections.abc import Callable
from math import frexp, ldexp

# An empty bucket dict, shared by the Gaps that have had none (never written to).
_NONE: dict[int, int] = {}


class Gaps:
    __slots__ = ("buckets", "last", "max", "zeros")

    def __init__(self) -> None:
        # Made at the first gap (`add`).
        self.buckets: dict[int, int] | None = None
        # The perf_counter time of the read that held the last content event.
        self.last = 0.0
        self.max = 0.0
        self.zeros = 0

    def add(self, g: float, _frexp: Callable[[float], tuple[float, int]] = frexp) -> None:
        """One gap of `g` seconds."""
        if g > 0.0:
            if g > self.max:
                self.max = g
            m, e = _frexp(g)
            # int(m*64) is 32..63: the key is 32(e+1) + the sub-bucket.
            k = (e << 5) + int(m * 64.0)
            b = self.buckets
            if b is None:
                self.buckets = {k: 1}
            else:
                b[k] = b.get(k, 0) + 1
        else:
            self.zeros += 1

    def _buckets(self) -> dict[int, int]:
        """The buckets (an empty dict with none)."""
        b = self.buckets
        return _NONE if b is None else b

    def events(self, now: float, before: int, after: int) -> None:
        """The count of content events went from `before` to `after` in one read at loop
        time `now`: the first new one is a gap from the previous event (none before the
        first event), the others arrived with it (gaps of 0)."""
        if after <= before:
            return
        if before:
            self.add(now - self.last)
        self.zeros += after - before - 1
        self.last = now

    @property
    def count(self) -> int:
        return self.zeros + sum(self._buckets().values())

    def quantile(self, q: float) -> float | None:
        """Seconds: the midpoint of the bucket holding the nearest-rank q-quantile gap (0 for
        the zero gaps), never above the largest gap seen; None with no gap."""
        return quantile_of(self._buckets(), self.zeros, q, self.max)

    def row(self) -> tuple[float, float, str] | None:
        """What a row keeps of the gaps, in one pass over the buckets: the p50 and p99 gaps
        (as `quantile` says) and the buckets as text (`encode`); None with no gap."""
        buckets, zeros = self._buckets(), self.zeros
        keys = sorted(buckets)
        total = zeros + sum(buckets.values())
        if total <= 0:
            return None
        cap = self.max
        p50 = _at_rank(buckets, keys, zeros, _rank(0.5, total), cap)
        p99 = _at_rank(buckets, keys, zeros, _rank(0.99, total), cap)
        return p50, p99, _encoded(buckets, keys, zeros)

    def encode(self) -> str | None:
        """The buckets as text for a row (`z<zeros> <key>:<count> ...`); None with no gap."""
        return encode(self._buckets(), self.zeros) if self.count else None


# Buckets per octave, and the first word of an encoded row in these buckets.
SUB = 32
MARK = "o32"


def bucket_bounds(k: int) -> tuple[float, float]:
    sub = k & 31
    e = (k >> 5) - 1
    return ldexp((32 + sub) / 64.0, e), ldexp((33 + sub) / 64.0, e)


def key_of(g: float) -> int:
    """The bucket of a gap of `g` > 0 seconds."""
    m, e = frexp(g)
    return (e << 5) + int(m * 64.0)


def _old_key(k: int) -> int:
    """A bucket of the rows written with 8 per octave, as the bucket of its midpoint."""
    sub = k & 7
    e = (k >> 3) - 1
    return key_of(ldexp((17 + 2 * sub) / 32.0, e))


# bucket_bounds by key (a few hundred at most).
_BOUNDS: dict[int, tuple[float, float]] = {}


def _bounds(k: int) -> tuple[float, float]:
    b = _BOUNDS.get(k)
    if b is None:
        b = _BOUNDS[k] = bucket_bounds(k)
    return b


def quantile_of(
    buckets: dict[int, int], zeros: int, q: float, cap: float | None = None
) -> float | None:
    total = zeros + sum(buckets.values())
    if total <= 0:
        return None
    return _at_rank(buckets, sorted(buckets), zeros, _rank(q, total), cap)


def _rank(q: float, total: int) -> int:
    """The nearest rank of the q-quantile of `total` values, q read to a millionth: the
    ceiling is then exact in integers (no float error to round away: `round` with digits
    is a decimal conversion, thousands of instructions a call)."""
    ppm = round(q * 1_000_000)
    return max(1, min(total, -(-ppm * total // 1_000_000)))


def _at_rank(
    buckets: dict[int, int], keys: list[int], zeros: int, rank: int, cap: float | None
) -> float:
    """The midpoint of the bucket (`keys` sorted) holding the value of that rank (0 for the
    zero gaps), never above `cap`."""
    if rank <= zeros:
        return 0.0
    seen = zeros
    for k in keys:
        seen += buckets[k]
        if seen >= rank:
            lo, hi = _bounds(k)
            mid = (lo + hi) / 2
            return min(mid, cap) if cap else mid
    # (Not reached: the ranks add up to the total.)
    return cap or 0.0


def encode(buckets: dict[int, int], zeros: int) -> str:
    return _encoded(buckets, sorted(buckets), zeros)


def _encoded(buckets: dict[int, int], keys: list[int], zeros: int) -> str:
    return " ".join([MARK, f"z{zeros}", *(f"{k}:{buckets[k]}" for k in keys)])


def decode(text: str | None, into: dict[int, int] | None = None) -> tuple[dict[int, int], int]:
    """(buckets, zeros) of an `encode`d text, added into `into` when given; bad text: empty.
    A text without the `o32` mark is a row of 8 buckets per octave: each of its buckets is
    read as the finer bucket of its midpoint."""
    out = {} if into is None else into
    zeros = 0
    parts = (text or "").split()
    fine = bool(parts) and parts[0] == MARK
    for part in parts[1:] if fine else parts:
        try:
            if part.startswith("z"):
                zeros += int(part[1:])
            else:
                k, c = part.split(":")
                key = int(k) if fine else _old_key(int(k))
                out[key] = out.get(key, 0) + int(c)
        except ValueError:
            continue
    return out, zeros

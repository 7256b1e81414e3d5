"""relay/stream/itl.py at 32 buckets an octave (issue 23 item 1): a quantile read from the
buckets agrees with the exact quantile of the gaps within 2 %; rows written with 8 buckets an
octave (no `o32` mark) still decode, into the finer buckets at their midpoints."""

from __future__ import annotations

from math import ceil

from hypothesis import given, settings
from hypothesis import strategies as st

from relay.stream import itl as G


def exact(gaps: list[float], q: float) -> float:
    """The nearest-rank q-quantile, computed here from the gaps themselves."""
    ordered = sorted(gaps)
    rank = max(1, min(len(ordered), ceil(round(q * len(ordered), 9))))
    return ordered[rank - 1]


@settings(max_examples=400, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=1e-6, max_value=600.0), min_size=1, max_size=300),
    q=st.sampled_from([0.01, 0.25, 0.5, 0.9, 0.99, 1.0]),
)
def test_quantiles_within_two_percent_of_the_exact_ones(gaps, q):
    h = G.Gaps()
    for g in gaps:
        h.add(g)
    want = exact(gaps, q)
    assert abs(h.quantile(q) - want) <= 0.02 * want, (h.quantile(q), want)


def test_a_bucket_is_a_32nd_of_an_octave():
    lo, hi = G.bucket_bounds(G.key_of(0.010))
    assert (lo, hi) == (40 / 64 * 2**-6, 41 / 64 * 2**-6)  # 10 ms = 0.64 * 2**-6 s
    for g in (1e-6, 3e-4, 0.0099, 0.02, 1.7, 86400.0):
        lo, hi = G.bucket_bounds(G.key_of(g))
        assert lo <= g < hi and (hi - lo) / lo <= 1 / 32


def test_rows_encode_with_the_mark_and_old_rows_still_decode():
    h = G.Gaps()
    h.add(0.010)
    h.add(0.0)
    assert h.encode() == f"o32 z1 {G.key_of(0.010)}:1"
    # a row of 8 buckets an octave: key 8(e+1) + sub; 10 ms is e = -6, sub = 2 (m = 0.64)
    old_key = 8 * (-6 + 1) + 2
    buckets, zeros = G.decode(f"z3 {old_key}:5")
    old_mid = (10 / 16 + 11 / 16) / 2 * 2**-6  # that bucket's midpoint, 9.9 ms
    assert zeros == 3 and buckets == {G.key_of(old_mid): 5}
    assert G.decode(None) == ({}, 0) and G.decode("o32 bad z2") == ({}, 2)


def test_the_rank_is_the_nearest_rank_in_exact_arithmetic():
    from fractions import Fraction

    for total in range(1, 2001):
        for q in (0.001, 0.01, 0.1, 0.25, 0.29, 0.5, 0.57, 0.9, 0.95, 0.99, 0.999, 1.0):
            # The nearest rank, ceil(q x total), with q the decimal it is written as.
            want = max(1, min(total, ceil(Fraction(str(q)) * total)))
            assert G._rank(q, total) == want, (q, total)

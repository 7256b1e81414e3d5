"""`/metrics` histograms over real requests (issue 13 item 3): scraped, parsed by
prometheus_client's parser, bucket counts checked against the requests made, and
`histogram_quantile` computed on them as Prometheus does."""

from __future__ import annotations

import asyncio
import math

from prometheus_client.parser import text_string_to_metric_families

from tests.support import httpc
from tests.support.keys import bearer, key

CHAT = "/v1/chat/completions"


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile on (le, cumulative count) pairs, +Inf last: the rank
    q * count is found in its bucket and interpolated linearly between the bucket's bounds
    (the first bucket's lower bound is 0); a rank in the +Inf bucket gives the highest bound."""
    buckets = sorted(buckets)
    assert math.isinf(buckets[-1][0])
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if le <= 0 or count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return buckets[-2][0]


def scrape_histograms(text: str, upstream: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type != "histogram":
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket") and s.labels.get("upstream") == upstream:
                out.setdefault(fam.name, []).append((float(s.labels["le"]), s.value))
    return out


def count_le(buckets, le: float) -> float:
    return dict(buckets)[le]


async def test_latency_histograms_against_known_requests(make_relay):
    app = await make_relay(keys=[key()])
    # five fast-start and five slow-start streams of 5 tokens 120 ms apart
    bodies = [httpc.chat(5, first_token_delay_ms=150, interval_ms=120)] * 5 + [
        httpc.chat(5, first_token_delay_ms=600, interval_ms=120)
    ] * 5
    resps = await asyncio.gather(
        *(httpc.fetch(app.port, "POST", CHAT, b, headers=bearer()) for b in bodies)
    )
    assert all(r.status == 200 and r.complete for r in resps)
    text = (await httpc.fetch(app.port, "GET", "/metrics")).body.decode()
    h = scrape_histograms(text, "llm")

    ttft = h["relay_time_to_first_token_seconds"]
    assert count_le(ttft, 0.1) == 0 and count_le(ttft, 0.25) == 5
    assert count_le(ttft, 0.5) == 5 and count_le(ttft, 0.75) == 10
    assert count_le(ttft, math.inf) == 10
    # histogram_quantile(0.5): rank 5 ends the (0.1, 0.25] bucket; 0.9: rank 9 is 4/5 into
    # (0.5, 0.75]
    assert histogram_quantile(0.5, ttft) == 0.25
    assert histogram_quantile(0.9, ttft) == 0.5 + 0.25 * 4 / 5

    tpot = h["relay_time_per_output_token_seconds"]  # 120 ms between tokens
    assert count_le(tpot, 0.1) == 0 and count_le(tpot, 0.15) == 10
    assert histogram_quantile(0.5, tpot) == 0.1 + 0.05 * 5 / 10

    e2e = h["relay_e2e_request_latency_seconds"]  # 0.15 + 4 * 0.12 and 0.6 + 4 * 0.12
    assert count_le(e2e, 0.5) == 0 and count_le(e2e, 0.8) == 5
    assert count_le(e2e, 1.0) == 5 and count_le(e2e, 1.5) == 10

    queue = h["relay_queue_wait_seconds"]  # 256 slots: nobody waits long
    assert count_le(queue, 0.1) == 10

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    reqs = {
        (s.labels["key"], s.labels["outcome"]): s.value for s in fams["relay_key_requests"].samples
    }
    toks = {(s.labels["key"], s.labels["kind"]): s.value for s in fams["relay_key_tokens"].samples}
    assert reqs == {("alpha", "served"): 10, ("alpha", "refused"): 0}
    assert toks == {("alpha", "completion"): 50, ("alpha", "prompt"): 20}

"""A request's benchmark timings, computed once at settlement from what the exchange noted.

Definitions (docs/benchmarking.md), all measured at the relay on the client side of the wire, in
ms from the moment the dispatcher took the request (its head and body read):

- `first_byte_ms`: the first byte of the response handed to the client's socket (for an SSE
  2xx the head is held until the first content event, so it is then about `ttft_ms`);
- `ttft_ms`: the first content-bearing event (set by the dispatcher, as before);
- `e2e_ms`: the last byte of the response out (settlement follows the drain of the client's
  write buffer on a completed response), NULL when no response was given: E2EL to the end of
  the response;
- `last_content_ms`: the read holding the last content event (a stream with content only):
  E2EL to the last content event, AIPerf's `request_latency` and vLLM's `latency`;
- `tpot_ms`: (last content - ttft) / (output tokens - 1), vLLM's TPOT (AIPerf/GenAI-Perf call
  it ITL), (e2e - ttft) for a response without content events; NULL below 2 output tokens or
  when the tokens were not counted (a reservation charged);
- `itl_p50_ms`, `itl_p99_ms`, `itl_max_ms`: the gaps between consecutive content events, one
  `perf_counter` reading per read, from `stream.itl`'s buckets (p50/p99 within 2%, max exact);
- `prompt_ms`, `prompt_per_second`, `predicted_per_second`: the upstream's own `timings`.
"""

from __future__ import annotations

import math

from relay.observe.record import Record
from relay.stream.itl import Gaps
from relay.stream.usage import Usage

_floor = math.floor


def round3(v: float) -> float:
    """round(v, 3), the same figure at a tenth of its cost (round with digits goes through a
    decimal conversion: ~3000 instructions, a dozen times per request). v * 1000 is off by at
    most a few ulp, so unless it lies within 1e-4 of a tie (or is huge) its floor says which
    way round(v, 3) goes; those rare cases take round itself."""
    s = v * 1000.0
    f = _floor(s)
    d = s - f
    if -1e8 < v < 1e8:
        if d < 0.4999:
            return f / 1000.0
        if d > 0.5001:
            return (f + 1) / 1000.0
    return round(v, 3)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round3(seconds * 1000)


def tpot_ms(end_ms: float | None, ttft_ms: float | None, tokens: int | None) -> float | None:
    """vLLM's time per output token after the first: (E2EL - TTFT) / (tokens - 1), E2EL to the
    last content event."""
    if end_ms is None or ttft_ms is None or tokens is None or tokens < 2:
        return None
    return round3((end_ms - ttft_ms) / (tokens - 1))


def fill(
    rec: Record, t0: float, first_byte_at: float | None, gaps: Gaps | None, exact: Usage | None
) -> None:
    """Set the row's timing fields; `rec.total_ms`, `ttft_ms` and tokens are already set."""
    if rec.status is not None:
        rec.e2e_ms = rec.total_ms
        rec.first_byte_ms = (
            round3((first_byte_at - t0) * 1000) if first_byte_at is not None else rec.total_ms
        )
    if gaps is not None and rec.ttft_ms is not None:  # (the first content event was read)
        rec.last_content_ms = round3((gaps.last - t0) * 1000)
    counted = rec.tokens_source in ("exact", "approx")  # not a reservation charged instead
    end = rec.last_content_ms if rec.last_content_ms is not None else rec.e2e_ms
    rec.tpot_ms = tpot_ms(end, rec.ttft_ms, rec.completion_tokens if counted else None)
    kept = gaps.row() if gaps is not None else None
    if gaps is not None and kept is not None:
        p50, p99, rec.itl_hist = kept
        rec.itl_p50_ms = round3(p50 * 1000)
        rec.itl_p99_ms = round3(p99 * 1000)
        rec.itl_max_ms = round3(gaps.max * 1000)
    if exact is not None:
        rec.prompt_ms = exact.prompt_ms
        rec.prompt_per_second = exact.prompt_per_second
        rec.predicted_per_second = exact.predicted_per_second

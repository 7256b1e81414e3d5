"""Stream timings to the microsecond (issue 23 item 1): gaps from one perf_counter reading per
read (not the loop's millisecond clock), 32 buckets an octave, so a row's ITL agrees with what
the client itself measured."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import sys

from relay.stream import itl as G
from tests.support import httpc
from tests.support.helpers import rows_of
from tests.support.layout import ROOT


async def client_times(port: int, body: dict) -> tuple[float, list[float]]:
    """(seconds to the first content event, arrival time of each content event), as a client
    in its own process receives them (tests/support/timed_client.py): one kernel stamp per
    read, each content event in it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.timed_client",
        str(port),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    out, _ = await asyncio.wait_for(
        proc.communicate(httpc.build_request("POST", "/v1/chat/completions", body)), 15
    )
    got = json.loads(out)
    arrivals = got["arrivals"]
    return arrivals[0] - got["t0"], arrivals


async def test_a_paced_streams_itl_agrees_with_the_clients(make_relay, sim):
    app = await make_relay()
    body = httpc.chat(40, interval_ms=10)
    ttft, arrivals = await client_times(app.port, body)
    # The client's /health exchanges have their access lines, and perhaps no rows.
    [row] = [r for r in await rows_of(app, 4) if r["path"] == "/v1/chat/completions"]
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]
    buckets, zeros = G.decode(row["itl_hist"])
    assert zeros + sum(buckets.values()) == len(gaps) == 39  # one gap per event after the first
    mean = sum(c * sum(G.bucket_bounds(k)) / 2 for k, c in buckets.items()) / len(gaps) * 1000
    # each gap read as its bucket's midpoint (within 1.6 %), transit adding nothing systematic
    assert abs(mean - statistics.mean(gaps)) <= 0.3, (mean, statistics.mean(gaps))
    # (one gap, so one delivery's jitter: the client's arrivals are the kernel's stamps)
    assert abs(row["itl_max_ms"] - max(gaps)) <= 1.0, (row["itl_max_ms"], max(gaps))
    assert 5.0 < row["itl_p50_ms"] < 20.0 and row["itl_p50_ms"] != round(row["itl_p50_ms"])
    # the client's TTFT adds its own sending and the relay's reading of the request
    assert 0 <= ttft * 1000 - row["ttft_ms"] <= 1.0, (ttft * 1000, row["ttft_ms"])

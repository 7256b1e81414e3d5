"""Benchmark timings of a request row (issue 13 item 1): the gap histogram, the formulas, the
migration of an old database, and the figures of real streams from a paced simulator."""

from __future__ import annotations

import sqlite3
import time

import pytest

from relay.observe.row_timings import tpot_ms
from relay.store.schema import ADDED, COLUMNS
from relay.store.sqlite import Store
from relay.stream import itl as G
from tests.support import httpc
from tests.support.helpers import CHAT, LOOP_EARLY_MS, one_row, rid_header

OLD_COLUMNS = COLUMNS[: COLUMNS.index("client_closed") + 1]  # the schema before issue 13


# ---- pure: gaps and formulas ------------------------------------------------------------------
def test_gap_buckets_bound_the_error():
    for g in (1e-6, 3.3e-4, 0.001, 0.0125, 0.02, 0.05, 0.3333, 1.0, 7.5, 299.0):
        h = G.Gaps()
        h.events(10.0, 0, 1)
        h.events(10.0 + g, 1, 2)
        lo, hi = G.bucket_bounds(next(iter(G.decode(h.encode())[0])))
        assert lo <= g < hi or abs(g - lo) < 1e-12
        assert (hi - lo) / lo <= 0.125 + 1e-12
        assert abs(h.quantile(0.5) - g) / g <= 0.0625 + 1e-9
        assert h.max == pytest.approx(g)


def test_gap_quantiles_nearest_rank_and_zeros():
    h = G.Gaps()
    t = 0.0
    h.events(t, 0, 1)
    for g in [0.010] * 98 + [0.100, 0.500]:
        t += g
        h.events(t, 1, 2)
    h.events(t, 101, 104)  # three more events read at the same clock reading: three zeros
    assert h.count == 103 and h.zeros == 3
    assert h.max == pytest.approx(0.5)
    assert h.quantile(0.01) == 0.0  # ranks 1..3 are the zeros
    assert h.quantile(0.5) == pytest.approx(0.010, rel=0.0625)
    assert h.quantile(0.99) == pytest.approx(0.100, rel=0.0625)  # rank 102 of 103
    assert h.quantile(1.0) == pytest.approx(0.5, rel=0.0625)
    buckets, zeros = G.decode(h.encode())
    assert (buckets, zeros) == (h.buckets, h.zeros)
    assert len(h.buckets) == 3  # bounded: one entry per bucket hit, not per gap


def test_one_event_has_no_gap():
    h = G.Gaps()
    h.events(5.0, 0, 1)
    assert h.count == 0 and h.quantile(0.5) is None and h.encode() is None
    h.events(5.0, 1, 1)  # a read without content
    assert h.count == 0
    h.events(6.0, 1, 3)  # two in one read: a gap of 1 s and one of 0
    assert (h.count, h.zeros, h.max) == (2, 1, 1.0)


def test_tpot_formula():
    assert tpot_ms(1000.0, 100.0, 10) == 100.0  # (1000 - 100) / 9
    assert tpot_ms(250.5, 50.25, 3) == round(200.25 / 2, 3)
    assert tpot_ms(100.0, 50.0, 1) is None  # one token: no time per output token
    assert tpot_ms(100.0, None, 5) is None and tpot_ms(None, 5.0, 5) is None


# ---- migration ----------------------------------------------------------------------------------
def test_old_database_gains_the_columns(tmp_path):
    path = str(tmp_path / "old.db")
    conn = sqlite3.connect(path)
    conn.execute(f"CREATE TABLE request ({', '.join(OLD_COLUMNS)})")
    conn.execute(
        "INSERT INTO request (ts, request_id, ttft_ms, ok) VALUES (?, 'old-1', 12.5, 1)",
        (time.time() - 60,),
    )
    conn.commit()
    conn.close()
    store = Store(path)
    store.start()
    try:
        store.put(
            {"ts": time.time(), "request_id": "new-1", "tpot_ms": 21.5, "itl_hist": "z0 40:3"}
        )
        store.flush()
        got = store.query("SELECT * FROM request ORDER BY rowid")
        assert list(got[0]) == list(COLUMNS)
        assert got[0]["request_id"] == "old-1" and got[0]["ttft_ms"] == 12.5
        assert all(got[0][c] is None for c, _ in ADDED)
        assert (got[1]["request_id"], got[1]["tpot_ms"], got[1]["itl_hist"]) == (
            "new-1",
            21.5,
            "z0 40:3",
        )
    finally:
        store.close()
    store = Store(path)  # a second start finds nothing to add
    store.start()
    store.close()


# ---- real streams -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path,body",
    [
        (CHAT, lambda: httpc.chat(12, interval_ms=25, first_token_delay_ms=60)),
        (
            "/completion",
            lambda: {
                "prompt": "Hi there",
                "n_predict": 12,
                "stream": True,
                "sim": {"interval_ms": 25, "first_token_delay_ms": 60},
            },
        ),
    ],
)
async def test_row_timings_of_a_paced_stream(make_relay, path, body):
    app = await make_relay()
    resp = await httpc.fetch(app.port, "POST", path, body(), headers=rid_header("paced"))
    assert resp.status == 200 and resp.complete
    row = await one_row(app, "paced")
    assert row["completion_tokens"] == 12 and row["tokens_source"] == "exact"
    assert row["ttft_ms"] >= 60 - LOOP_EARLY_MS and row["first_byte_ms"] <= row["ttft_ms"] + 0.5
    assert row["e2e_ms"] == row["total_ms"] >= row["ttft_ms"] + 11 * 25 * 0.9
    # E2EL to the last content event: before the end of the response, after 11 gaps
    assert row["ttft_ms"] + 11 * 25 * 0.9 <= row["last_content_ms"] <= row["e2e_ms"]
    # TPOT exactly as vLLM and AIPerf compute it (to the last content event), on the row
    assert row["tpot_ms"] == round((row["last_content_ms"] - row["ttft_ms"]) / (12 - 1), 3)
    # ITL: gaps of the configured 25 ms interval (the loop clock ticks in whole ms under uvloop;
    # the bucket midpoint is within 6.25%; a shared CPU may delay a read)
    assert 25 * 0.85 <= row["itl_p50_ms"] <= 25 * 1.5
    assert row["itl_p50_ms"] <= row["itl_p99_ms"] <= row["itl_max_ms"] * 1.0625 + 1e-9
    assert 24 <= row["itl_max_ms"] < 250
    buckets, zeros = G.decode(row["itl_hist"])
    assert sum(buckets.values()) + zeros == 11  # every gap between the 12 content events
    assert row["prompt_ms"] is not None and row["predicted_per_second"] is not None
    assert row["prompt_per_second"] is not None


async def test_non_streamed_row_has_no_stream_timings(make_relay):
    app = await make_relay()
    resp = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(5, stream=False), headers=rid_header("plain")
    )
    assert resp.status == 200
    row = await one_row(app, "plain")
    assert row["ttft_ms"] is None and row["tpot_ms"] is None and row["itl_p50_ms"] is None
    assert row["itl_hist"] is None and row["itl_max_ms"] is None and row["last_content_ms"] is None
    assert row["e2e_ms"] == row["total_ms"] and 0 < row["first_byte_ms"] <= row["e2e_ms"]


async def test_relay_error_row_timings(make_relay):
    app = await make_relay()
    resp = await httpc.fetch(app.port, "POST", CHAT, b'{"model": ', headers=rid_header("400"))
    assert resp.status == 400
    row = await one_row(app, "400")
    assert row["e2e_ms"] == row["total_ms"] == row["first_byte_ms"]
    assert row["ttft_ms"] is None and row["tpot_ms"] is None


async def test_first_byte_before_ttft_with_heartbeats(make_relay):
    """With heartbeats, the head and a comment reach the client before the first token: the
    first byte is the first heartbeat, the TTFT still the first content event."""
    app = await make_relay(heartbeat_s=0.1)
    resp = await httpc.fetch(
        app.port,
        "POST",
        CHAT,
        httpc.chat(3, first_token_delay_ms=400, interval_ms=5),
        headers=rid_header("hb"),
    )
    assert resp.status == 200 and resp.complete and b": relay heartbeat" in resp.body
    row = await one_row(app, "hb")
    assert 95 <= row["first_byte_ms"] < 300 and row["ttft_ms"] >= 400 - LOOP_EARLY_MS
    assert row["tpot_ms"] == round((row["last_content_ms"] - row["ttft_ms"]) / 2, 3)


def test_no_tpot_from_a_reservation():
    """A row charged its reservation (usage unknown) has no token count to divide by."""
    from relay.observe.record import Record
    from relay.observe.row_timings import fill

    for source, want in (("exact", 100.0), ("approx", 100.0), ("reserved", None)):
        rec = Record(
            ts=0.0,
            request_id="r",
            path=CHAT,
            status=200,
            total_ms=1000.0,
            ttft_ms=100.0,
            completion_tokens=10,
            tokens_source=source,
        )
        fill(rec, 0.0, None, None, None)
        assert (rec.e2e_ms, rec.first_byte_ms, rec.tpot_ms) == (1000.0, 1000.0, want)


def test_gaps_jittering_across_a_bucket_edge_count_as_one_bucket_per_gap():
    """A paced stream has gaps of 19, 20, 21 ms, on both sides of a bucket edge: the
    histogram is every gap in the bucket frexp puts it in, whenever it is read."""
    import random
    from math import frexp

    rng = random.Random(1201)
    for _n in range(3000):
        h, ref, zeros = G.Gaps(), {}, 0
        pool = rng.choice(
            [
                [0.019, 0.020, 0.021],
                [0.0179, 0.018, 0.0201, 0.022, 0.5],
                [0.0, 0.001, 0.002, 0.003, 0.004],
                None,
            ]
        )
        for _ in range(rng.randint(0, 80)):
            g = rng.choice(pool) if pool else rng.random() * 0.05
            g += rng.choice([0.0, 1e-12, -1e-12])  # (loop-clock differences are not exact)
            h.add(g)
            if g > 0.0:
                m, e = frexp(g)
                k = (e << 5) + int(m * 64.0)  # 32 buckets per octave
                ref[k] = ref.get(k, 0) + 1
            else:
                zeros += 1
            if rng.random() < 0.05:  # read mid-stream, then go on
                assert h.count == zeros + sum(ref.values())
        assert G.decode(h.encode()) == (ref, zeros) if ref or zeros else h.encode() is None
        assert h.count == zeros + sum(ref.values())
        assert h.quantile(0.5) == G.quantile_of(ref, zeros, 0.5, h.max)


async def test_events_of_one_read_share_its_time_ttft_to_last_content(make_relay):
    """Every content event of one read is one sample, as a client sees them: TTFT is that
    read's time, so a stream whose events all came in one read has TTFT = last content and a
    TPOT of 0 (never below: a later clock reading for the first event made it negative)."""
    app = await make_relay()
    body = httpc.chat(6, events_per_chunk=6)
    resp = await httpc.fetch(app.port, "POST", CHAT, body, headers=rid_header("one-read"))
    assert resp.status == 200 and resp.complete
    row = await one_row(app, "one-read")
    assert row["completion_tokens"] == 6
    assert row["ttft_ms"] == row["last_content_ms"] and row["tpot_ms"] == 0.0

"""`relay report` benchmark view (issue 13 item 2) on a known set of rows, every figure
computed by hand: TTFT/TPOT/E2EL mean and linear-interpolated percentiles, pooled ITL from
the gap buckets, throughputs over the window, goodput under SLOs; JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
import sqlite3

import pytest

from relay.report import bench as benchview
from relay.report import summary as report
from relay.store.sqlite import Store
from relay.stream import itl as G

T0 = 1_790_000_000.0  # the window: [T0, T0 + 100]


def hist(gap_s: float, n: int) -> str:
    g = G.Gaps()
    g.events(0.0, 0, 1)
    for i in range(1, n + 1):
        g.events(i * gap_s, 1, 2)
    return g.encode()


ROWS = [  # model, upstream, key, ok, ttft, tpot, e2e, tokens, itl_hist
    ("a", "u1", "k1", 1, 100.0, 10.0, 200.0, 11, hist(0.010, 10)),
    ("a", "u1", "k1", 1, 200.0, 20.0, 400.0, 11, hist(0.020, 10)),
    ("a", "u2", "k2", 1, 300.0, 30.0, 600.0, 11, None),
    ("a", "u2", "k2", 1, 400.0, 40.0, 800.0, 11, None),
    ("a", "u2", "k2", 0, 50.0, None, 60.0, 3, None),  # failed: not in the figures
    ("b", "u1", "k1", 1, 1000.0, None, 1000.0, 1, None),  # one token: no TPOT
]
# 10 ms = 0.64 * 2**-6 s: with 32 buckets an octave its bucket is [40/64, 41/64) * 2**-6 s
MID_10MS = (40 / 64 + 41 / 64) / 2 * 2**-6 * 1000  # the 10 ms gaps' bucket midpoint, ms
MID_20MS = 2 * MID_10MS


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "relay.db")
    store = Store(path, retention_days=0)
    store.start()
    for i, (model, up, key, ok, ttft, tpot, e2e, tokens, ih) in enumerate(ROWS):
        store.put(
            {
                "ts": T0 + 10 + i,
                "request_id": f"r{i}",
                "model": model,
                "upstream_served": up,
                "key_id": key,
                "ok": ok,
                "stream": 1,
                "ttft_ms": ttft,
                "tpot_ms": tpot,
                "e2e_ms": e2e,
                "total_ms": e2e,
                "completion_tokens": tokens,
                "itl_hist": ih,
                "status": 200 if ok else 502,
            }
        )
    store.put(
        {
            "ts": T0 - 5,
            "request_id": "before",
            "model": "a",
            "ok": 1,
            "ttft_ms": 1.0,
            "e2e_ms": 1.0,
            "completion_tokens": 1,
        }
    )  # outside the window
    store.close()
    return path


def run(capsys, *argv) -> str:
    assert report.main(list(argv)) == 0
    return capsys.readouterr().out


def test_figures_by_model(db, capsys):
    out = json.loads(
        run(
            capsys,
            "--db",
            db,
            "--from",
            str(T0),
            "--to",
            str(T0 + 100),
            "--slo",
            "ttft=300ms,tpot=0.025s",
            "--json",
        )
    )
    assert out["by"] == "model" and (out["from"], out["to"]) == (T0, T0 + 100)
    a, b = out["groups"]
    assert (a["group"], a["requests"], a["completed"], a["failed"]) == ("a", 5, 4, 1)
    # over the span of its requests: the first starts at T0 + 10, the last (60 ms) ends at
    # T0 + 14.06; the window is 100 s
    assert a["duration_s"] == pytest.approx(4.06) and a["window_s"] == 100.0
    assert a["request_throughput"] == pytest.approx(4 / 4.06)
    assert a["output_throughput"] == pytest.approx(44 / 4.06)
    # linear interpolation between closest ranks: p90 of 4 values sits at 2.7
    assert a["ttft"] == {
        "mean": 250.0,
        "p50": 250.0,
        "p90": 370.0,
        "p99": pytest.approx(397.0),
        "n": 4,
    }
    assert a["tpot"] == {"mean": 25.0, "p50": 25.0, "p90": 37.0, "p99": pytest.approx(39.7), "n": 4}
    assert a["e2el"] == {
        "mean": 500.0,
        "p50": 500.0,
        "p90": 740.0,
        "p99": pytest.approx(794.0),
        "n": 4,
    }
    # ITL: 20 gaps pooled, 10 of 10 ms and 10 of 20 ms, each read as its bucket's midpoint
    assert a["itl"] == {
        "mean": pytest.approx((MID_10MS + MID_20MS) / 2),
        "p50": pytest.approx(MID_10MS),
        "p90": pytest.approx(MID_20MS),
        "p99": pytest.approx(MID_20MS),
        "n": 20,
    }
    # goodput: TTFT <= 300 ms and TPOT <= 25 ms: the first two requests
    assert (a["good"], a["goodput"]) == (2, pytest.approx(2 / 4.06))
    assert (b["group"], b["completed"], b["good"]) == ("b", 1, 0)  # TTFT 1000 ms
    assert b["tpot"] == {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0}
    total = out["total"]
    assert (total["completed"], total["good"], total["output_tokens"]) == (5, 2, 45)
    assert total["ttft"]["p50"] == 300.0  # 100, 200, 300, 400, 1000


def test_reserved_tokens_are_no_output():
    rows = [
        {"ok": 1, "completion_tokens": 10, "tokens_source": "exact"},
        {"ok": 1, "completion_tokens": 1024, "tokens_source": "reserved"},
    ]
    _, total = benchview.bench(rows, "model", 10.0)
    assert total["output_tokens"] == 10 and total["output_throughput"] == 1.0


def test_one_token_request_meets_a_tpot_slo():
    row = {"ttft_ms": 10.0, "tpot_ms": None, "e2e_ms": 10.0, "completion_tokens": 1}
    assert benchview.meets(row, {"tpot": 5.0, "ttft": 20.0})
    assert not benchview.meets({**row, "ttft_ms": None}, {"ttft": 20.0})  # not streamed
    assert not benchview.meets({**row, "completion_tokens": 5}, {"tpot": 5.0})


def test_by_upstream_and_key_and_csv(db, capsys):
    out = json.loads(
        run(
            capsys,
            "--db",
            db,
            "--from",
            str(T0),
            "--to",
            str(T0 + 100),
            "--by",
            "upstream",
            "--json",
        )
    )
    assert [(g["group"], g["completed"]) for g in out["groups"]] == [("u1", 3), ("u2", 2)]
    assert "goodput" not in out["total"]
    text = run(
        capsys,
        "--db",
        db,
        "--from",
        str(T0),
        "--to",
        str(T0 + 100),
        "--by",
        "key",
        "--csv",
        "--slo",
        "e2el=1s",
    )
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [r["group"] for r in rows] == ["k1", "k2", "TOTAL"]
    assert rows[0]["completed"] == "3" and rows[0]["good"] == "3"  # e2e 200, 400, 1000
    assert float(rows[1]["ttft_mean_ms"]) == 350.0 and rows[1]["itl_p50_ms"] == ""
    assert float(rows[2]["goodput"]) == pytest.approx(5 / 6.0)  # T0 + 10 .. T0 + 15 + 1 s


def test_table_and_iso_window(db, capsys):
    text = run(
        capsys,
        "--db",
        db,
        "--from",
        "2026-09-21T14:13:20Z",
        "--to",
        "2026-09-21T14:15:00+00:00",
        "--bench",
    )
    assert "from 2026-09-21 14:13:20 UTC to 2026-09-21 14:15:00 UTC" in text
    assert "== model a: 4 completed, 1 failed, over 4.1 s" in text
    assert "request throughput 0.985 req/s, output 10.84 tok/s" in text
    assert "   TTFT      250.0    250.0    370.0    397.0" in text


def test_old_database_reads(tmp_path, capsys):
    path = str(tmp_path / "old.db")
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE request (ts REAL, model TEXT, ok INTEGER, ttft_ms REAL,"
        " completion_tokens INTEGER, upstream_served TEXT, key_id TEXT, stream INT,"
        " prompt_tokens INT)"
    )
    conn.execute("INSERT INTO request VALUES (?, 'm', 1, 5.0, 3, 'u', NULL, 1, 1)", (T0 + 1,))
    conn.commit()
    conn.close()
    out = json.loads(run(capsys, "--db", path, "--from", str(T0), "--to", str(T0 + 10), "--json"))
    assert out["total"]["ttft"]["p50"] == 5.0 and out["total"]["e2el"]["n"] == 0


def test_bad_flags(db, capsys):
    for argv in (
        ["--slo", "ttft=fast"],
        ["--from", "yesterday"],
        ["--from", str(T0 + 10), "--to", str(T0)],
    ):
        with pytest.raises(SystemExit) as exc:
            report.main(["--db", db, *argv])
        assert exc.value.code == 2
    assert benchview.parse_slo("ttft=500,tpot=50ms,e2el=2s") == {
        "ttft": 500.0,
        "tpot": 50.0,
        "e2el": 2000.0,
    }


def test_requests_that_generate_nothing_are_left_out_unless_asked(tmp_path, capsys):
    path = str(tmp_path / "relay.db")
    store = Store(path, retention_days=0)
    store.start()
    for i, (method, route, ttft) in enumerate(
        [
            ("POST", "/v1/chat/completions", 100.0),
            ("POST", "/v1/messages", 300.0),
            ("GET", "/health", None),
            ("GET", "/v1/models", None),
            ("POST", "/tokenize", None),
            ("GET", "/api/ui/state", None),
        ]
    ):
        store.put(
            {
                "ts": T0 + 10 + i,
                "request_id": f"g{i}",
                "model": "m",
                "method": method,
                "path": route,
                "ok": 1,
                "ttft_ms": ttft,
                "e2e_ms": 500.0,
                "total_ms": 500.0,
                "completion_tokens": 5 if ttft else None,
                "status": 200,
            }
        )
    store.close()
    window = ["--db", path, "--from", str(T0), "--to", str(T0 + 100), "--json"]
    total = json.loads(run(capsys, *window))["total"]
    # the two generating requests, over their own span: T0 + 10 .. T0 + 11.5
    assert (total["requests"], total["completed"]) == (2, 2)
    assert total["duration_s"] == pytest.approx(1.5)
    assert total["request_throughput"] == pytest.approx(2 / 1.5)
    assert total["ttft"]["mean"] == 200.0
    every = json.loads(run(capsys, *window, "--all"))["total"]
    assert (every["requests"], every["completed"]) == (6, 6)
    assert every["duration_s"] == pytest.approx(5.5)

import json
import time

import pytest

from relay.report.summary import (
    aggregate,
    main,
    parse_since,
    percentile,
    render_table,
    summarize,
)
from relay.store.sqlite import Store


def row(
    model,
    upstream,
    ok=1,
    code=None,
    status=200,
    stream=1,
    queue=None,
    ttft=None,
    total=None,
    tokens=None,
    source=None,
    ts=None,
):
    return {
        "ts": ts,
        "model": model,
        "upstream_served": upstream,
        "ok": ok,
        "error_code": code,
        "status": status,
        "stream": stream,
        "queue_ms": queue,
        "ttft_ms": ttft,
        "total_ms": total,
        "completion_tokens": tokens,
        "tokens_source": source,
    }


def known_rows(ts=None):
    return [
        # m1 via a: three good streams (tok/s 50, 30, 200) and one stall
        row("m1", "a", queue=0, ttft=100, total=1100, tokens=50, source="exact", ts=ts),
        row("m1", "a", queue=10, ttft=200, total=2200, tokens=60, source="approx", ts=ts),
        row("m1", "a", queue=20, ttft=300, total=800, tokens=100, source="exact", ts=ts),
        row(
            "m1",
            "a",
            ok=0,
            code="stream_stall_idle",
            queue=30,
            ttft=400,
            total=5000,
            tokens=10,
            source="approx",
            ts=ts,
        ),
        # m1 served by fallback b: a refused connect and a non-streamed answer
        row("m1", "b", ok=0, code="upstream_unavailable", status=502, queue=1, total=5, ts=ts),
        row("m1", "b", stream=0, queue=2, total=900, tokens=40, source="exact", ts=ts),
        # m2 via a: one good stream, two stalls, one upstream 500 passed through
        row("m2", "a", queue=5, ttft=50, total=1050, tokens=20, source="exact", ts=ts),
        row("m2", "a", ok=0, code="stream_stall_idle", queue=5, ttft=60, total=300, ts=ts),
        row("m2", "a", ok=0, code="stream_stall_total", queue=5, ttft=70, total=300, ts=ts),
        row("m2", "a", ok=0, code="stream_stall_idle", queue=5, ttft=80, total=300, ts=ts),
        row("m2", "a", ok=0, status=500, queue=5, total=10, ts=ts),
    ]


def test_percentile_nearest_rank():
    data = [15, 20, 35, 40, 50]
    assert [percentile(data, p) for p in (5, 30, 40, 50, 100)] == [15, 20, 20, 35, 50]
    data = [20, 16, 15, 13, 10, 8, 8, 7, 6, 3]  # order does not matter
    assert [percentile(data, p) for p in (25, 50, 75, 95, 100)] == [7, 8, 15, 20, 20]
    assert percentile(list(range(1, 21)), 95) == 19  # 0.95 * 20 is exactly rank 19
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([7.5], 50) == 7.5
    assert percentile([], 50) is None
    assert percentile([3, 1, 2], 0) == 1


def test_parse_since():
    assert parse_since("30m") == 1800
    assert parse_since("1h") == 3600
    assert parse_since("24h") == 86400
    assert parse_since("7d") == 7 * 86400
    assert parse_since("all") is None
    for bad in ("", "1w", "h", "0h", "-1h", "1 h"):
        with pytest.raises(ValueError):
            parse_since(bad)


def test_aggregate_exact_numbers():
    m1a, m1b, m2a = aggregate(known_rows())
    assert m1a == {
        "model": "m1",
        "upstream": "a",
        "requests": 4,
        "ok": 3,
        "failed": 1,
        "failures": {"stream_stall_idle": 1},
        "ttft_p50_ms": 200,
        "ttft_p95_ms": 400,
        "ttft_p99_ms": 400,
        "tok_s_p50": 50.0,
        "queue_p95_ms": 30,
        "completion_tokens": 220,
        "tokens_exact": 2,
        "tokens_approx": 2,
    }
    assert m1b == {
        "model": "m1",
        "upstream": "b",
        "requests": 2,
        "ok": 1,
        "failed": 1,
        "failures": {"upstream_unavailable": 1},
        "ttft_p50_ms": None,
        "ttft_p95_ms": None,
        "ttft_p99_ms": None,
        "tok_s_p50": None,
        "queue_p95_ms": 2,
        "completion_tokens": 40,
        "tokens_exact": 1,
        "tokens_approx": 0,
    }
    assert (m2a["requests"], m2a["ok"], m2a["failed"]) == (5, 1, 4)
    assert list(m2a["failures"].items()) == [
        ("stream_stall_idle", 2),
        ("http_500", 1),
        ("stream_stall_total", 1),
    ]
    assert (m2a["ttft_p50_ms"], m2a["ttft_p95_ms"]) == (60, 80)
    assert m2a["tok_s_p50"] == 20.0


def test_total_pools_all_rows():
    total = summarize(known_rows(), model="TOTAL")
    assert (total["requests"], total["ok"], total["failed"]) == (11, 5, 6)
    assert total["failures"] == {
        "stream_stall_idle": 3,
        "http_500": 1,
        "stream_stall_total": 1,
        "upstream_unavailable": 1,
    }
    # ttft over 8 rows: 50 60 70 80 100 200 300 400
    assert (total["ttft_p50_ms"], total["ttft_p95_ms"]) == (80, 400)
    assert total["tok_s_p50"] == 30.0  # rates 20 30 50 200
    assert total["completion_tokens"] == 280
    assert (total["tokens_exact"], total["tokens_approx"]) == (4, 2)


def test_render_table_aligns_numbers_under_headers():
    rows = known_rows()
    text = render_table(aggregate(rows), summarize(rows))
    lines = text.splitlines()
    header, rule, m1a, m1b, m2a, rule2, total = lines
    assert set(rule) <= {"-", " "} and rule == rule2
    assert m1a.split()[:13] == [
        "m1",
        "a",
        "4",
        "3",
        "1",
        "200.0",
        "400.0",
        "400.0",
        "50.0",
        "30.0",
        "220",
        "2",
        "2",
    ]
    assert m1a.endswith("stream_stall_idle:1")
    assert m1b.split()[5:9] == ["-", "-", "-", "-"]
    assert m2a.endswith("stream_stall_idle:2 http_500:1 stream_stall_total:1")
    assert total.startswith("TOTAL") and " 280 " in total
    for name, value in (
        ("ttft p50", "200.0"),
        ("tok/s p50", "50.0"),
        ("compl tok", "220"),
        ("reqs", "4"),
    ):
        end = header.index(name) + len(name)
        assert m1a[end - len(value) : end] == value, name  # right-aligned under its header
    assert header.index("failures") == m1a.index("stream_stall_idle")


@pytest.fixture
def report_db(tmp_path):
    path = str(tmp_path / "relay.db")
    now = time.time()
    store = Store(path, retention_days=0)
    store.start()
    for r in known_rows(ts=now - 60):
        store.put(r)
    store.put(row("old", "a", ttft=5, total=10, tokens=1, source="exact", ts=now - 7200))
    store.close()
    return path


def test_main_json(report_db, capsys):
    assert main(["--db", report_db, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["since_s"] == 3600
    assert [(g["model"], g["upstream"]) for g in out["groups"]] == [
        ("m1", "a"),
        ("m1", "b"),
        ("m2", "a"),
    ]
    assert out["groups"] == aggregate(known_rows())
    assert out["total"]["requests"] == 11


def test_main_since_filters(report_db, capsys):
    assert main(["--db", report_db, "--json", "--since", "all"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["since_s"] is None
    assert [g["model"] for g in out["groups"]] == ["m1", "m1", "m2", "old"]
    assert main(["--db", report_db, "--json", "--since", "30s"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"] == []


def test_main_table(report_db, capsys):
    assert main(["--db", report_db, "--since", "2h"]) == 0
    out = capsys.readouterr().out
    assert "11 requests" in out and "old" not in out
    assert (
        out.splitlines()[1:]
        == render_table(aggregate(known_rows()), summarize(known_rows())).splitlines()
    )


def test_missing_db_exits_2(tmp_path, capsys):
    assert main(["--db", str(tmp_path / "nope.db")]) == 2
    assert "no database file" in capsys.readouterr().err
    assert not (tmp_path / "nope.db").exists()  # reading never creates the file


def test_bad_since_exits_2(report_db):
    with pytest.raises(SystemExit) as exc:
        main(["--db", report_db, "--since", "1w"])
    assert exc.value.code == 2

"""`relay report`'s prompt-cache hit ratio per pool (issue 32, items 6): the prompt tokens each
pool was sent, the part its members reused from their cache, cached / prompt; in the summary
(table, JSON), in the benchmark view (text, JSON, CSV, `--by pool`), on a real SQLite store.
Every figure is worked out by hand from the rows below."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import subprocess
import sys
import time

import pytest

from relay.observe.record import Record
from relay.report import prompt_cache as cache
from relay.report import summary as report
from relay.store.schema import COLUMN_TYPES
from relay.store.sqlite import Store
from tests.support.fixtures import ROOT

T0 = 1_790_000_000.0
EVIL = "q\x1b[2J\r\nTOTAL  9  9"
EVIL_SHOWN = r"q\x1b[2J\r\nTOTAL  9  9"

# pool, prompt, cached: what each row holds.
ROWS = [
    ("qwen", 1200, 1100),
    ("qwen", 1000, None),  # no cached figure: its prompt counts, not as cached
    ("qwen", 800, 900),  # another tool wrote more cached than prompt: none of it cached
    ("qwen", None, 5),  # no prompt figure: nothing either way
    ("llama", 500, 250),
    (None, 2000, 2000),  # no pool: not in the ratio
]
# qwen: 4 requests, 1200 + 1000 + 800 = 3000 prompt, 1100 cached; llama: 500, 250.
QWEN = {"requests": 4, "prompt_tokens": 3000, "cached_tokens": 1100, "hit_ratio": 1100 / 3000}
LLAMA = {"requests": 1, "prompt_tokens": 500, "cached_tokens": 250, "hit_ratio": 0.5}
TOTAL = {"requests": 5, "prompt_tokens": 3500, "cached_tokens": 1350, "hit_ratio": 1350 / 3500}


def rows() -> list[dict]:
    return [{"pool": p, "prompt_tokens": n, "cached_tokens": c} for p, n, c in ROWS]


# ---- pure -------------------------------------------------------------------------------------
def test_hits_per_pool_and_in_all():
    assert cache.per_pool(rows()) == [{"pool": "llama", **LLAMA}, {"pool": "qwen", **QWEN}]
    assert cache.hits(rows()) == TOTAL


def test_a_pool_with_no_prompt_token_has_no_ratio():
    assert cache.hits([{"pool": "p", "prompt_tokens": 0, "cached_tokens": 0}]) == {
        "requests": 1,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "hit_ratio": None,
    }
    assert cache.hits([]) == {
        "requests": 0,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "hit_ratio": None,
    }
    assert cache.per_pool([{"pool": None, "prompt_tokens": 5}]) == []


def test_figures_no_count_can_be_are_held_to_one():
    got = cache.hits(
        [
            {"pool": "p", "prompt_tokens": -50, "cached_tokens": 0},  # a negative prompt: 0
            {"pool": "p", "prompt_tokens": 3 * 10**9, "cached_tokens": 2 * 10**9},  # 10^9
            {"pool": "p", "prompt_tokens": 100, "cached_tokens": -1},  # not cached
        ]
    )
    assert got == {
        "requests": 3,
        "prompt_tokens": 10**9 + 100,
        "cached_tokens": 0,
        "hit_ratio": 0.0,
    }


# ---- on a store --------------------------------------------------------------------------------
def _record(i: int, pool: str | None, prompt: int | None, cached: int | None) -> Record:
    rec = Record(ts=T0 + 10 + i, request_id=f"r{i}", path="/v1/chat/completions", method="POST")
    rec.model, rec.upstream_served, rec.pool = "m", f"box-{i % 2}", pool
    rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens = prompt, cached, 4
    rec.ok, rec.status, rec.stream, rec.total_ms = True, 200, True, 100.0
    return rec


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "relay.db")
    store = Store(path, retention_days=0)
    store.start()
    for i, (pool, prompt, cached) in enumerate(ROWS):
        store.put_record(_record(i, pool, prompt, cached))
    store.put_record(_record(len(ROWS), EVIL, 100, 40))
    store.close()
    return path


def run(capsys, *argv: str) -> str:
    assert report.main(list(argv)) == 0
    return capsys.readouterr().out


WINDOW = ("--from", str(T0), "--to", str(T0 + 100))
EVIL_HITS = {"requests": 1, "prompt_tokens": 100, "cached_tokens": 40, "hit_ratio": 0.4}
ALL = {"requests": 6, "prompt_tokens": 3600, "cached_tokens": 1390, "hit_ratio": 1390 / 3600}


def test_summary_json(db, capsys):
    out = json.loads(run(capsys, "--db", db, "--since", "all", "--json"))
    assert out["prompt_cache"] == {
        "pools": [
            {"pool": "llama", **LLAMA},
            {"pool": EVIL, **EVIL_HITS},
            {"pool": "qwen", **QWEN},
        ],
        "total": ALL,
    }


def test_summary_table(db, capsys):
    text = run(capsys, "--db", db, "--since", "all")
    lines = text.splitlines()
    at = lines.index(cache.LEGEND)
    assert lines[at - 1] == ""  # after the (model, upstream) table, a blank line
    header, rule, *body, rule2, total = lines[at + 1 :]
    assert header.split() == ["pool", "reqs", "prompt", "tok", "cached", "tok", "hit"]
    assert set(rule) <= {"-", " "} and rule == rule2
    assert rule.split()[-1] == "-----"  # as wide as "50.0%"
    assert [line.split() for line in body] == [
        ["llama", "1", "500", "250", "50.0%"],
        [EVIL_SHOWN.split()[0], "9", "9", "1", "100", "40", "40.0%"],
        ["qwen", "4", "3000", "1100", "36.7%"],
    ]
    assert total.split() == ["TOTAL", "6", "3600", "1390", "38.6%"]
    # the numbers right-aligned under their headers
    end = header.index("cached tok") + len("cached tok")
    assert body[2][end - 4 : end] == "1100"
    assert "\x1b" not in text and "\r" not in text


def test_no_pool_no_section(tmp_path, capsys):
    path = str(tmp_path / "relay.db")
    store = Store(path, retention_days=0)
    store.start()
    store.put_record(_record(0, None, 1200, 1100))
    store.close()
    text = run(capsys, "--db", path, "--since", "all")
    assert cache.LEGEND not in text and "hit" not in text
    out = json.loads(run(capsys, "--db", path, "--since", "all", "--json"))
    assert out["prompt_cache"] == {
        "pools": [],
        "total": {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "hit_ratio": None},
    }


def test_a_database_from_before_the_columns_reads(tmp_path, capsys):
    """A report reads, never migrates: the columns an older relay's table lacks read NULL."""
    path = str(tmp_path / "old.db")
    conn = sqlite3.connect(path)
    old = [f"{c} {t}" for c, t in COLUMN_TYPES if c not in ("pool", "cached_tokens")]
    conn.execute(f"CREATE TABLE request ({', '.join(old)})")
    conn.execute(
        "INSERT INTO request (ts, request_id, model, upstream_served, ok, stream, prompt_tokens,"
        " completion_tokens, status) VALUES (?, 'r', 'm', 'u', 1, 1, 1200, 4, 200)",
        (time.time() - 60,),
    )
    conn.commit()
    conn.close()
    out = json.loads(run(capsys, "--db", path, "--json"))
    assert out["total"]["requests"] == 1 and out["prompt_cache"]["pools"] == []
    out = json.loads(run(capsys, "--db", path, "--bench", "--json"))
    assert out["total"]["completed"] == 1
    assert out["total"]["prompt_cache"]["requests"] == 0
    cols = [r[1] for r in sqlite3.connect(path).execute("PRAGMA table_info(request)")]
    assert "pool" not in cols  # the file is as it was


def test_bench_by_pool(db, capsys):
    out = json.loads(run(capsys, "--db", db, *WINDOW, "--by", "pool", "--json"))
    assert [(g["group"], g["prompt_cache"]) for g in out["groups"]] == [
        ("llama", LLAMA),
        (EVIL, EVIL_HITS),  # "q\x1b" sorts before "qw"
        ("qwen", QWEN),
        # the rows of no pool: a group of their own, in no ratio
        (None, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "hit_ratio": None}),
    ]
    assert out["total"]["prompt_cache"] == ALL
    text = run(capsys, "--db", db, *WINDOW, "--by", "pool")
    assert "== pool qwen: 4 completed, 0 failed" in text
    assert (
        "   prompt cache 36.7% hit: 1100 of 3000 prompt tokens cached (4 requests to a pool)"
        in (text)
    )
    assert f"== pool {EVIL_SHOWN}: 1 completed" in text
    assert (
        "   prompt cache 38.6% hit: 1390 of 3600 prompt tokens cached (6 requests to a pool)"
        in (text)
    )
    assert text.splitlines()[-1] == cache.LEGEND
    assert "\x1b" not in text and "\r" not in text


def test_bench_by_model_and_csv(db, capsys):
    text = run(capsys, "--db", db, *WINDOW, "--bench")
    # one model: its group and the total hold every pool's rows
    assert text.count("   prompt cache 38.6% hit: 1390 of 3600 prompt tokens cached") == 2
    got = list(
        csv.DictReader(io.StringIO(run(capsys, "--db", db, *WINDOW, "--by", "pool", "--csv")))
    )
    assert [r["group"] for r in got] == ["llama", EVIL_SHOWN, "qwen", "", "TOTAL"]
    qwen = got[2]
    assert (
        qwen["prompt_cache_requests"],
        qwen["prompt_cache_prompt_tokens"],
        qwen["prompt_cache_cached_tokens"],
    ) == ("4", "3000", "1100")
    assert float(qwen["prompt_cache_hit_ratio"]) == pytest.approx(1100 / 3000)
    assert got[3]["prompt_cache_requests"] == "0" and got[3]["prompt_cache_hit_ratio"] == ""


def test_a_bench_view_with_no_pool_says_nothing_of_it(tmp_path, capsys):
    path = str(tmp_path / "relay.db")
    store = Store(path, retention_days=0)
    store.start()
    store.put_record(_record(0, None, 1200, 1100))
    store.close()
    text = run(capsys, "--db", path, *WINDOW, "--bench")
    assert "prompt cache" not in text


def test_a_row_whose_pool_or_cached_figure_is_of_the_wrong_kind_is_left_out(db):
    """Rows another tool wrote: a pool of bytes, a cached figure of text; each is named on
    stderr and left out, the figures as before."""
    other = sqlite3.connect(db)
    other.execute(
        "INSERT INTO request (ts, request_id, model, ok, pool, prompt_tokens, cached_tokens)"
        " VALUES (?, 'b1', 'm', 1, X'71ff', 100, 50)",
        (T0 + 50,),
    )
    other.execute(
        "INSERT INTO request (ts, request_id, model, ok, pool, prompt_tokens, cached_tokens)"
        " VALUES (?, 'b2', 'm', 1, 'qwen', 100, 'most')",
        (T0 + 51,),
    )
    other.commit()
    other.close()
    # the summary's figures, then the benchmark view's
    totals = (lambda out: out["prompt_cache"]["total"], lambda out: out["total"]["prompt_cache"])
    for argv, total in zip((("--since", "all", "--json"), (*WINDOW, "--bench", "--json")), totals):
        done = subprocess.run(
            [sys.executable, "-m", "relay", "report", "--db", db, *argv],
            capture_output=True,
            cwd=ROOT,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr.decode().splitlines() == [
            "relay report: row 8 skipped: pool is not text",
            "relay report: row 9 skipped: cached_tokens is not a finite number",
        ]
        assert total(json.loads(done.stdout)) == ALL

"""`relay report` on rows it cannot trust (issue 31 item 7): a client's model name holding
terminal escapes and forged lines, and rows another tool wrote with text in numeric columns.

Every form is run as a user runs it (`python -m relay report`) on a real SQLite store: its
bytes hold no control character but the output's own line ends, no line is forged, each bad
row is named once on stderr and the other rows are summed as if it were not there.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from relay.store.sqlite import Store
from tests.support.fixtures import ROOT

# Sets the window title, clears the screen, homes the cursor, a C1 CSI, DEL, backspace, TAB,
# NUL; then a TOTAL line of each form forged after a CR LF or a LF.
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[H\x9b31m\x7f\x08\t\x00"
MODEL = (
    "evil"
    + ESCAPES
    + "\r\nTOTAL  999  999  0\n== TOTAL: 999 completed, 0 failed, over 1.0 s\nTOTAL,999,999"
)
UPSTREAM = "u\x1b[31mred\x85next"
KEY = "k\r\n== TOTAL: 7 completed"
ERROR_CODE = "boom\x1b[0m\nTOTAL 1"
# MODEL as the text forms show it.
MODEL_SHOWN = (
    r"evil\x1b]0;pwned\x07\x1b[2J\x1b[H\x9b31m\x7f\x08\t\x00"
    r"\r\nTOTAL  999  999  0\n== TOTAL: 999 completed, 0 failed, over 1.0 s\nTOTAL,999,999"
)


def good(ts: float, **over: object) -> dict[str, object]:
    row: dict[str, object] = {
        "ts": ts,
        "model": "m1",
        "upstream_served": "u1",
        "key_id": "k1",
        "ok": 1,
        "stream": 1,
        "status": 200,
        "tokens_source": "exact",
    }
    return {**row, **over}


@pytest.fixture
def db(tmp_path):
    """Three rows the relay wrote (one of a hostile client), then four another tool wrote
    wrong (rowids 4 to 7), then one whose text is not UTF-8 (rowid 8, read as it can be)."""
    path = str(tmp_path / "relay.db")
    ts = time.time() - 60
    store = Store(path, retention_days=0)
    store.start()
    store.put(
        good(ts, request_id="g1", queue_ms=5.0, ttft_ms=100.0, tpot_ms=20.0)
        | {"total_ms": 1100.0, "e2e_ms": 1100.0, "completion_tokens": 50}
    )
    store.put(
        good(ts + 1, request_id="g2", queue_ms=15.0, ttft_ms=300.0, tpot_ms=4.0)
        | {"total_ms": 800.0, "e2e_ms": 800.0, "completion_tokens": 100}
    )
    store.put(
        good(ts + 2, request_id="evil", model=MODEL, upstream_served=UPSTREAM, key_id=KEY)
        | {"ok": 0, "status": 502, "error_code": ERROR_CODE, "queue_ms": 1.0, "total_ms": 5.0}
        | {"completion_tokens": 0, "tokens_source": None}
    )
    store.close()
    other = sqlite3.connect(path)
    for row in (
        good(ts, request_id="b4", ttft_ms="fast", total_ms=900.0, completion_tokens=7),
        good(ts, request_id="b5", model="m2", ttft_ms=10.0, completion_tokens="lots"),
        good(ts, request_id="b6", ttft_ms=math.inf, total_ms=900.0, completion_tokens=7),
        good(ts, request_id="b7", model=b"\x1b[2Jblob", ttft_ms=10.0, completion_tokens=7),
    ):
        cols = ", ".join(row)
        other.execute(
            f"INSERT INTO request ({cols}) VALUES ({', '.join('?' * len(row))})", [*row.values()]
        )
    other.commit()
    other.close()
    return path


BAD = {4: "ttft_ms", 5: "completion_tokens", 6: "ttft_ms", 7: "model"}


def report(db: str, *argv: str, password: str | None = None) -> tuple[bytes, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if password is not None:
        env["PGPASSWORD"] = password
    done = subprocess.run(
        [sys.executable, "-m", "relay", "report", "--db", db, *argv],
        capture_output=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    err = done.stderr.decode()
    assert done.returncode == 0, err
    return done.stdout, err


def assert_clean(out: bytes) -> None:
    """No control byte but the output's own line ends; no C1 control either."""
    assert [b for b in out if b < 0x20 and b != 0x0A] == []
    assert not {0x1B, 0x7F, 0x9B} & set(out)
    assert [c for c in out.decode() if 0x80 <= ord(c) <= 0x9F] == []


def assert_bad_rows_named_once(err: str) -> None:
    lines = err.splitlines()
    assert_clean(err.encode())
    assert len(lines) == len(BAD), lines
    for rowid, column in BAD.items():
        named = [line for line in lines if f"row {rowid} " in line]
        assert len(named) == 1 and column in named[0], (rowid, lines)


FORMS = [
    ((), "TOTAL "),
    (("--json",), None),
    (("--bench",), "== TOTAL"),
    (("--bench", "--by", "upstream"), "== TOTAL"),
    (("--bench", "--by", "key"), "== TOTAL"),
    (("--bench", "--json"), None),
    (("--bench", "--csv"), "TOTAL,"),
]


@pytest.mark.parametrize(("argv", "total"), FORMS, ids=[" ".join(f[0]) or "text" for f in FORMS])
def test_every_form_is_clean_and_names_each_bad_row_once(db, argv, total):
    out, err = report(db, *argv)
    assert_clean(out)
    assert_bad_rows_named_once(err)
    lines = out.decode().split("\n")
    if total is not None:
        assert len([line for line in lines if line.startswith(total)]) == 1, lines
        assert not [line for line in lines if line.startswith(("TOTAL", "== TOTAL"))][1:]


def _strict_json(out: bytes) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"not JSON: {name}")

    parsed: dict = json.loads(out, parse_constant=refuse)
    return parsed


def test_text_summary_sums_the_other_rows(db):
    out, _ = report(db)
    lines = out.decode().splitlines()
    m1 = [line for line in lines if line.startswith("m1 ")]
    assert [line.split() for line in m1] == [
        ["m1", "u1", "2", "2", "0", "100.0", "300.0", "300.0", "50.0", "15.0", "150", "2", "0", "-"]
    ]
    (evil,) = [line for line in lines if line.startswith("evil")]
    assert evil.startswith(MODEL_SHOWN + "  " + r"u\x1b[31mred\x85next")
    assert evil.endswith(r"boom\x1b[0m\nTOTAL 1:1")
    (total,) = [line for line in lines if line.startswith("TOTAL")]
    assert total.split() == [
        "TOTAL",
        "3",
        "2",
        "1",
        "100.0",
        "300.0",
        "300.0",
        "50.0",
        "15.0",
        "150",
        "2",
        "0",
        r"boom\x1b[0m\nTOTAL",
        "1:1",
    ]
    assert "m2" not in out.decode()  # its only row is bad


def test_json_summary_is_valid_and_keeps_the_text(db):
    out, _ = report(db, "--json")
    parsed = _strict_json(out)
    assert [(g["model"], g["upstream"]) for g in parsed["groups"]] == [
        (MODEL, UPSTREAM),
        ("m1", "u1"),
    ]
    total = parsed["total"]
    assert (total["requests"], total["ok"], total["failed"]) == (3, 2, 1)
    assert (total["completion_tokens"], total["ttft_p50_ms"]) == (150, 100.0)
    assert total["failures"] == {ERROR_CODE: 1}


def test_bench_sums_the_other_rows(db):
    out, _ = report(db, "--bench")
    lines = out.decode().splitlines()
    head = lines.index(next(line for line in lines if line.startswith("== TOTAL")))
    assert lines[head].startswith("== TOTAL: 2 completed, 1 failed, over ")
    assert lines[head + 3].split() == ["TTFT", "200.0", "200.0", "280.0", "298.0"]
    assert lines[head + 4].split() == ["TPOT", "12.0", "12.0", "18.4", "19.8"]
    assert lines[head + 6].split() == ["E2EL", "950.0", "950.0", "1070.0", "1097.0"]
    assert [line for line in lines if line.startswith("== model evil")] == [
        next(
            line
            for line in lines
            if line.startswith("== model " + MODEL_SHOWN + ": 0 completed, 1 failed, over ")
        )
    ]
    parsed = _strict_json(report(db, "--bench", "--json")[0])
    assert [g["group"] for g in parsed["groups"]] == [MODEL, "m1"]
    total = parsed["total"]
    assert (total["requests"], total["completed"], total["output_tokens"]) == (3, 2, 150)
    assert total["ttft"]["mean"] == 200.0 and total["e2el"]["mean"] == 950.0


def test_bench_csv_escapes_the_cells(db):
    out, _ = report(db, "--bench", "--by", "key", "--csv")
    lines = out.decode().splitlines()
    assert [line.split(",")[:4] for line in lines[1:]] == [
        [r"k\r\n== TOTAL: 7 completed", "1", "0", "1"],
        ["k1", "2", "2", "0"],
        ["TOTAL", "3", "2", "1"],
    ]


def test_text_that_is_not_utf8_is_read(tmp_path):
    """SQLite keeps whatever bytes another tool casts to TEXT; such a row is read, its text
    shown as far as it decodes."""
    path = str(tmp_path / "relay.db")
    store = Store(path, retention_days=0)
    store.start()
    store.put(good(time.time() - 60, request_id="g1", ttft_ms=100.0, completion_tokens=3))
    store.close()
    other = sqlite3.connect(path)
    other.execute("UPDATE request SET model = CAST(X'6dff1b' AS TEXT)")
    other.commit()
    other.close()
    out, err = report(path)
    assert_clean(out)
    assert err == ""
    assert "m\ufffd\\x1b  u1 " in out.decode()


def test_printable_escapes_controls_and_nothing_else():
    from relay.report.untrusted import printable

    assert printable("plain model-7B:q4 é 模型") == "plain model-7B:q4 é 模型"
    assert printable("a\x1b[2Jb") == r"a\x1b[2Jb"
    assert printable("\x00\x07\t\n\r\x1f") == r"\x00\x07\t\n\r\x1f"
    assert printable("\x7f\x80\x85\x9b\x9f\xa0") == r"\x7f\x80\x85\x9b\x9f\xa0"
    # a backslash is doubled, so that escaped text cannot pass for an escape
    assert printable(r"C:\x1b") == r"C:\\x1b"
    # line and paragraph separators, a right-to-left override
    assert printable("\u2028\u2029\u202e") == r"\u2028\u2029\u202e"
    assert printable("") == ""


def test_postgres_rows_are_escaped_and_an_infinity_is_skipped(pg_server):
    """The shared table, in the relay's own PostgreSQL schema: a DOUBLE PRECISION column
    takes 'Infinity', which JSON has no spelling for; the row is named by its row_id. Its
    text takes no NUL."""
    import psycopg

    from relay.store import pg_sql
    from tests.support.pg_server import PASSWORD

    db = pg_server.create_db()
    ts = time.time() - 60
    rows = [
        good(ts, request_id="g1", ttft_ms=100.0, completion_tokens=50, row_id="relay-a:1"),
        good(ts, request_id="g2", ttft_ms=300.0, completion_tokens=100, row_id="relay-a:2"),
        good(
            ts,
            model=MODEL.replace("\x00", ""),
            ok=0,
            error_code=ERROR_CODE,
            completion_tokens=0,
            row_id="relay-a:3",
        ),
        good(ts, ttft_ms=math.inf, completion_tokens=7, row_id="relay-b\x1b[2J:9"),
    ]
    with psycopg.connect(pg_server.admin_url(db), autocommit=True) as conn:
        for stmt in pg_sql.SETUP:
            conn.execute(stmt)
        for row in rows:
            cols = ", ".join(row)
            conn.execute(
                f"INSERT INTO request ({cols}) VALUES ({', '.join(['%s'] * len(row))})",
                [*row.values()],
            )
    url = pg_server.url(db)
    for argv in ((), ("--json",), ("--bench", "--json"), ("--bench", "--csv")):
        out, err = report(url, *argv, password=PASSWORD)
        assert_clean(out)
        assert_clean(err.encode())
        assert err.splitlines() == [
            r"relay report: row relay-b\x1b[2J:9 skipped: ttft_ms is not a finite number"
        ]
    text = report(url, password=PASSWORD)[0].decode().splitlines()
    (total,) = [line for line in text if line.startswith("TOTAL")]
    assert total.split()[:4] == ["TOTAL", "3", "2", "1"]
    assert any(line.startswith(MODEL_SHOWN.replace(r"\x00", "")) for line in text)
    parsed = _strict_json(report(url, "--bench", "--json", password=PASSWORD)[0])
    assert (parsed["total"]["requests"], parsed["total"]["output_tokens"]) == (3, 150)


def test_checked_leaves_out_each_row_of_a_wrong_kind_naming_its_first_wrong_column():
    from decimal import Decimal

    from relay.report.untrusted import BadRow, checked

    rows = [
        {"id": 1, "model": "m", "ttft_ms": 1.5, "completion_tokens": 3},
        {"id": 2, "model": None, "ttft_ms": None, "completion_tokens": None},
        {"id": 3, "model": "m", "ttft_ms": "1.5", "completion_tokens": "3"},
        {"id": "r-4", "model": 7, "ttft_ms": 1.0, "completion_tokens": 3},
        {"id": 5, "model": "m", "ttft_ms": math.nan, "completion_tokens": 3},
        {"id": None, "model": "m", "ttft_ms": -math.inf, "completion_tokens": 3},
        {"id": 7, "model": b"m", "ttft_ms": 1.0, "completion_tokens": Decimal(3)},
        {"id": 8, "model": "m", "ttft_ms": 2.0, "completion_tokens": 4},
    ]
    good, bad = checked(rows, ("model", "ttft_ms", "completion_tokens"), "id")
    assert [r["id"] for r in good] == [1, 2, 8]
    assert bad == [
        BadRow(3, "ttft_ms"),
        BadRow("r-4", "model"),
        BadRow(5, "ttft_ms"),
        BadRow(None, "ttft_ms"),
        BadRow(7, "model"),
    ]
    assert [b.line() for b in bad[2:4]] == [
        "row 5 skipped: ttft_ms is not a finite number",
        "row without an id skipped: ttft_ms is not a finite number",
    ]
    assert bad[1].line() == "row r-4 skipped: model is not text"
    # a column not asked for is not looked at
    assert checked(rows[2:3], ("model",), "id") == (rows[2:3], [])

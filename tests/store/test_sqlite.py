import asyncio
import json
import sqlite3
import subprocess
import sys
import time

import pytest

from relay.store.schema import COLUMNS
from relay.store.sqlite import Store

DAY = 86400.0
BASE = float(int(time.time()) - 3600)  # recent: inside the default 30-day retention


def make_row(i: int, **over) -> dict:
    row = dict.fromkeys(COLUMNS) | {
        "ts": BASE + i,
        "request_id": f"req-{i}",
        "key_id": f"k{i % 3}",
        "path": "/v1/chat/completions",
        "model": "qwen",
        "stream": i % 2,
        "upstream_requested": "a",
        "upstream_served": "b",
        "fallback_attempts": i % 4,
        "status": 200,
        "ok": 1,
        "error_code": None,
        "queue_ms": i / 4,
        "ttft_ms": 10.5 + i,
        "total_ms": 100.25 + i,
        "prompt_tokens": i,
        "completion_tokens": 2 * i,
        "tokens_source": "exact" if i % 2 else "approx",
        "bytes_out": 1000 + i,
        "client_closed": 0,
        "error": None,
    }
    row.update(over)
    return row


TYPES = {
    "ts": float,
    "request_id": str,
    "key_id": str,
    "path": str,
    "model": str,
    "stream": int,
    "upstream_requested": str,
    "upstream_served": str,
    "fallback_attempts": int,
    "status": int,
    "ok": int,
    "queue_ms": float,
    "ttft_ms": float,
    "total_ms": float,
    "prompt_tokens": int,
    "completion_tokens": int,
    "tokens_source": str,
    "bytes_out": int,
    "client_closed": int,
}


def all_rows(store: Store) -> list[dict]:
    return store.query("SELECT * FROM request ORDER BY rowid")


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "relay.db")


@pytest.fixture
def fast_retry(monkeypatch):
    monkeypatch.setattr(Store, "retry_base_s", 0.01)


async def test_put_never_blocks_the_loop(db):
    store = Store(db)
    store.start()
    ticks = 0

    async def heartbeat():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)
    n, slowest, started = 20_000, 0.0, time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        store.put(make_row(i))
        slowest = max(slowest, time.perf_counter() - t0)
        if i % 500 == 499:
            await asyncio.sleep(0)  # the loop keeps serving other tasks
    elapsed = time.perf_counter() - started
    ticks_during = ticks
    beat.cancel()
    assert ticks_during >= n // 500  # heartbeat ran between every chunk of puts
    assert elapsed / n < 1e-3  # per put: far below 1 ms on average
    assert slowest < 0.5  # no put ever waited on the database
    store.flush(timeout=30)
    assert store.rows_written == n and store.pending == 0 and store.rows_dropped == 0
    assert all_rows(store) == [make_row(i) for i in range(n)]
    await store.aclose()


def test_rows_read_back_with_values_and_types(db):
    store = Store(db)
    store.start()
    rows = [make_row(i) for i in range(50)]
    for row in rows:
        store.put(row)
    store.flush()
    got = all_rows(store)
    assert got == rows
    for row in got:
        for col, value in row.items():
            if value is not None:
                assert type(value) is TYPES[col], col
    assert list(got[0]) == list(COLUMNS)
    store.close()


def test_wal_mode_and_nulls_stay_null(db):
    store = Store(db)
    store.start()
    store.put({"ts": 5.0, "request_id": "r-null"})
    store.put(
        make_row(
            1,
            ttft_ms=None,
            prompt_tokens=None,
            completion_tokens=None,
            tokens_source=None,
            ok=False,
            stream=True,
        )
    )
    store.flush()
    assert store.query("PRAGMA journal_mode") == [{"journal_mode": "wal"}]
    first, second = all_rows(store)
    assert first == dict.fromkeys(COLUMNS) | {"ts": 5.0, "request_id": "r-null"}
    kinds = store.query(
        "SELECT "
        + ", ".join(f"typeof({c}) AS {c}" for c in COLUMNS)
        + " FROM request WHERE request_id = 'req-1'"
    )[0]
    for col in ("ttft_ms", "prompt_tokens", "completion_tokens", "tokens_source", "error_code"):
        assert second[col] is None and kinds[col] == "null"
    assert (second["ok"], second["stream"]) == (0, 1)  # bools stored as INTEGER 0/1
    assert kinds["ok"] == kinds["stream"] == "integer" and kinds["ts"] == "real"
    store.close()


def test_a_table_from_before_the_error_column_gets_it(db):
    import sqlite3

    old = [c for c in COLUMNS if c != "error"]
    conn = sqlite3.connect(db)
    conn.execute(f"CREATE TABLE request ({', '.join(old)})")
    conn.execute("INSERT INTO request (ts, request_id) VALUES (1.0, 'old')")
    conn.commit()
    conn.close()
    store = Store(db, retention_days=0)
    store.start()
    store.put(
        make_row(
            1,
            ok=0,
            status=502,
            error_code="upstream_unavailable",
            error="TLS handshake failed: certificate verify failed: x",
        )
    )
    store.flush()
    got = store.query("SELECT request_id, error FROM request ORDER BY ts")
    assert got == [
        {"request_id": "old", "error": None},
        {"request_id": "req-1", "error": "TLS handshake failed: certificate verify failed: x"},
    ]
    store.close()


def test_close_flushes_pending_and_rows_survive_a_new_store(db):
    store = Store(db, flush_interval_s=60.0)  # the writer would sleep for a minute
    store.start()
    for i in range(300):
        store.put(make_row(i))
    assert store.pending == 300 and store.rows_written == 0
    store.close()
    store.close()  # idempotent
    assert store.rows_written == 300 and store.pending == 0

    again = Store(db)
    again.start()
    assert again.query("SELECT COUNT(*) AS n FROM request") == [{"n": 300}]
    again.put(make_row(300))
    again.close()
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM request").fetchone() == (301,)


def test_put_after_close_is_counted_as_dropped(db):
    store = Store(db)
    store.start()
    store.close()
    store.put(make_row(1))
    assert store.rows_dropped == 1 and store.pending == 0


def test_overflow_keeps_every_row_in_order(db):
    store = Store(db, queue_max=10, batch_max=10_000, flush_interval_s=60.0)
    store.start()
    for i in range(5000):
        store.put(make_row(i))
    assert len(store._queue) == 10 and len(store._overflow) == 4990
    assert store.pending == 5000 and store.rows_dropped == 0
    store.flush(timeout=30)
    ids = [r["request_id"] for r in store.query("SELECT request_id FROM request ORDER BY rowid")]
    assert ids == [f"req-{i}" for i in range(5000)]
    assert store.rows_written == 5000 and store.rows_dropped == 0
    store.close()


def test_drop_beyond_overflow_is_counted_exactly(db, capsys):
    store = Store(db, queue_max=10, batch_max=10_000, flush_interval_s=60.0, overflow_max=100)
    store.start()
    for i in range(200):
        store.put(make_row(i))
    assert store.rows_dropped == 90 and store.pending == 110
    store.close()
    assert store.rows_written == 110 and store.rows_dropped == 90
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM request").fetchone() == (110,)
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "dropping" in ln]
    assert len(warnings) == 1  # at most one warning per 10 s
    warning = json.loads(warnings[0])  # a JSON log line like every other
    assert warning["event"] == "store_warning" and warning["kind"] == "drop"


def test_prune_at_start_deletes_only_old_rows(db):
    now = time.time()
    keep_all = Store(db, retention_days=0)
    keep_all.start()
    for i, age in enumerate((40 * DAY, 31 * DAY, 29 * DAY, 60.0)):
        keep_all.put(make_row(i, ts=now - age))
    keep_all.close()

    store = Store(db, retention_days=30)
    store.start()
    assert store.rows_pruned == 2
    assert [r["request_id"] for r in all_rows(store)] == ["req-2", "req-3"]
    store.close()


def test_periodic_prune(db):
    now = time.time()
    store = Store(db, retention_days=1, flush_interval_s=0.01, prune_interval_s=0.05)
    store.start()
    store.put(make_row(0, ts=now - 2 * DAY))
    store.put(make_row(1, ts=now))
    store.flush()
    deadline = time.monotonic() + 5
    while store.rows_pruned < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.rows_pruned == 1
    assert [r["request_id"] for r in all_rows(store)] == ["req-1"]
    store.close()


def test_usage_since(db):
    store = Store(db)
    store.start()
    store.put(make_row(0, key_id="a", ts=100.0, prompt_tokens=10, completion_tokens=5))
    store.put(make_row(1, key_id="a", ts=200.0, prompt_tokens=None, completion_tokens=7))
    store.put(make_row(2, key_id="a", ts=300.0, prompt_tokens=3, completion_tokens=None))
    store.put(make_row(3, key_id="a", ts=400.0, prompt_tokens=None, completion_tokens=None))
    store.put(make_row(4, key_id="b", ts=300.0, prompt_tokens=1000, completion_tokens=1000))
    store.put(make_row(5, key_id=None, ts=300.0, prompt_tokens=1, completion_tokens=2))
    store.flush()
    assert store.usage_since("a", 0.0) == (4, 25)
    assert store.usage_since("a", 200.0) == (3, 10)
    assert store.usage_since("a", 500.0) == (0, 0)
    assert store.usage_since("b", 0.0) == (1, 2000)
    assert store.usage_since(None, 0.0) == (1, 3)
    store.close()


def test_memory_store(fast_retry):
    store = Store(":memory:")
    store.start()
    for i in range(20):
        store.put(make_row(i, key_id="m", prompt_tokens=1, completion_tokens=2))
    store.flush()
    assert store.query("SELECT COUNT(*) AS n FROM request") == [{"n": 20}]
    assert store.usage_since("m", 0.0) == (20, 60)
    assert all_rows(store)[3] == make_row(3, key_id="m", prompt_tokens=1, completion_tokens=2)
    store.close()
    with pytest.raises(RuntimeError):
        store.query("SELECT 1")


def test_writer_error_is_retried_without_losing_or_doubling_rows(db, fast_retry, monkeypatch):
    failures = []
    real_insert = Store._insert

    def flaky_insert(self, conn, rows):
        real_insert(self, conn, rows)  # written, then the commit fails: rolled back
        if len(failures) < 2:
            failures.append(len(rows))
            raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(Store, "_insert", flaky_insert)
    store = Store(db)
    store.start()
    for i in range(10):
        store.put(make_row(i))
    store.flush()
    assert failures == [10, 10]
    assert store.write_errors == 2 and store.rows_written == 10 and store.rows_dropped == 0
    assert store._thread.is_alive()
    assert [r["request_id"] for r in all_rows(store)] == [f"req-{i}" for i in range(10)]
    store.close()


def test_close_gives_up_on_a_dead_database(db, fast_retry, monkeypatch):
    def broken(self, conn, rows):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(Store, "_insert", broken)
    store = Store(db)
    store.start()
    for i in range(7):
        store.put(make_row(i))
    with pytest.raises(TimeoutError):
        store.flush(timeout=0.1)
    store.close(timeout=0.2)
    assert not store._thread.is_alive()
    assert store.rows_dropped == 7 and store.rows_written == 0 and store.write_errors >= 2


def test_start_reports_an_unopenable_path(tmp_path):
    store = Store(str(tmp_path / "missing-dir" / "relay.db"))
    with pytest.raises(sqlite3.OperationalError):
        store.start()
    store.close()


def test_interpreter_exit_without_close_still_writes_rows(db):
    script = (
        "import sys; from relay.store.sqlite import Store\n"
        "s = Store(sys.argv[1], flush_interval_s=60.0); s.start()\n"
        "for i in range(1000): s.put({'ts': 1e9 + i, 'request_id': str(i)})\n"
    )
    done = subprocess.run([sys.executable, "-c", script, db], timeout=30)
    assert done.returncode == 0
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM request").fetchone() == (1000,)


def test_admission_ids_do_not_restart_per_process(tmp_path):
    """Two processes (two stores) never hand out the same admission ids: a random 31-bit
    prefix per store above a counter, within SQLite's 63-bit INTEGER PRIMARY KEY."""
    firsts = [Store(str(tmp_path / "a.db")).next_admission_id() for _ in range(8)]
    assert len(set(firsts)) == 8
    assert all(0 < i < 1 << 63 for i in firsts)
    store = Store(str(tmp_path / "a.db"))
    ids = [store.next_admission_id() for _ in range(3)]
    assert ids == [ids[0], ids[0] + 1, ids[0] + 2]


def test_a_row_binds_plain_values_only():
    import enum

    from relay.store.schema import clean

    class Level(enum.IntEnum):
        HIGH = 2

    class Word(enum.StrEnum):
        DONE = "done"

    row = clean((True, False, Level.HIGH, 1.5, Word.DONE, "s", b"b", None, 7, object), 1.0)
    # Exactly the plain types sqlite3 binds without looking for an adapter.
    assert [type(v) for v in row] == [int, int, int, float, str, str, bytes, type(None), int, str]
    assert row[:5] == (1, 0, 2, 1.5, "done")

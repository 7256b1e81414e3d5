"""The pure parts of the PostgreSQL store: spill file framing, the reservation's answer,
the `[store]` rules (url or path, never a password in the file), the SQL spelling."""

import json
import os
import subprocess
import sys
import zlib

import pytest

from relay.config import (
    ConfigError,
    KeyConfig,
    PgUrlError,
    check_pg_url,
    is_pg_url,
    parse_config,
    pg_connect_kwargs,
)
from relay.observe.metrics import Registry
from relay.observe.record import Record
from relay.policy.budget import BudgetExceeded, Budgets, window_bounds
from relay.store import spill
from relay.store.pg_budget import decision, reserve_params
from relay.store.pg_sql import portable
from tests.support.need import need_extra

ROWS = [(1.5, "rid-1", None, "/v1/x", 0, "a-1"), (2.0, "rid-2", "k", "/v1/y", 1, "a-2")]


# ---- spill framing ----------------------------------------------------------------------
def test_spill_lines_round_trip_exactly():
    data = spill.encode(ROWS)
    assert data.count(b"\n") == 2
    crc, _, payload = data.splitlines()[0].partition(b" ")
    assert int(crc, 16) == zlib.crc32(payload) and payload == b'[1.5,"rid-1",null,"/v1/x",0,"a-1"]'
    assert spill.decode(data) == (ROWS, len(data), 0)


def test_a_torn_last_line_is_not_a_row_nor_part_of_the_prefix():
    whole = spill.encode(ROWS)
    for cut in range(1, len(spill.encode(ROWS[1:]))):
        rows, good, bad = spill.decode(whole[:-cut])
        assert (rows, good, bad) == (ROWS[:1], len(spill.encode(ROWS[:1])), 0)


def test_a_damaged_complete_line_is_skipped_and_counted():
    lines = spill.encode(ROWS).splitlines(keepends=True)
    damaged = lines[0].replace(b"rid-1", b"rid-X")  # checksum no longer matches
    data = damaged + b"not a line\n" + lines[1]
    assert spill.decode(data) == ([ROWS[1]], len(data), 2)


def test_spill_file_cuts_its_torn_tail_at_open_then_appends_whole_lines(tmp_path):
    path = str(tmp_path / "spill.jsonl")
    with open(path, "wb") as fh:
        fh.write(spill.encode(ROWS[:1]) + spill.encode(ROWS[1:])[:9])  # a crash mid-append
    s = spill.Spill(path)
    assert s.open() == ROWS[:1] and s.count == 1
    assert os.path.getsize(path) == len(spill.encode(ROWS[:1]))
    s.append(ROWS[1:])
    assert s.read() == ROWS and s.count == 2
    with pytest.raises(spill.SpillLocked):  # one relay per spill file
        spill.Spill(path).open()
    s.clear()
    assert s.read() == [] and s.count == 0 and os.path.getsize(path) == 0
    s.close()
    assert spill.Spill(path).open() == []  # the lock went with the close


# ---- the reservation's answer ---------------------------------------------------------------
def _reservation(now: float, **limits):
    b = Budgets([KeyConfig(id="k", sha256="0" * 64, **limits)])
    return b.reserve("k", 7, now)


def test_decision_none_is_admitted_and_a_named_window_is_the_local_refusal():
    now = 1_700_000_000.0
    res = _reservation(now, requests_per_day=10, tokens_per_month=500)
    assert decision(None, res, now) is None
    exc = decision("daily_requests 10", res, now)
    assert isinstance(exc, BudgetExceeded)
    assert (exc.limit, exc.used, exc.requested, exc.limit_value, exc.resets_at) == (
        "daily_requests",
        10,
        1,
        10,
        window_bounds("daily", now)[1],
    )
    # What the request would reserve: the 7 tokens of its local reservation.
    exc = decision("monthly_tokens 498", res, now)
    assert (exc.limit, exc.used, exc.requested, exc.limit_value, exc.resets_at) == (
        "monthly_tokens",
        498,
        7,
        500,
        window_bounds("monthly", now)[1],
    )
    assert str(exc) == "monthly_tokens budget exceeded: 498 used + 7 requested > 500"
    with pytest.raises(ValueError):
        decision("weekly_requests 1", res, now)


def test_reserve_params_carry_every_window_of_the_request():
    now = 1_700_000_000.0
    res = _reservation(now, requests_per_day=10, tokens_per_month=500)
    rec = Record(
        ts=now,
        request_id="r1",
        path="/v1/chat/completions",
        key_id="k",
        model="m",
        stream=True,
        upstream_requested="llm",
    )
    p = reserve_params("lease-1", "relay-a", 30.0, res, rec, 3, 4)
    assert p[:5] == ("lease-1", "relay-a", "k", 7, 30.0)
    assert p[5:13] == (now, "r1", "/v1/chat/completions", "m", 1, "llm", 3, 4)
    assert p[13:] == (
        ["daily", "monthly"],
        [window_bounds("daily", now)[0], window_bounds("monthly", now)[0]],
        [10, 0],
        [0, 500],
    )


# ---- [store] rules --------------------------------------------------------------------------
UP = [{"name": "a", "url": "http://127.0.0.1:9"}]


def _store(**store):
    return parse_config({"upstream": UP, "store": store}).store


def test_url_is_the_alternative_to_path():
    s = _store(
        url="postgresql://relay@db.internal:5432/relay",
        password_env="RELAY_PG_PW",
        reservation_ttl_s=5,
    )
    assert (s.url, s.password_env, s.reservation_ttl_s) == (
        "postgresql://relay@db.internal:5432/relay",
        "RELAY_PG_PW",
        5,
    )
    with pytest.raises(ConfigError, match=r"either path .* or url"):
        _store(url="postgresql://relay@h/db", path="relay.db")
    for name, value in (("password_env", "X"), ("spill_path", "s"), ("reservation_ttl_s", 2)):
        with pytest.raises(ConfigError, match=f"store.{name}: applies to store.url"):
            _store(**{name: value})


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://relay:hunter2@h/db",
        "postgres://u:@h/db",
        "postgresql://u@h/db?sslmode=require&password=hunter2",
    ],
)
def test_a_password_in_the_url_is_refused_without_echoing_it(url):
    with pytest.raises(ConfigError) as info:
        _store(url=url)
    assert "password" in str(info.value) and "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "url,why",
    [("mysql://u@h/db", "postgresql://"), ("postgresql://u@h:notaport/db", "not a valid URL")],
)
def test_a_url_that_is_not_postgresql_is_refused(url, why):
    with pytest.raises(ConfigError, match=why):
        _store(url=url)


def test_password_env_must_name_a_variable_and_be_set():
    with pytest.raises(ConfigError, match=r"store.password_env"):
        _store(url="postgresql://u@h/db", password_env="not a name")
    assert pg_connect_kwargs("postgresql://u@h/db", "PW", {"PW": "s3"}) == {
        "conninfo": "postgresql://u@h/db",
        "password": "s3",
    }
    assert pg_connect_kwargs("postgresql://u@h/db", None, {}) == {"conninfo": "postgresql://u@h/db"}
    with pytest.raises(KeyError):
        pg_connect_kwargs("postgresql://u@h/db", "PW", {})


def test_a_relay_whose_password_variable_is_unset_does_not_start(monkeypatch):
    from relay.app import make_store

    need_extra("postgres", "psycopg")

    monkeypatch.delenv("RELAY_UNSET_PW", raising=False)
    cfg = parse_config(
        {"upstream": UP, "store": {"url": "postgresql://u@h/db", "password_env": "RELAY_UNSET_PW"}}
    )
    with pytest.raises(ConfigError, match="RELAY_UNSET_PW is not set"):
        make_store(cfg, None)


BLOCK_PSYCOPG = """
import importlib.abc, sys
class NoDriver(importlib.abc.MetaPathFinder):  # as if the postgres extra were not installed
    def find_spec(self, name, path=None, target=None):
        if name == "psycopg" or name.startswith("psycopg."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoDriver())
from relay.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_relay_without_the_driver_does_not_start_and_names_the_extra(tmp_path):
    conf = tmp_path / "relay.toml"
    conf.write_text(
        '[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:9"\n'
        '[store]\nurl = "postgresql://u@127.0.0.1:1/x"\n'
    )
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_PSYCOPG, "serve", "--config", str(conf), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    [line] = [json.loads(x) for x in done.stderr.splitlines() if "relay_start_failed" in x]
    # (Named as every config error is: the file, then the key.)
    assert line["error"].startswith(f"{conf}: store.url: PostgreSQL needs the 'postgres' extra")
    assert "pip install -e '.[postgres]'" in line["error"] and "Traceback" not in done.stderr


def test_is_pg_url_and_check_pg_url():
    assert (
        is_pg_url("postgresql://h/db") and is_pg_url("POSTGRES://h") and not is_pg_url("relay.db")
    )
    assert not is_pg_url("/var/lib/postgresql://x") and not is_pg_url(None)
    check_pg_url("postgresql:///relay?host=/run/postgresql")  # a unix socket, libpq's way
    with pytest.raises(PgUrlError):
        check_pg_url("relay.db")


def test_portable_sql_spells_sqlite_placeholders_for_postgresql():
    assert (
        portable("SELECT n FROM request WHERE key_id IS ? AND ts >= ?")
        == "SELECT n FROM request WHERE key_id IS NOT DISTINCT FROM %s AND ts >= %s"
    )


def test_pending_and_spilled_rows_are_metrics_of_a_shared_store_only():
    reg = Registry()
    assert b"relay_rows_spilled" not in reg.prometheus(0.0)  # SQLite: as before
    reg.rows_pending, reg.rows_spilled = 3, 12
    text = reg.prometheus(0.0).decode()
    assert "relay_rows_pending 3\n" in text and "relay_rows_spilled 12\n" in text

"""The `request` table: one row per request, its columns in order, and a row as stored.

The same columns in SQLite (`store.sqlite`) and PostgreSQL (`store.pg_sql`, which adds its
own); a row is written straight off the request's `Record` (`observe.record`): one C call
reads its columns in this order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, cast

from relay.observe.record import Record

# The columns as (column, SQLite type), in the table's order.
COLUMN_TYPES: tuple[tuple[str, str], ...] = (
    ("ts", "REAL"),
    ("request_id", "TEXT"),
    ("key_id", "TEXT"),
    ("path", "TEXT"),
    ("model", "TEXT"),
    ("stream", "INTEGER"),
    ("upstream_requested", "TEXT"),
    ("upstream_served", "TEXT"),
    ("fallback_attempts", "INTEGER"),
    ("status", "INTEGER"),
    ("ok", "INTEGER"),
    ("error_code", "TEXT"),
    ("queue_ms", "REAL"),
    ("ttft_ms", "REAL"),
    ("total_ms", "REAL"),
    ("prompt_tokens", "INTEGER"),
    ("completion_tokens", "INTEGER"),
    ("tokens_source", "TEXT"),
    ("bytes_out", "INTEGER"),
    ("client_closed", "INTEGER"),
    ("error", "TEXT"),
)
# Columns added after the first schema: databases of an older relay gain them at start
# (`store.migrate`; `error` came with TLS upstreams, then the benchmark timings, then the
# fleet's pool and prompt-cache figure).
ADDED = (
    ("first_byte_ms", "REAL"),
    ("e2e_ms", "REAL"),
    ("tpot_ms", "REAL"),
    ("itl_p50_ms", "REAL"),
    ("itl_p99_ms", "REAL"),
    ("itl_max_ms", "REAL"),
    ("itl_hist", "TEXT"),
    ("prompt_ms", "REAL"),
    ("prompt_per_second", "REAL"),
    ("predicted_per_second", "REAL"),
    ("method", "TEXT"),
    ("last_content_ms", "REAL"),
    ("pool", "TEXT"),
    ("cached_tokens", "INTEGER"),
    ("queue_position", "INTEGER"),
)
COLUMN_TYPES += ADDED
COLUMNS = tuple(c for c, _ in COLUMN_TYPES)
TYPES = tuple(t for _, t in COLUMN_TYPES)
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS request (" + ", ".join(f"{c} {t}" for c, t in COLUMN_TYPES) + ")",
    "CREATE INDEX IF NOT EXISTS request_ts ON request (ts)",
    "CREATE INDEX IF NOT EXISTS request_key_ts ON request (key_id, ts)",
)
INSERT = f"INSERT INTO request ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)})"

# A column's value as either engine takes it.
Value = int | float | str | bytes | None
# A row as stored: its values in the order of COLUMNS (PostgreSQL's then its row id).
Row = tuple[Value, ...]
# A row read back (a query's, a report's): a column's value is of whatever type the engine
# gives for it (SQLite's int, float, str, bytes or None; PostgreSQL's Decimal for a sum too).
DbRow = dict[str, Any]
# A query's parameters, in the order of its placeholders.
Params = Sequence[object]
# A Record's columns, in order, as they are taken (`clean` makes them storable).
record_values: Callable[[Record], tuple[object, ...]] = attrgetter(*COLUMNS)
_TS = COLUMNS.index("ts")
_PLAIN = (type(None), int, float, str, bytes)


def clean(values: tuple[object, ...], now: float) -> Row:
    """Make a snapshot insertable: a value of a plain type goes as it is, one of a subclass of
    int or float (a bool: 0/1) as that plain type, any other as str; ts defaults to now.
    sqlite3 would bind an int subclass as it is, but only after looking for an adapter on
    its type and a `__conform__` on it, each a formatted AttributeError cleared (some 2,000
    instructions a bool column). `type(v) in _PLAIN` is what mypy does not read as a
    narrowing."""
    out = cast("list[Value]", [v if type(v) in _PLAIN else _plain(v) for v in values])
    if out[_TS] is None:
        out[_TS] = now
    return tuple(out)


def _plain(v: object) -> Value:
    """A value of no plain type as the plain one it stands for."""
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    return str(v)

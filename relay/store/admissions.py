"""Durable admissions: a keyed request is on disk before its upstream is contacted.

A budget is only as good as the record of what was spent. Request rows are written in
batches (a crash loses the last batch), so for a key with limits the relay first commits an
admission record - what the request was and the tokens it reserved - and only then contacts
the upstream. The request's row later replaces it in one transaction. An admission still
there at start means the relay died mid-request: it becomes a request row with error code
`relay_crashed`, counted against the key with its reserved tokens (the most it could have
used), so a restart never gives a key back what it spent.
"""

from __future__ import annotations

import sqlite3

from relay.observe.record import CRASHED, RESERVED, Record
from relay.stream.usage import MAX_TOKENS

# An admission record's id: a number in SQLite; PostgreSQL's are the relay's id and a counter.
AdmissionId = int | str
# An admission record as stored, in the order of FIELDS.
AdmissionValues = tuple[
    AdmissionId, float, str, str | None, str, str | None, int, str | None, int, int
]

FIELDS = (
    "id",
    "ts",
    "request_id",
    "key_id",
    "path",
    "model",
    "stream",
    "upstream_requested",
    "prompt_tokens",
    "completion_tokens",
)
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS admission (id INTEGER PRIMARY KEY, ts REAL, request_id TEXT,"
    " key_id TEXT, path TEXT, model TEXT, stream INTEGER, upstream_requested TEXT,"
    " prompt_tokens INTEGER, completion_tokens INTEGER)",
)
INSERT = f"INSERT INTO admission ({', '.join(FIELDS)}) VALUES ({', '.join('?' for _ in FIELDS)})"
DELETE = "DELETE FROM admission WHERE id = ?"
# What a budget charges: requests an upstream served, and requests cut by a crash.
CHARGED = f"(upstream_served IS NOT NULL OR error_code = '{CRASHED}')"


def _bounded(column: str) -> str:
    return (
        f"CASE WHEN {column} > {MAX_TOKENS} THEN {MAX_TOKENS}"
        f" WHEN {column} >= 0 THEN CAST({column} AS BIGINT) ELSE 0 END"
    )


# A row's tokens, as a budget counts them on SQLite and PostgreSQL: each figure clamped to a
# plausible count, 0 to stream.usage MAX_TOKENS. A relay never stores one outside it from the
# upstream (stream.usage), but an older one did (negative, beyond any count, on SQLite a REAL
# or a string too): such a row never fails the sum (64 bits hold it) nor gives a key back
# tokens. NULL counts 0.
TOKENS = f"({_bounded('prompt_tokens')} + {_bounded('completion_tokens')})"


_RECOVER = (
    "INSERT INTO request (ts, request_id, key_id, path, model, stream, upstream_requested,"
    " fallback_attempts, ok, error_code, prompt_tokens, completion_tokens, tokens_source,"
    " bytes_out, client_closed)"
    f" SELECT ts, request_id, key_id, path, model, stream, upstream_requested, 0, 0,"
    f" '{CRASHED}', prompt_tokens, completion_tokens, '{RESERVED}', 0, 0"
    " FROM admission ORDER BY id"
)


def values(
    admission_id: AdmissionId, rec: Record, prompt_tokens: int, completion_tokens: int
) -> AdmissionValues:
    """The admission record of a request."""
    return (
        admission_id,
        rec.ts,
        rec.request_id,
        rec.key_id,
        rec.path,
        rec.model,
        int(rec.stream),
        rec.upstream_requested,
        prompt_tokens,
        completion_tokens,
    )


def insert(conn: sqlite3.Connection, records: list[AdmissionValues]) -> None:
    """Commit admission records (one transaction for all that are waiting)."""
    conn.execute("BEGIN")
    try:
        conn.executemany(INSERT, records)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def recover(conn: sqlite3.Connection) -> int:
    """Turn leftover admissions into `relay_crashed` request rows; how many there were."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        row = conn.execute("SELECT COUNT(*) AS n FROM admission").fetchone()
        n: int = row["n"] if isinstance(row, dict) else row[0]
        if n:
            conn.execute(_RECOVER)
            conn.execute("DELETE FROM admission")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return n

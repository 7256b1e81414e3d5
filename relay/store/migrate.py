"""Bring a request table written by an older relay up to the current columns.

A database created before a column existed keeps its rows: each missing column is added with
`ALTER TABLE ... ADD COLUMN` (old rows read NULL there), in one transaction at start. Columns
are only ever added, never renamed or dropped, so this is the whole migration story.
"""

from __future__ import annotations

import sqlite3


def add_missing_columns(
    conn: sqlite3.Connection, table: str, columns: tuple[tuple[str, str], ...]
) -> list[str]:
    """Add every (name, type) of `columns` the table lacks; the names added, in order."""
    have = {
        row[1] if isinstance(row, tuple) else row["name"]
        for row in conn.execute(f"PRAGMA table_info({table})").fetchall()
    }
    missing = [(c, t) for c, t in columns if c not in have]
    if not missing:
        return []
    conn.execute("BEGIN")
    try:
        for c, t in missing:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {c} {t}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return [c for c, _ in missing]

"""How a key's budget pre-flight on PostgreSQL grows with the rows its window holds.

    python -m bench.pg_reserve_scale [--rows 0,10000,100000,1000000] [--calls 50]

A throwaway PostgreSQL (tests/support/pg_server.py; fsync on), the relay's schema, then for each count
one key's rows spread over today (UTC), and the p50 of: the window's usage read the way
relay_reserve read it before usage_day (a sum over the key's rows since midnight), read off
usage_day (`relay_used`), and a whole `relay_reserve` (lock, expiry, usage, lease). Rows are
loaded with no trigger and usage_day filled from them once (`pg_sql.USAGE_DAY_TABLE`, as a
database made before usage_day gets it), to keep the set-up short.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.store import pg_sql
from tests.support.pg_server import PgServer, find_bin


def _p50(conn, sql: str, params, calls: int, after=None) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        conn.execute(sql, params() if callable(params) else params).fetchall()
        times.append((time.perf_counter() - t) * 1000.0)
        if after:
            conn.execute(after)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="0,10000,100000,1000000")
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    import psycopg

    server = PgServer(find_bin(), fsync=True)
    server.init()
    try:
        db = server.create_db()
        with psycopg.connect(server.admin_url(db), autocommit=True) as c:
            with c.transaction():
                for stmt in pg_sql.SETUP:
                    c.execute(stmt)
            now = time.time()
            day0 = now - now % 86400
            have = 0
            print("| rows in the key's day | sum over rows ms | usage_day ms | relay_reserve ms |")
            print("|---|---|---|---|")
            for n in (int(x) for x in args.rows.split(",")):
                # (as a database made before usage_day: rows without the trigger, then the
                # table filled from them once and the trigger made, as a relay's start does)
                c.execute("DROP TRIGGER relay_usage_day ON request")
                c.execute("DROP TABLE usage_day")
                c.execute(
                    "INSERT INTO request (ts, key_id, ok, upstream_served, prompt_tokens,"
                    " completion_tokens, row_id) SELECT %s + random() * %s, 'k', 1, 'u',"
                    " 10, 20, md5(random()::text) FROM generate_series(1, %s)",
                    (day0, now - day0, n - have),
                )
                c.execute(pg_sql.USAGE_DAY_TABLE)
                c.execute("VACUUM ANALYZE request")
                have = n
                rows = _p50(c, pg_sql.USED_BY_ROWS, ("k", day0), args.calls)
                days = _p50(c, "SELECT * FROM relay_used(%s, %s)", ("k", day0), args.calls)
                res = _p50(
                    c,
                    pg_sql.RESERVE,
                    lambda: (
                        uuid.uuid4().hex,
                        "r1",
                        "k",
                        100,
                        30.0,
                        now,
                        "x",
                        "/v1/chat/completions",
                        "m",
                        1,
                        "u",
                        0,
                        0,
                        ["day"],
                        [day0],
                        [10**9],
                        [10**12],
                    ),
                    args.calls,
                    after="DELETE FROM reservation",
                )
                print(f"| {n} | {rows:.2f} | {days:.2f} | {res:.2f} |", flush=True)
    finally:
        server.destroy()


if __name__ == "__main__":
    main()

"""usage_day on a real PostgreSQL (relay/store/pg_sql.py): a key's charged requests and tokens per
UTC day, kept by a trigger on `request`, must always be what summing its rows gives - after
rows come in batches, come twice, replace a crash placeholder, come from an expired lease, or
are pruned - for every window start (UTC midnights, and a start inside a day); a database
made before the table gets it from its rows once; two relays writing batches of the same keys
at once never deadlock on it."""

import random
import threading
import time
import types

import pytest

from relay.policy.budget import window_bounds
from relay.store import pg_sql
from tests.support.need import need_extra

# relay.store.postgres imports psycopg: without the postgres extra the module skips, naming it
store_pg = need_extra("postgres", "relay.store.postgres")

# What a budget charges, written out here (docs/budgets.md "What is charged"), not taken from
# relay.store: a request an upstream served, or one a crash cut (`relay_crashed`); its tokens
# are its prompt and completion tokens.
CRASHED = "relay_crashed"
CHARGED = f"(upstream_served IS NOT NULL OR error_code = '{CRASHED}')"
N = f"CASE WHEN {CHARGED} THEN 1 ELSE 0 END"
T = (
    f"CASE WHEN {CHARGED} THEN coalesce(prompt_tokens, 0) + coalesce(completion_tokens, 0)"
    " ELSE 0 END"
)
BY_DAY = (
    f"SELECT key_id, floor(ts / 86400) * 86400 AS day, sum({N}), sum({T})"
    " FROM request WHERE key_id IS NOT NULL AND ts IS NOT NULL GROUP BY 1, 2"
)
USED_SINCE = (  # a key's charged requests and tokens since a moment, summed over its rows
    f"SELECT coalesce(sum({N}), 0), coalesce(sum({T}), 0) FROM request"
    " WHERE key_id = %s AND ts >= %s"
)
KEYS = ("a", "b", "c")


def _row(**kw) -> tuple:
    vals = dict.fromkeys(pg_sql.ROW_COLUMNS)
    vals.update(kw)
    return tuple(vals[c] for c in pg_sql.ROW_COLUMNS)


@pytest.fixture
def conn(pg_server):
    import psycopg

    name = pg_server.create_db()
    with psycopg.connect(pg_server.admin_url(name), autocommit=True) as c:
        with c.transaction():
            for stmt in pg_sql.SETUP:
                c.execute(stmt)
        yield c


def _starts(now: float) -> list[float]:
    day = window_bounds("day", now)[0]
    return [day, day - 86400, window_bounds("month", now)[0], now - 12345.5, day - 3.5 * 86400, 0.0]


def _check(conn, now: float) -> None:
    days = {
        (k, d): (n, t)
        for k, d, n, t in conn.execute(
            "SELECT key_id, day, n, t FROM usage_day WHERE n <> 0 OR t <> 0"
        ).fetchall()
    }
    assert days == {(k, d): (n, t) for k, d, n, t in conn.execute(BY_DAY).fetchall() if n or t}
    for key in KEYS:
        for start in _starts(now):
            used = conn.execute("SELECT n, t FROM relay_used(%s, %s)", (key, start)).fetchone()
            rows = conn.execute(USED_SINCE, (key, start)).fetchone()
            assert used == rows, (key, start)


def _random_row(rng: random.Random, now: float, row_id: str) -> tuple:
    served = rng.random() < 0.7
    error_code = None if served else rng.choice(["upstream_error", CRASHED])
    prompt = rng.choice([None, rng.randint(0, 50)])
    completion = rng.choice([None, rng.randint(0, 500)])
    if not served and error_code != CRASHED:  # as the relay writes a row no upstream served:
        prompt = completion = None  # no token figures (docs/budgets.md: not charged)
    return _row(
        ts=now - rng.random() * 40 * 86400,
        request_id=row_id,
        key_id=rng.choice(KEYS + (None,)),
        path="/v1/chat/completions",
        ok=int(served),
        upstream_served="u" if served else None,
        error_code=error_code,
        prompt_tokens=prompt,
        completion_tokens=completion,
        row_id=row_id,
    )


DAY = 1_700_006_400.0  # a UTC midnight (19676 * 86400)


def test_a_keys_usage_is_its_charged_requests_and_their_tokens(conn):
    """A few rows, the usage they give written out by hand."""

    def row(rid, ts, key, served=None, error=None, prompt=None, completion=None):
        return _row(
            ts=ts,
            request_id=rid,
            key_id=key,
            path="/v1/chat/completions",
            ok=int(served is not None and error is None),
            upstream_served=served,
            error_code=error,
            prompt_tokens=prompt,
            completion_tokens=completion,
            row_id=rid,
        )

    rows = [
        row("a1", DAY + 10, "a", served="u", prompt=3, completion=4),
        row("a2", DAY + 20, "a", served="u", error="upstream_500", prompt=5),  # served: charged
        row("a3", DAY + 30, "a", error="relay_crashed", prompt=1, completion=20),
        row("a4", DAY + 40, "a", error="budget_exceeded"),  # refused by the relay: not charged
        row("a5", DAY + 50, "a", error="upstream_unavailable"),  # no upstream answered
        row("a6", DAY - 100, "a", served="u", prompt=7, completion=7),  # the day before
        row("b1", DAY + 60, "b", served="u", prompt=2, completion=2),
        row("n1", DAY + 70, None, served="u", prompt=9, completion=9),  # no key: no budget
    ]
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(pg_sql.INSERT, rows)

    def used(key, start):
        return tuple(conn.execute("SELECT n, t FROM relay_used(%s, %s)", (key, start)).fetchone())

    assert used("a", DAY) == (3, 33)  # a1 3 + 4, a2 5, a3 1 + 20
    assert used("a", DAY - 86400) == (4, 47)  # and a6 7 + 7
    assert used("a", DAY + 25) == (1, 21)  # a start inside the day: a3 alone
    assert used("a", DAY + 86400) == (0, 0)
    assert used("b", DAY) == (1, 4)
    assert used("c", DAY) == (0, 0)
    days = conn.execute("SELECT key_id, day, n, t FROM usage_day ORDER BY key_id, day").fetchall()
    assert [(k, float(d), n, t) for k, d, n, t in days] == [
        ("a", DAY - 86400, 1, 14),
        ("a", DAY, 3, 33),
        ("b", DAY, 1, 4),
    ]


def test_usage_day_is_the_sum_of_the_rows_whatever_happens_to_them(conn):
    rng = random.Random(1201)
    now = time.time()
    ids: list[str] = []
    for step in range(30):
        op = step % 5
        if op in (0, 1):  # a batch, as the writer commits it
            batch = []
            for _ in range(rng.randint(1, 40)):
                ids.append(f"r{len(ids)}")
                batch.append(_random_row(rng, now, ids[-1]))
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(pg_sql.INSERT, batch)
        elif op == 2:  # rows again (a spill replayed; a crash placeholder replaced by its row)
            again = [_random_row(rng, now, rid) for rid in rng.sample(ids, min(15, len(ids)))]
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(pg_sql.INSERT, again)
        elif op == 3:  # leases of a dead relay expire into relay_crashed rows
            for i in range(rng.randint(1, 5)):
                lid = f"lease{step}-{i}"
                conn.execute(
                    "INSERT INTO reservation (id, relay_id, key_id, expires, tokens, ts,"
                    " request_id, path, prompt_tokens, completion_tokens) VALUES (%s, 'dead',"
                    " %s, 0, 0, %s, %s, '/v1/completions', %s, %s)",
                    (
                        lid,
                        rng.choice(KEYS),
                        now - rng.random() * 3 * 86400,
                        lid,
                        rng.randint(0, 9),
                        rng.randint(0, 99),
                    ),
                )
                ids.append(lid)
            conn.execute(pg_sql.EXPIRE_ALL)
        else:  # the oldest rows pruned
            conn.execute(pg_sql.PRUNE, (now - (38 - step // 5) * 86400,))
        _check(conn, now)
    crashed = conn.execute(
        "SELECT count(*) FROM request WHERE error_code = %s", (CRASHED,)
    ).fetchone()[0]
    replaced = conn.execute(
        "SELECT count(*) FROM request WHERE request_id LIKE 'lease%%'"
        " AND error_code IS DISTINCT FROM %s",
        (CRASHED,),
    ).fetchone()[0]
    assert crashed > 0 and conn.execute("SELECT count(*) FROM request").fetchone()[0] > 100
    assert replaced > 0  # (placeholders replaced by their rows: the UPDATE path)


def test_a_database_made_before_usage_day_gets_it_from_its_rows_once(pg_server):
    import psycopg

    name = pg_server.create_db()
    rng = random.Random(7)
    now = time.time()
    with psycopg.connect(pg_server.admin_url(name), autocommit=True) as c:
        for stmt in pg_sql.SCHEMA:  # what a relay before usage_day made
            c.execute(stmt)
        rows = [_random_row(rng, now, f"old{i}") for i in range(300)]
        with c.transaction(), c.cursor() as cur:
            cur.executemany(pg_sql.INSERT, rows)
        for _ in range(2):  # two starts: the second finds the table and fills nothing again
            with c.transaction():
                for stmt in pg_sql.SETUP:
                    c.execute(stmt)
            _check(c, now)
        with c.transaction(), c.cursor() as cur:  # rows after it: the trigger's
            cur.executemany(pg_sql.INSERT, [_random_row(rng, now, f"new{i}") for i in range(50)])
        _check(c, now)
        assert c.execute("SELECT count(*) FROM usage_day").fetchone()[0] > 10


def test_two_relays_writing_batches_of_the_same_keys_never_deadlock(pg_server, conn):
    import psycopg

    url = conn.info.dsn
    errors: list[BaseException] = []
    now = time.time()

    def writer(tag: str, seed: int) -> None:
        rng = random.Random(seed)
        with psycopg.connect(url, autocommit=True) as c:
            fake = types.SimpleNamespace(_conn=c, watchdog=store_pg.Watchdog(), call_timeout_s=60.0)
            for b in range(40):
                rows = [
                    _row(
                        ts=now,
                        request_id=f"{tag}{b}-{i}",
                        key_id=rng.choice(KEYS),
                        upstream_served="u",
                        ok=1,
                        prompt_tokens=1,
                        completion_tokens=2,
                        row_id=f"{tag}{b}-{i}",
                    )
                    for i in range(12)
                ]
                rng.shuffle(rows)
                try:
                    store_pg.PgStore._commit_pg(fake, rows)
                except psycopg.Error as exc:
                    errors.append(exc)

    threads = [threading.Thread(target=writer, args=(f"w{i}-", i)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert conn.execute("SELECT sum(n), sum(t) FROM usage_day").fetchone() == (
        3 * 40 * 12,
        3 * 40 * 12 * 3,
    )
    _check(conn, now)

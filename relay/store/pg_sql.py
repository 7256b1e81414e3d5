"""The PostgreSQL dialect of the store: the same `request` table (store.schema COLUMNS) plus
a `row_id` (globally unique: the relay's random id and a counter) that makes every write
idempotent, and the `reservation` table of the budget leases (store.pg_budget).

`relay_reserve` is the whole pre-flight in one round trip: under a per-key advisory lock it
turns the key's expired leases into `relay_crashed` rows (their relay died mid-request: as a
crash on SQLite, the request is charged with what it reserved), reads the key's charged usage
in each window and its live leases in ONE statement (one snapshot: a settlement committing
meanwhile - row in, lease out - is seen whole or not at all), and either returns the window
that is full or inserts the lease. Lease times are the server's clock, so relays need not
agree on the time.

A key's usage in a window is read off `usage_day`, its charged requests and tokens per UTC
day, kept by a trigger on `request` (every insert, update and delete of a row, whoever makes
it: a settlement, a crash placeholder replaced, a spill replayed, a prune), not summed over
its rows: a busy key has ~10^5 rows a day and 10^6 a month, and summing them cost every
reservation 31 ms at 10^5 (under the key's lock: every relay's requests of that key waited
for each other). Windows start at UTC midnight, so a window is whole days; a start inside a
day (none today) adds that day's rows after it (`relay_used`). A database made before the
table existed gets it filled from its rows once, with the trigger, in one transaction. A row's
tokens count as store.admissions TOKENS clamps them; the table's comment names that rule, and
one kept by another (an older relay summed the figures unchecked) is summed again once.
"""

from __future__ import annotations

from relay.observe.record import CRASHED, RESERVED
from relay.store import admissions as durable
from relay.store.schema import COLUMNS, TYPES
from relay.stream.usage import MAX_TOKENS

_PG_TYPE = {"REAL": "DOUBLE PRECISION", "INTEGER": "BIGINT", "TEXT": "TEXT"}
ROW_COLUMNS = COLUMNS + ("row_id",)
CHARGED = durable.CHARGED
NOW = "extract(epoch from clock_timestamp())"
# The advisory lock under which relays starting together create the schema once ("relay").
SCHEMA_LOCK = 0x72656C6179

RES_FIELDS = (
    "id",
    "relay_id",
    "key_id",
    "expires",
    "tokens",
    "ts",
    "request_id",
    "path",
    "model",
    "stream",
    "upstream_requested",
    "prompt_tokens",
    "completion_tokens",
)

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS request ("
    + ", ".join(f"{c} {_PG_TYPE[t]}" for c, t in zip(COLUMNS, TYPES))
    + ", row_id TEXT)",
    # a table an older relay created gains the columns added since (store.migrate's job
    # on SQLite)
    *(
        f"ALTER TABLE request ADD COLUMN IF NOT EXISTS {c} {_PG_TYPE[t]}"
        for c, t in zip(ROW_COLUMNS, TYPES + ("TEXT",))
    ),
    "CREATE UNIQUE INDEX IF NOT EXISTS request_row_id ON request (row_id)",
    "CREATE INDEX IF NOT EXISTS request_ts ON request (ts)",
    "CREATE INDEX IF NOT EXISTS request_key_ts ON request (key_id, ts)",
    "CREATE TABLE IF NOT EXISTS reservation (id TEXT PRIMARY KEY, relay_id TEXT NOT NULL,"
    " key_id TEXT NOT NULL, expires DOUBLE PRECISION NOT NULL, tokens BIGINT NOT NULL,"
    " ts DOUBLE PRECISION, request_id TEXT, path TEXT, model TEXT, stream BIGINT,"
    " upstream_requested TEXT, prompt_tokens BIGINT, completion_tokens BIGINT)",
    "CREATE INDEX IF NOT EXISTS reservation_key ON reservation (key_id)",
    "CREATE INDEX IF NOT EXISTS reservation_relay ON reservation (relay_id)",
)

# A row replaces the `relay_crashed` placeholder its expired lease left (a relay cut off from
# the server longer than reservation_ttl_s); any other row already there is kept as it is.
_CRASHED_ONLY = f"request.error_code = '{CRASHED}'"
INSERT = (
    f"INSERT INTO request ({', '.join(ROW_COLUMNS)}) "
    f"VALUES ({', '.join('%s' for _ in ROW_COLUMNS)}) ON CONFLICT (row_id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in COLUMNS)
    + f" WHERE {_CRASHED_ONLY}"
)
DELETE_LEASES = "DELETE FROM reservation WHERE id = ANY(%s)"

# Expired leases become charged rows, in key order (as _commit_pg locks them).
_EXPIRE = (
    "WITH gone AS (DELETE FROM reservation WHERE {where} RETURNING *)"
    " INSERT INTO request (ts, request_id, key_id, path, model, stream, upstream_requested,"
    " fallback_attempts, ok, error_code, prompt_tokens, completion_tokens, tokens_source,"
    " bytes_out, client_closed, row_id)"
    " SELECT ts, request_id, key_id, path, model, stream, upstream_requested, 0, 0,"
    f" '{CRASHED}', prompt_tokens, completion_tokens, '{RESERVED}', 0, 0, id"
    " FROM gone ORDER BY key_id ON CONFLICT (row_id) DO NOTHING"
)
EXPIRE_ALL = _EXPIRE.format(where=f"expires < {NOW}")
RENEW = f"UPDATE reservation SET expires = {NOW} + %s WHERE relay_id = %s"

# The UTC day of a time (seconds since the epoch).
DAY = "floor({ts} / 86400) * 86400"
_CHARGE = (f"CASE WHEN {CHARGED} THEN 1 ELSE 0 END", durable.TOKENS)

USAGE_DAY = f"""
CREATE OR REPLACE FUNCTION relay_usage_day() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    v_key text;
    v_day double precision;
    v_n bigint;
    v_t bigint;
BEGIN
    IF TG_OP <> 'INSERT' THEN
        SELECT key_id, {DAY.format(ts="ts")}, {_CHARGE[0]}, {_CHARGE[1]}
            INTO v_key, v_day, v_n, v_t FROM (SELECT (OLD).*) AS r;
        IF v_key IS NOT NULL AND v_day IS NOT NULL THEN
            UPDATE usage_day SET n = n - v_n, t = t - v_t WHERE key_id = v_key AND day = v_day;
        END IF;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        SELECT key_id, {DAY.format(ts="ts")}, {_CHARGE[0]}, {_CHARGE[1]}
            INTO v_key, v_day, v_n, v_t FROM (SELECT (NEW).*) AS r;
        IF v_key IS NOT NULL AND v_day IS NOT NULL THEN
            INSERT INTO usage_day AS u (key_id, day, n, t) VALUES (v_key, v_day, v_n, v_t)
                ON CONFLICT (key_id, day) DO UPDATE SET n = u.n + EXCLUDED.n, t = u.t + EXCLUDED.t;
        END IF;
    END IF;
    RETURN NULL;
END
$fn$"""

# usage_day's comment names the rule its tokens were summed by (store.admissions TOKENS)
USAGE_DAY_RULE = f"relay: the tokens of figures from 0 to {MAX_TOKENS}"
_FILL = f"""INSERT INTO usage_day (key_id, day, n, t)
            SELECT key_id, {DAY.format(ts="ts")}, sum({_CHARGE[0]}), sum({_CHARGE[1]})
            FROM request WHERE key_id IS NOT NULL AND ts IS NOT NULL GROUP BY 1, 2;
        COMMENT ON TABLE usage_day IS '{USAGE_DAY_RULE}'"""

# once, on a database made before usage_day: the table, filled from the rows, and the trigger
# in one transaction, writers held off meanwhile (none is counted twice or missed)
USAGE_DAY_TABLE = f"""
DO $do$
BEGIN
    IF to_regclass('usage_day') IS NULL THEN
        LOCK TABLE request IN SHARE ROW EXCLUSIVE MODE;
        CREATE TABLE usage_day (key_id TEXT NOT NULL, day DOUBLE PRECISION NOT NULL,
                                n BIGINT NOT NULL, t BIGINT NOT NULL, PRIMARY KEY (key_id, day));
        {_FILL};
        CREATE TRIGGER relay_usage_day AFTER INSERT OR UPDATE OR DELETE ON request
            FOR EACH ROW EXECUTE FUNCTION relay_usage_day();
    END IF;
END
$do$"""

# once, on a usage_day an older relay kept by another rule (its tokens summed unchecked: an
# absurd figure counted, and a delete later would take away what the new rule counts): it is
# summed again from the rows, as USAGE_DAY_TABLE fills it, writers held off meanwhile
USAGE_DAY_RULED = f"""
DO $do$
BEGIN
    IF obj_description('usage_day'::regclass, 'pg_class') IS DISTINCT FROM '{USAGE_DAY_RULE}' THEN
        LOCK TABLE request IN SHARE ROW EXCLUSIVE MODE;
        DELETE FROM usage_day;
        {_FILL};
    END IF;
END
$do$"""

# a key's charged requests and tokens since `p_start`: whole days from usage_day, the rows of
# a day the start cuts (none when it is a UTC midnight, as every window's). STABLE matters:
# its queries see the snapshot of the statement calling it, so relay_reserve still reads the
# usage and the live leases as of one moment (a settlement is seen whole or not at all).
USED = f"""
CREATE OR REPLACE FUNCTION relay_used(p_key text, p_start double precision,
                                      OUT n bigint, OUT t bigint)
LANGUAGE plpgsql STABLE AS $fn$
DECLARE
    whole double precision := ceil(p_start / 86400) * 86400;
BEGIN
    SELECT coalesce(sum(d.n), 0), coalesce(sum(d.t), 0) INTO n, t
        FROM usage_day d WHERE d.key_id = p_key AND d.day >= whole;
    IF whole > p_start THEN
        SELECT n + coalesce(sum({_CHARGE[0]}), 0), t + coalesce(sum({_CHARGE[1]}), 0) INTO n, t
            FROM request WHERE key_id = p_key AND ts >= p_start AND ts < whole;
    END IF;
END
$fn$"""

FUNCTION = f"""
CREATE OR REPLACE FUNCTION relay_reserve(
    p_id text, p_relay text, p_key text, p_tokens bigint, p_ttl double precision,
    p_ts double precision, p_request_id text, p_path text, p_model text, p_stream bigint,
    p_upstream text, p_prompt bigint, p_completion bigint,
    p_kinds text[], p_starts double precision[], p_req_limits bigint[], p_tok_limits bigint[])
RETURNS text LANGUAGE plpgsql AS $fn$
DECLARE
    i int;
    used_req bigint;
    used_tok bigint;
BEGIN
    -- visible to every relay at once; not waiting for the WAL flush spares the request a
    -- disk sync (only a crash of the server itself could lose the lease, and then the relays
    -- are on their local views anyway)
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_advisory_xact_lock(hashtextextended('relay_reserve:' || p_key, 0));
    {_EXPIRE.format(where=f"key_id = p_key AND expires < {NOW}")};
    FOR i IN 1 .. coalesce(array_length(p_kinds, 1), 0) LOOP
        SELECT r.n + l.n, r.t + l.t INTO used_req, used_tok FROM
            relay_used(p_key, p_starts[i]) r,
            (SELECT count(*) AS n, coalesce(sum(tokens), 0) AS t
               FROM reservation WHERE key_id = p_key) l;
        IF p_req_limits[i] > 0 AND used_req + 1 > p_req_limits[i] THEN
            RETURN p_kinds[i] || '_requests ' || used_req;
        END IF;
        IF p_tok_limits[i] > 0 AND used_tok + p_tokens > p_tok_limits[i] THEN
            RETURN p_kinds[i] || '_tokens ' || used_tok;
        END IF;
    END LOOP;
    INSERT INTO reservation ({", ".join(RES_FIELDS)}) VALUES (p_id, p_relay, p_key,
        {NOW} + p_ttl, p_tokens, p_ts, p_request_id, p_path, p_model, p_stream, p_upstream,
        p_prompt, p_completion);
    RETURN NULL;
END
$fn$"""
# the schema and functions, run in order under SCHEMA_LOCK at every relay's start
SETUP = SCHEMA + (USAGE_DAY, USAGE_DAY_TABLE, USAGE_DAY_RULED, USED, FUNCTION)

RESERVE = "SELECT relay_reserve(" + ", ".join("%s" for _ in range(17)) + ")"

# A key's charged usage (a budget's: budgets have keys).
USAGE = "SELECT n, t AS tokens FROM relay_used(%s, %s)"
# the same summed over the key's rows, as relay_reserve read it before usage_day: what
# bench/pg_reserve_scale.py times relay_used against
USED_BY_ROWS = (
    f"SELECT coalesce(sum({_CHARGE[0]}), 0), coalesce(sum({_CHARGE[1]}), 0)"
    " FROM request WHERE key_id = %s AND ts >= %s"
)
COUNT = (
    f"SELECT count(*) AS n, coalesce(sum({durable.TOKENS}), 0) AS tokens"
    " FROM request WHERE key_id IS NOT DISTINCT FROM %s AND ts >= %s"
)
PRUNE = "DELETE FROM request WHERE ts < %s"


def portable(sql: str) -> str:
    """SQLite's `?` placeholders and `IS ?` as PostgreSQL spells them (the readers' SQL of
    report.summary is written once, for both)."""
    return sql.replace("IS ?", "IS NOT DISTINCT FROM ?").replace("?", "%s")

"""Where rows and admission records are kept: SQLite for one relay, PostgreSQL for several.

- `interface`: `RowStore`, what the relay uses of a store (either of these, or a worker's
  stand-in)
- `schema`: the `request` table's columns, and a row as stored (and as read back)
- `sqlite`, `sqlite_writer`, `sqlite_file`: the SQLite store (event-loop side, writer
  thread, the file's lock and read-only connections)
- `admissions`: durable admission records and crash recovery (SQLite)
- `migrate`: older databases brought up to the current columns
- `postgres`, `pg_sql`, `pg_budget`: the PostgreSQL store, its SQL, budgets shared in it
- `pg_bound`: client-side bounds on PostgreSQL calls (a server that does not answer)
- `spill`: rows kept in a local file while PostgreSQL is away

May import: `relay.observe`, `relay.policy`, `relay.stream`, `relay.config`, `relay.http`,
`relay.errors`. psycopg only in the PostgreSQL modules (the `postgres` extra).
"""

# What to run when psycopg is missing: the relay installs from its checkout (the package named
# `relay` on PyPI is another project's).
POSTGRES_EXTRA_HINT = "pip install -e '.[postgres]' in the relay's checkout"

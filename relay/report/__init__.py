"""`relay report`: summaries and the benchmark view of stored rows, read offline.

- `rows`: read-only access to a SQLite file or the PostgreSQL table several relays share
- `summary`: per (model, upstream) latency, throughput and failures; the command itself
- `bench`: the figures benchmarking tools print (TTFT, ITL, TPOT, E2EL, throughput)
- `prompt_cache`: the prompt cache's hit ratio per pool (cached / prompt tokens)
- `untrusted`: stored text escaped for printing; rows whose columns hold the wrong kind left out

May import: `relay.store`, `relay.observe`, `relay.stream`, `relay.config`, `relay.errors`.
"""

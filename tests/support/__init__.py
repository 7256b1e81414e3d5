"""What the tests share, in one place (no test module imports another):

- `httpc`: a strict HTTP/1.1 client over raw asyncio streams; `fakeup`: scripted upstreams.
- `helpers`: bounded waits, a refused port, a relay's rows, its error bodies, slots metrics.
- `keys`: API key secrets, their SHA-256, a `KeyConfig`, the bearer header.
- `sockets`: awkward peers (a stalled reader, a tiny window, a non-loopback address).
- `processes`: `python -m relay` as a real process; `pg_relays`: several on one PostgreSQL.
- `sim_client`: a raw client of the simulator; `fake_loop`: a fake loop clock for timers.
- `cdp`: a headless Chromium over DevTools; `pg_server`: a throwaway PostgreSQL server.
- `fixtures`: the repository root and the captured llama-server fixtures' folder.
- `need`: skip naming what is missing (an extra, a binary), or fail under CI=true.
"""

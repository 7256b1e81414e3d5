"""Per-stream observation of what the upstream sends, pure: no socket, no row, no metric.

- `sse`: the incremental Server-Sent-Event scanner (content events, `[DONE]`, errors, usage)
- `fastpath`: the usual read recognised in one go (whole chunks of whole token events)
- `usage`: exact token figures read from what the upstream said
- `itl`: gaps between content events (inter-token latency), in bounded buckets
- `stall`: when a stream counts as stuck, and the terminal frame that ends it
- `deadlines`: every open stream's stall deadline on one loop timer
- `content_hold`: the response held until its first content event (heartbeats, fallback)
- `client_flow`: the client's write buffer pausing the upstream's reads
- `endings`: how an exchange can end, and how it fails before its head

May import: `relay.http`, `relay.errors`. Never `relay.store` (the hot path writes no rows).
Time comes in as arguments or from the loop it is given, so tests drive it with fake clocks.
"""

"""The asyncio layer: sockets, tasks and timers around the pure rules below it, kept thin.

- `client`: one client connection (an asyncio.Protocol reading requests with h11)
- `request`: a request read whole, as the dispatcher gets it
- `dispatch`: the life of one request, from admission to settlement
- `ledger`: what one request holds until settlement and what it learnt on the way
- `endpoints`: the endpoints the relay answers itself (page, metrics, models)
- `attempt`: one candidate's attempt, up to the response head (slot, connection, request)
- `exchange`, `exchange_state`: one request on one upstream connection (the hot path)
- `settle`: settlement, exactly once: slot, budget, row, metrics, access line
- `pool`: upstream connections and their keep-alive pool
- `upstreams`: one configured upstream (address, TLS, pool, slots, health, metrics)
- `slots`: `parallel` slots and a bounded FIFO queue per upstream
- `health`: an upstream's state from probes and from what requests see
- `body_memory`: the relay-wide bound on request-body bytes held

May import every layer below: `relay.store`, `relay.observe`, `relay.policy`,
`relay.stream`, `relay.config`, `relay.http`, `relay.errors`; not `relay.report`.
"""

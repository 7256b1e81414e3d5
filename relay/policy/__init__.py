"""Who may do what, and what a request may cost: decisions without sockets.

- `keys`: API keys (the caller's secret -> key id, compared in constant time)
- `admin_access`: who may call the relay's admin endpoints and the upstream's mutating ones
- `request_head`: the refusals a request head gets before any byte of its body is read
- `admission`: what a request asks for (its body peeked) and what it reserves
- `budget`: per-key budgets over UTC windows, reserved before a stream, settled after
- `cors`: answers to browser origins
- `routing`: model name -> the ordered candidate upstreams
- `model_map`: the model name an upstream expects, spliced into the body

May import: `relay.config`, `relay.stream`, `relay.http`, `relay.errors`.
"""

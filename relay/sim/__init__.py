"""The built-in llama-server simulator: a fake upstream for tests, benches and `relay serve --demo`.

Modules, from the entry points down (each imports only modules listed below it):

- ``__main__``: ``python -m relay.sim [flags]``, the command line of cli.py.
- ``cli``: the `relay sim` command line: its flags, the per-request knobs' help, serving until
  a signal.
- ``server``: `Simulator`, the in-process server object: state plus a listening socket, start/stop.
- ``conn``: one client connection: h11 request parsing, routing, Content-Length answers, keep-alive.
- ``gen``: one streamed generation, paced by a loop.call_at chain (`Gen`, and `Link`, what it
  needs of its connection).
- ``plan``: what to send for one request: the error its knobs ask for, or a generation's `Plan`.
- ``state``: what a running simulator knows: `SimDefaults` (its knobs), `SimRequest` (one
  request as seen), `SimState` (switches, counters, requests, connections, and its slots:
  which generation holds which, the queue of those waiting for one, what each slot's cache
  keeps when its generation ends).
- ``endpoints``: the JSON bodies of the non-generation routes (models, props, slots, metrics,
  tokenize, detokenize, embeddings, the Messages and Responses token counts).
- ``frames``: the streamed events of one generation (`StreamFrames`), and the non-streamed body
  of any generation route.
- ``shapes``: chat chunks in other servers' shapes (vLLM, OpenAI).
- ``chat``: an OpenAI chat request's prompt as the model reads it (its turns).
- ``messages`` / ``responses``: Anthropic Messages (/v1/messages) and OpenAI Responses
  (/v1/responses) in llama-server's bytes: streamed events, bodies, token counts, and the
  prompt's turns.
- ``completion``: the JSON of a finished completion: ids, timings, usage, the native final
  object, non-streamed bodies.
- ``tinymodel``: the tiny model it pretends to serve: vocabulary, token text, stop words,
  tokenizer, embeddings, and the chat template that makes a conversation's turns tokens.
- ``slots``: the slots' rules, llama-server's: which free slot a prompt takes (similarity of
  its cache, else the least recently used), and what that slot's cache spares.
- ``wire``: what every response is made of: heads, chunk framing, the fixed events, error
  bodies; and the names the modules above pass each other (`Route`, `Kind`, `Shape`,
  `Finish`, `ToolCall`, `Timings`).

Slots: each keeps a prompt cache as llama-server's does, and a generation reuses what its
slot holds (state.py's docstring: the choice of a slot, what it keeps, generations beyond the
slots, the counters).

The rule: nothing in `relay` imports this package but `relay.cli` (the `relay sim` and
`relay serve --demo` commands), and it imports nothing of `relay` outside `relay/sim/`.
"""

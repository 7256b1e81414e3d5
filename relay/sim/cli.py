"""The `relay sim` command line: its flags, the per-request knobs' help, serving until a signal.

``relay sim ...``, ``python -m relay.sim ...`` and `main([...])` parse the flags into a
SimDefaults and the state's slot switches (--parallel, --slot-prompt-similarity, --defer),
start one Simulator (over TLS with --tls-cert), print a ``sim_listening`` JSON line with the
bound port, and serve until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
import sys

from relay.sim.server import Simulator
from relay.sim.shapes import SHAPES
from relay.sim.state import SimDefaults
from relay.sim.wire import Shape, jdump


async def _serve(args: argparse.Namespace) -> None:
    ctx = None
    if args.tls_cert:
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    sim = Simulator(
        args.host,
        args.port,
        SimDefaults(
            model=args.model,
            tokens=args.tokens,
            interval_ms=args.interval_ms,
            first_token_delay_ms=args.first_token_delay_ms,
            head_delay_ms=args.head_delay_ms,
            keep_streams=args.keep_alive_streams,
            shape=Shape(args.shape),
            events_per_chunk=args.events_per_chunk,
            chunks_per_write=args.chunks_per_write,
            prefill_ms_per_token=args.prefill_ms_per_token,
        ),
        ssl=ctx,
    )
    sim.parallel = args.parallel
    sim.slot_prompt_similarity = args.slot_prompt_similarity
    sim.defer = args.defer
    await sim.start()
    print(
        jdump({"event": "sim_listening", "host": args.host, "port": sim.port}).decode(),
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(s, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        await sim.stop()


SIM_KNOBS_HELP = """\
per-request knobs: a request body may carry "sim": {...} overriding the flags for it:
  tokens                 int    tokens to generate (capped by n_predict/max_tokens); default --tokens
  interval_ms            float  ms between streamed tokens; default --interval-ms
  first_token_delay_ms   float  ms from the head to the first token; default --first-token-delay-ms
  head_delay_ms          float  ms before the response head; default --head-delay-ms
  prefill_ms_per_token   float  ms per prompt token not reused (before the first token); default --prefill-ms-per-token
  status                 int    answer this HTTP status (>= 400) with an error body; default none
  error_event            bool   a 200 SSE stream holding only an {"error": ...} event; default false
  stall_after            int    stop sending after this many tokens, keep the connection; default none
  stall_mid_line         bool   with stall_after: stop inside a `data:` line; default false
  stall_mid_chunk        bool   with stall_after: stop inside a chunk; default false
  drop_after             int    close the connection after this many tokens; default none
  chatty                 bool   stream without end (interval_ms, or 10 ms); default false
  content_length_stream  bool   a stream framed by Content-Length, not chunked; default false
  body_kind              str    "octet": an application/octet-stream body; default the route's
  eos_event              bool   an empty EOS event ends a text stream; default false (true on /completion)
  shape                  str    chat chunks: "llama", "vllm" or "openai"; default --shape
  events_per_chunk       int    content events in one chunk (1..4096); default --events-per-chunk
  chunks_per_write       int    chunks in one write (1..4096); default --chunks-per-write
  tool_call              bool   a tool call on /v1/messages, /v1/responses; default false
                                (after `tokens` text tokens: the request's first tool,
                                arguments {"city": "Paris"} in word-sized deltas; an object
                                sets "name", "arguments" (text or value), "pieces")
the body's own "cache_prompt": false (llama-server's field) reuses nothing of the slot's cache.

slots: --parallel slots, each keeping its last prompt and reply as llama-server's prompt
cache does; a generation takes the free slot whose cache shares more than
--slot-prompt-similarity of its prompt, else the least recently used one, and reuses the
common prefix (all of the prompt but its last token at most): timings.cache_n, usage's cached
tokens. With every slot busy it runs without one (nothing reused), or with --defer waits for
one, first come first served.
"""


def _slots(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError("must be 1..256")
    return n


def _fraction(text: str) -> float:
    x = float(text)
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError("must be 0..1")
    return x


def _ms(text: str) -> float:
    x = float(text)
    if not x >= 0.0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return x


def _cannot_start(exc: OSError, host: str, port: int) -> str:
    """Why the simulator cannot start, in one line: the port in use, a certificate file."""
    if exc.errno == errno.EADDRINUSE:
        return f"{host}:{port}: address already in use (--port 0 takes any free one)"
    if exc.filename:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def _count(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 4096:
        raise argparse.ArgumentTypeError("must be 1..4096")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="relay sim",
        description="llama-server simulator: OpenAI chat/completions, "
        "/completion, Anthropic /v1/messages, OpenAI /v1/responses, /health, /props, /slots, "
        "/metrics, /tokenize, embeddings, with "
        "deterministic text and exact usage/timings.",
        epilog=SIM_KNOBS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    ap.add_argument(
        "--port",
        type=int,
        default=8081,
        help="listen port, 0 for any free one (default %(default)s)",
    )
    ap.add_argument(
        "--tokens",
        type=int,
        default=16,
        help="tokens generated when the request sets no limit (count, default %(default)s)",
    )
    ap.add_argument(
        "--interval-ms",
        type=float,
        default=0.0,
        help="gap between two streamed tokens (milliseconds, default %(default)s)",
    )
    ap.add_argument(
        "--first-token-delay-ms",
        type=float,
        default=0.0,
        help="from the response head to the first token (milliseconds, default %(default)s)",
    )
    ap.add_argument(
        "--head-delay-ms",
        type=float,
        default=0.0,
        help="from the request to the response head (milliseconds, default %(default)s)",
    )
    ap.add_argument(
        "--prefill-ms-per-token",
        type=_ms,
        default=0.0,
        help="prompt processing before the first token, per prompt token not reused from the "
        "slot's cache (milliseconds, default %(default)s)",
    )
    ap.add_argument(
        "--parallel",
        type=_slots,
        default=2,
        help="slots, each with its prompt cache (count, default %(default)s)",
    )
    ap.add_argument(
        "--slot-prompt-similarity",
        type=_fraction,
        default=0.1,
        help="a prompt takes the free slot whose cache shares more than this fraction of it, "
        "else the least recently used; 0: least recently used only (default %(default)s)",
    )
    ap.add_argument(
        "--defer",
        action="store_true",
        help="with every slot busy, a generation waits for one, first come first served, as "
        "llama-server defers it (default: it runs at once, without a slot, reusing nothing)",
    )
    ap.add_argument(
        "--model", default="models/tiny.gguf", help="model name it reports (default %(default)s)"
    )
    ap.add_argument(
        "--tls-cert", help="PEM certificate chain: serve over TLS (default: plain HTTP)"
    )
    ap.add_argument("--tls-key", help="PEM private key of --tls-cert (default: none)")
    ap.add_argument(
        "--keep-alive-streams",
        action="store_true",
        help="keep the connection after a stream (a hosted API), not close it "
        "(default: close, as llama-server does)",
    )
    ap.add_argument(
        "--shape",
        choices=SHAPES,
        default="llama",
        help="chat chunk shape: llama-server's, vLLM's (logprobs, usage null with "
        "include_usage), or OpenAI's (also service_tier, obfuscation padding) "
        "(default %(default)s)",
    )
    ap.add_argument(
        "--events-per-chunk",
        type=_count,
        default=1,
        help="content events coalesced in one chunk (count, default %(default)s)",
    )
    ap.add_argument(
        "--chunks-per-write",
        type=_count,
        default=1,
        help="chunks sent in one write, i.e. one read for the peer (count, default %(default)s)",
    )
    if argv and argv[0] == "sim":
        argv = argv[1:]
    args = ap.parse_args(argv)
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        try:
            runner.run(_serve(args))
        except KeyboardInterrupt:
            pass
        except OSError as exc:
            print(f"relay sim: {_cannot_start(exc, args.host, args.port)}", file=sys.stderr)
            return 1
    return 0

"""python -m bench.fleet: three llama-servers behind one address, side by side in one run.

    .venv/bin/python -m bench.fleet --repeat 3 --output bench/RESULTS-fleet.md
    .venv/bin/python -m bench fleet --quick          # the same entry, a small replay

Issue 32's item 8. Three real llama-servers (the pinned build, the tiny deterministic model
of tests/e2e/tiny_gguf.py, `-np 2` each, a slot context that holds the longest conversation)
serve a replay of multi-turn agent conversations through one address per target:

- ``nginx``: round-robin over the three (bench/nginx.py's config: `proxy_buffering off`,
  HTTP/1.1), keeping no idle upstream connection (`--nginx-keepalive 0`): llama-server closes
  its connection after a stream though it answered `Keep-Alive`, and with bench/nginx.py's
  pool of 64 a turn that took a connection the server had just closed failed, was retried on
  the NEXT member, and took the first one out for 10 s (`max_fails 1`): in a trial run 19
  of 96 requests, 16 of them answered 502 while all three were out;
- ``haproxy``: `balance leastconn`, mode http;
- ``relay_least``: the relay's pool with `[balance] affinity = false` (the least-loaded
  member, ties by rendezvous hashing);
- ``relay_affinity``: the relay's pool with `affinity = true` (the member holding the longest
  prefix of the conversation, within the load bound), every `[balance]` key at its default;
- ``relay_affinity_fixed``: the same with `home_wait_s = 0.5` (a request waits at most half
  a second for its conversation's member before it takes another's slot, whatever a move
  would cost: the default before the hold was learnt from the answers);
- ``onebox``: the reference, one llama-server with a slot per conversation, driven directly:
  one box holding every conversation. Its hit ratio is the goal's denominator.

Every run starts from freshly started llama-servers (so every target starts cold, its
counters at zero) and a fresh proxy; the targets' order rotates between repeats.

The replay (`make_conversations`): N conversations of T turns, each a loop of streamed chat
requests carrying the whole conversation (a long system prompt, the earlier turns with the
server's own replies, a new user message), all conversations at once (a conversation's next
turn starts when its previous one ends), content seeded, `max_tokens` small so prefill
dominates. Each conversation has its own system prompt: no prefix is shared between
conversations, so the ideal below is exact. Sizes are planned in tokens and turned into characters by the ratio the server's
`/tokenize` gives for the generator's text (the tiny model's vocabulary is byte-fallback).

Figures per run (`figures`): prompt tokens the servers processed (the responses'
`timings.prompt_n`, checked against each server's `/metrics` `prompt_tokens_total`) against the
ideal (each prefix once: per conversation its final turn's prompt); the hit ratio (cached ÷
all prompt tokens, from `timings.cache_n`); TTFT p50/p99 of the follow-up turns (request
about to be written -> first content event, client side) and the share of it the server spent
in prefill (`timings.prompt_ms`); requests per member (each server's `/metrics`
`tokens_predicted_total` ÷ `max_tokens`: the model never stops early) and max ÷ mean; moves
(follow-up turns served by another member than the turn before, from the response's `model`,
which llama-server fills with its model file's path, one per server). The routing decision's
cost (`decision_cost`): `relay.policy.affinity.want_of` (the body's JSON decode, its
fingerprint and first key) + `relay.policy.affinity.choose` in this process, on the replay's
own bodies, over a `PrefixTable` the replay filled, and again on the same conversations
written at 4 characters a token (what such prompts weigh under a real tokenizer: the
fingerprint's cost grows with the bytes). `--decision-only` times the decision alone, with
no server: the replies are seeded words as long as `max_tokens` (`synthetic_replay`).
`goals` checks issue 32's goals and the report prints them; nothing asserts them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import load as bload
from bench import nginx, procs, relay_conf, report

HOST = "127.0.0.1"
TARGETS = ("onebox", "nginx", "haproxy", "relay_least", "relay_affinity", "relay_affinity_fixed")
RELAY_TARGETS = ("relay_least", "relay_affinity", "relay_affinity_fixed")
# The relay targets' `[balance]` table, over the defaults relay_config writes.
BALANCE = {
    "relay_least": {"affinity": False},
    "relay_affinity": {"affinity": True},
    "relay_affinity_fixed": {"affinity": True, "home_wait_s": 0.5},
}
# The targets the affinity goals are judged on, each on its own.
AFFINITY_TARGETS = ("relay_affinity", "relay_affinity_fixed")
MEMBERS = 3
PARALLEL = 2
MODEL = "tiny"
# Per message, the chat template's own tokens (`<|im_start|>role\n ... <|im_end|>\n`), about.
TEMPLATE_TOKENS = 8
# The host-memory prompt cache of each member, MiB. The tiny model's state is 528 bytes a
# token (measured: a 10 120-token slot saves 5 343 464 bytes); an 8B model's (Llama 3.1 8B:
# 32 layers x 8 KV heads x 128 x K and V x f16) is 128 KiB, 248 times more. llama-server's
# default 8192 MiB would hold every conversation of the replay in every member, which no real
# box does; 32 MiB is that default scaled by the same factor: about 60 000 tokens, some seven
# conversations at their longest.
CACHE_RAM_MIB = 32
# The goals.
GOAL_HIT_SHARE = 0.90
GOAL_TTFT_SPEEDUP = 3.0
GOAL_LOAD_SPREAD = 1.5
GOAL_DECISION_US = 50.0
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
# English text under a real model's tokenizer, about: what a prompt of N tokens weighs in bytes
# outside the tiny model's byte-fallback vocabulary (for the decision's cost).
REAL_CHARS_PER_TOKEN = 4.0
# What the tiny model's byte-fallback vocabulary reads (`/tokenize`, the replays measured).
TINY_CHARS_PER_TOKEN = 0.884
pct = bload.pct  # nearest rank, None for no values


# -- the replay -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What to replay: `conversations` x `turns`, the first turn's prompt about `first_tokens`
    tokens, the last about `last_tokens`."""

    conversations: int = 16
    turns: int = 6
    first_tokens: int = 2000
    last_tokens: int = 8000
    max_tokens: int = 16
    seed: int = 32
    # The mean pause between an answer and the conversation's next turn, seconds (the agent
    # running its tools); 0: the next turn is sent at once.
    think_s: float = 0.0


@dataclass(frozen=True)
class Sizes:
    """The planned size, in tokens, of the system prompt, the first user message, and every
    later user message (an agent's tool result)."""

    system: int
    first_user: int
    later_user: int


def plan_sizes(shape: Shape) -> Sizes:
    """Sizes such that turn 1's prompt is about `first_tokens` and each later turn adds
    (last − first) ÷ (turns − 1): the previous reply and its template, then a user message."""
    growth = (shape.last_tokens - shape.first_tokens) // max(1, shape.turns - 1)
    later = max(1, growth - shape.max_tokens - 2 * TEMPLATE_TOKENS)
    first_user = max(1, shape.first_tokens // 10)
    system = max(1, shape.first_tokens - first_user - 2 * TEMPLATE_TOKENS)
    return Sizes(system, first_user, later)


def words(rng: random.Random, n_chars: int) -> str:
    """`n_chars` characters of lowercase words (3 to 9 letters) separated by spaces."""
    out: list[str] = []
    size = 0
    while size <= n_chars:
        w = "".join(rng.choices(ALPHABET, k=rng.randint(3, 9)))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


@dataclass(frozen=True)
class Conversation:
    """One agent's conversation: its system prompt and one user message per turn."""

    index: int
    system: str
    users: tuple[str, ...]
    # The pause before each later turn, seconds (the same for every target).
    pauses: tuple[float, ...] = ()

    def messages(self, turn: int, replies: Sequence[str]) -> list[dict]:
        """What the agent sends at `turn` (0 first): the system prompt, every earlier turn
        with the server's reply to it, and the turn's user message."""
        out = [{"role": "system", "content": self.system}]
        for k in range(turn):
            out.append({"role": "user", "content": self.users[k]})
            out.append({"role": "assistant", "content": replies[k]})
        out.append({"role": "user", "content": self.users[turn]})
        return out

    def body(self, turn: int, replies: Sequence[str], max_tokens: int) -> dict:
        return {
            "model": MODEL,
            "messages": self.messages(turn, replies),
            "stream": True,
            "max_tokens": max_tokens,
        }


def make_conversations(shape: Shape, chars_per_token: float) -> list[Conversation]:
    """The replay's conversations: deterministic for a shape and ratio (each conversation
    has its own seeded generator), every one distinct from its first characters on."""
    sizes = plan_sizes(shape)

    def chars(tokens: int) -> int:
        return max(1, round(tokens * chars_per_token))

    out = []
    for i in range(shape.conversations):
        rng = random.Random(f"{shape.seed}:{i}")
        head = f"You are coding agent {i}. "
        system = head + words(rng, chars(sizes.system) - len(head))
        users = [f"Task {i}: " + words(rng, chars(sizes.first_user))]
        users += [
            f"Tool result {i}.{k}: " + words(rng, chars(sizes.later_user))
            for k in range(1, shape.turns)
        ]
        think = random.Random(f"{shape.seed}:{i}:think")
        pauses = tuple(
            think.expovariate(1.0 / shape.think_s) if shape.think_s > 0 else 0.0
            for _ in range(1, shape.turns)
        )
        out.append(Conversation(i, system, tuple(users), pauses))
    return out


@dataclass(frozen=True)
class Readout:
    """What a streamed chat answer said: its text, llama-server's `timings`, its `model`."""

    content: str
    timings: dict | None
    model: str | None


def read_stream(raw: bytes) -> Readout:
    """The content deltas, the last `timings` and `model` of an event stream's bytes."""
    content: list[str] = []
    timings = model = None
    for line in raw.replace(b"\r\n", b"\n").split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        model = obj.get("model", model)
        timings = obj.get("timings", timings)
        for choice in obj.get("choices") or ():
            text = (choice.get("delta") or {}).get("content")
            if isinstance(text, str):
                content.append(text)
    return Readout("".join(content), timings, model)


# -- figures ----------------------------------------------------------------------------------


def hit_ratio(cached: int, processed: int) -> float | None:
    """Cached ÷ all prompt tokens (cached + processed); None for no prompt."""
    total = cached + processed
    return cached / total if total else None


def ideal_tokens(turns: Sequence[dict], n_turns: int) -> int | None:
    """Each prefix once: the sum over conversations of their final turn's prompt (processed +
    cached); None unless every conversation reached its final turn."""
    convs = {t["conv"] for t in turns}
    final = {
        t["conv"]: t["prompt_n"] + t["cache_n"]
        for t in turns
        if t["turn"] == n_turns - 1 and not t.get("error") and t.get("prompt_n") is not None
    }
    if not convs or set(final) != convs:
        return None
    return sum(final.values())


def load_spread(loads: Sequence[int]) -> float | None:
    """The busiest member's requests ÷ the mean (1.0: even)."""
    if not loads or not sum(loads):
        return None
    return max(loads) / (sum(loads) / len(loads))


def moves(turns: Sequence[dict]) -> int:
    """Follow-up turns served by another member than their conversation's previous turn."""
    by_conv: dict[int, dict[int, str | None]] = {}
    for t in turns:
        by_conv.setdefault(t["conv"], {})[t["turn"]] = t.get("member")
    n = 0
    for members in by_conv.values():
        for k, m in members.items():
            prev = members.get(k - 1)
            if k > 0 and m is not None and prev is not None and m != prev:
                n += 1
    return n


def figures(turns: Sequence[dict], n_turns: int, loads: Sequence[int]) -> dict:
    """One run's figures from its turns (see `replay`) and its requests per member."""
    ok = [t for t in turns if not t.get("error") and t.get("prompt_n") is not None]
    processed = sum(t["prompt_n"] for t in ok)
    cached = sum(t["cache_n"] for t in ok)
    ideal = ideal_tokens(turns, n_turns)
    follow = [t for t in ok if t["turn"] > 0 and t.get("ttft_ms") is not None]
    ttft = [t["ttft_ms"] for t in follow]
    timed = [t for t in follow if t.get("prompt_ms") is not None]
    shares = [t["prompt_ms"] / t["ttft_ms"] for t in timed if t["ttft_ms"]]
    # TTFT less the server's own prefill: the wait for a slot (other turns' prefill and
    # decode) and the fixed costs (connections, the proxy, the first token); its smallest
    # value, a turn that did not wait, is the fixed costs.
    rest = [t["ttft_ms"] - t["prompt_ms"] for t in timed]
    return {
        "requests": len(turns),
        "errors": len(turns) - len(ok),
        "processed": processed,
        "cached": cached,
        "ideal": ideal,
        "over_ideal": processed / ideal if ideal else None,
        "hit_ratio": hit_ratio(cached, processed),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "first_ttft_p50_ms": pct([t["ttft_ms"] for t in ok if t["turn"] == 0], 50),
        "prompt_ms_p50": pct([t["prompt_ms"] for t in follow if t.get("prompt_ms")], 50),
        "prefill_share_p50": pct(shares, 50),
        "rest_p50_ms": pct(rest, 50),
        "rest_min_ms": min(rest, default=None),
        "loads": list(loads),
        "load_spread": load_spread(loads),
        # (None when no answer named its server: a proxy that rewrote `model`)
        "moves": moves(ok) if any(t.get("member") for t in ok) else None,
        "follow_ups": len(follow),
    }


def median_of(rows: Sequence[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(xs) if xs else None


@dataclass(frozen=True)
class Goal:
    """One of the issue's goals: what it says, the figure, and whether it holds (None:
    not measured)."""

    name: str
    figure: str
    ok: bool | None


def goals(
    med: dict[str, dict], decision: dict | None, target: str = "relay_affinity"
) -> list[Goal]:
    """Issue 32's goals: `target`'s and the routing decision's."""
    return target_goals(med, target) + decision_goals(decision)


def target_goals(med: dict[str, dict], target: str) -> list[Goal]:
    """The goals of a relay target on the medians over repeats (`med[target][figure]`); a
    figure a target lacks (a target not run) leaves its goal open."""
    aff, box, rr = med.get(target, {}), med.get("onebox", {}), med.get("nginx", {})
    out = []
    h, hb = aff.get("hit_ratio"), box.get("hit_ratio")
    share = h / hb if h is not None and hb else None
    out.append(
        Goal(
            f"{target} hit ratio >= {GOAL_HIT_SHARE:.0%} of the one box's",
            "-" if share is None else f"{h:.3f} / {hb:.3f} = {share:.1%}",
            None if share is None else share >= GOAL_HIT_SHARE,
        )
    )
    t, tr = aff.get("ttft_p50_ms"), rr.get("ttft_p50_ms")
    speed = tr / t if t and tr is not None else None
    out.append(
        Goal(
            f"{target} follow-up TTFT p50 >= {GOAL_TTFT_SPEEDUP:g}x better than nginx round-robin",
            "-" if speed is None else f"{tr:.0f} ms / {t:.0f} ms = {speed:.2f}x",
            None if speed is None else speed >= GOAL_TTFT_SPEEDUP,
        )
    )
    s = aff.get("load_spread")
    out.append(
        Goal(
            f"{target}: no member above {GOAL_LOAD_SPREAD:g}x the mean load",
            "-" if s is None else f"max / mean = {s:.2f}",
            None if s is None else s <= GOAL_LOAD_SPREAD,
        )
    )
    return out


def _mark(goal: Goal) -> str:
    return "pending" if goal.ok is None else ("met" if goal.ok else "NOT met")


def decision_goals(decision: dict | None) -> list[Goal]:
    """The routing decision's cost against its goal, on the replay's bodies and at a real
    tokenizer's size; no figures (not measured) leave them open."""
    out = []
    for key, what in (
        ("replay", "the replay's bodies"),
        ("real_size", f"the same prompts at {REAL_CHARS_PER_TOKEN:g} characters a token"),
    ):
        d = (decision or {}).get(key) or {}
        heavy, every = d.get("heavy_us") or {}, d.get("decision_us") or {}
        p50 = heavy.get("p50")
        out.append(
            Goal(
                f"a routing decision under {GOAL_DECISION_US:g} µs ({what}; p50 of the"
                " decisions on the largest, each conversation's final turn)",
                "-"
                if p50 is None
                else f"{p50:.1f} µs (every body: p50 {every['p50']:.1f}, p99 {every['p99']:.1f})",
                None if p50 is None else p50 < GOAL_DECISION_US,
            )
        )
    return out


# -- the routing decision's cost ---------------------------------------------------------------


def decision_cost(bodies: Sequence[bytes], passes: int = 20, heavy: int = 1) -> dict:
    """What the relay runs per request to route it, timed here on the replay's bodies in the
    order they were sent: `want_of(Api.CHAT, body)` (the body's JSON decoded, which the relay
    does for this alone, then its fingerprint and first key) + `choose` over a `PrefixTable`
    first filled by one pass (each body recorded on the member chosen), then `passes` timed
    passes (each still recording, as the relay does after an answer). The members' loads vary
    from body to body; the decode and the fingerprint are also timed apart. `heavy_us`: the
    decisions on the `heavy` largest bodies alone (the conversations' final turns): their p50
    is the cost at the longest prompt, and unlike a p99 over every body it is not the
    machine's preemptions."""
    import msgspec

    from relay.policy import affinity, prefix
    from relay.stream.dialect import Api

    names = [f"m{i + 1}" for i in range(MEMBERS)]
    eligible = frozenset(names)
    states = []
    for i in range(len(bodies)):
        loads = [(i + j) % (PARALLEL + 1) for j in range(MEMBERS)]
        states.append([affinity.Member(n, ld, PARALLEL - ld) for n, ld in zip(names, loads)])
    clock = time.perf_counter_ns
    decoded = [msgspec.json.decode(b) for b in bodies]
    largest = set(sorted(range(len(bodies)), key=lambda i: len(bodies[i]))[-heavy:])
    table = affinity.PrefixTable()
    total, decodes, fps, chooses, records, heaviest = [], [], [], [], [], []
    for n in range(passes + 1):
        for i, (body, members) in enumerate(zip(bodies, states)):
            t0 = clock()
            want = affinity.want_of(Api.CHAT, body)
            t1 = clock()
            choice = affinity.choose(
                table, members, eligible, want.fingerprint, want.first_key or 0
            )
            t2 = clock()
            assert choice is not None
            table.record(choice.member, want.fingerprint)
            t3 = clock()
            msgspec.json.decode(body)
            t4 = clock()
            prefix.first_key(prefix.fingerprint(Api.CHAT, decoded[i]))
            t5 = clock()
            if n:
                total.append(t2 - t0)
                chooses.append(t2 - t1)
                records.append(t3 - t2)
                decodes.append(t4 - t3)
                fps.append(t5 - t4)
                if i in largest:
                    heaviest.append(t2 - t0)

    def us(xs: list[int]) -> dict:
        return {"p50": pct(xs, 50) / 1e3, "p99": pct(xs, 99) / 1e3, "max": max(xs) / 1e3}

    return {
        "bodies": len(bodies),
        "samples": len(total),
        "decision_us": us(total),
        "heavy": len(largest),
        "heavy_us": us(heaviest),
        "fingerprint_us": us(fps),
        "choose_us": us(chooses),
        "record_us": us(records),
        "decode_us": us(decodes),
        "body_kb": {
            "p50": pct([len(b) for b in bodies], 50) / 1024,
            "max": max(len(b) for b in bodies) / 1024,
        },
        "table_entries": len(table),
    }


# -- configs ----------------------------------------------------------------------------------

HAPROXY = """\
# generated by bench/fleet.py
global
    maxconn 4096
    nbthread 1

defaults
    mode http
    timeout connect 5s
    # streams: a request can wait in a llama-server's queue, then stream
    timeout client 600s
    timeout server 600s
    timeout http-request 60s

frontend fleet
    bind {host}:{port}
    default_backend llm

backend llm
    balance leastconn
    # (http-reuse safe, the default: a client's first request never takes an idle server
    # connection, so llama-server closing its connection after a stream costs no retry)
{servers}
"""


def haproxy_conf(host: str, port: int, servers: Sequence[tuple[str, int]]) -> str:
    lines = "\n".join(f"    server m{i + 1} {h}:{p}" for i, (h, p) in enumerate(servers))
    return HAPROXY.format(host=host, port=port, servers=lines)


def relay_config(
    urls: Sequence[str],
    balance: dict,
    port: int,
    store: Path,
    user_file: str | None = None,
) -> dict:
    """The relay's pool over `urls` (issue 32's configuration): one `[[upstream]]` per member,
    all serving the model "tiny", `parallel` = the members' `-np`. A request waits for a slot
    as long as it would in a llama-server's own queue (`pool_timeout_s`); `balance` (a
    target's `BALANCE`) over the `[balance]` defaults. `user_file` (TOML)
    is merged over it: its tables' keys win, its first `[[upstream]]`'s keys (less name and
    url) go to every member."""
    conf: dict = {
        "server": {"host": HOST, "port": port},
        "dispatcher": {"heartbeat_s": 0, "pool_timeout_s": 600.0},
        "balance": {
            "affinity": True,
            "epsilon": 0.25,
            "affinity_wait_s": 0.5,
            "home_wait_s": "auto",
            **balance,
        },
        "upstream": [
            {"name": f"m{i + 1}", "url": url, "models": [MODEL], "parallel": PARALLEL}
            for i, url in enumerate(urls)
        ],
        "store": {"path": str(store)},
    }
    if user_file:
        import tomllib

        with open(user_file, "rb") as f:
            user = tomllib.load(f)
        for key, val in user.items():
            if key == "upstream" and val:
                extra = {k: v for k, v in val[0].items() if k not in ("name", "url")}
                for member in conf["upstream"]:
                    member.update(extra)
            elif isinstance(val, dict):
                conf.setdefault(key, {}).update(val)
            else:
                conf[key] = val
    return conf


# -- processes --------------------------------------------------------------------------------


def llama_server_class():
    if str(procs.ROOT) not in sys.path:
        sys.path.insert(0, str(procs.ROOT))
    from tests.e2e.llama_server import LlamaServer

    return LlamaServer


def server_args(slots: int, slot_ctx: int, a) -> tuple[str, ...]:
    """A llama-server's flags (after tests/e2e/llama_server.py's defaults, which they
    override)."""
    return (
        "-c",
        str(slots * slot_ctx),
        "-np",
        str(slots),
        "-t",
        str(a.threads),
        "--metrics",
        "--cache-ram",
        str(a.cache_ram),
        *shlex.split(a.server_args),
    )


def slot_context(shape: Shape) -> int:
    """Tokens per slot: the longest conversation with a quarter to spare, and its reply."""
    need = shape.last_tokens * 1.25 + shape.max_tokens
    return int(math.ceil(need / 1024) * 1024)


class Servers:
    """The llama-servers of one run, started fresh (every target starts cold: empty slots,
    empty host caches, counters at zero) and stopped after it."""

    def __init__(self, count: int, args: tuple[str, ...], n_ctx_train: int, names: list[str]):
        cls = llama_server_class()
        self.names = names
        self.srvs = [cls(extra_args=args, model={"n_ctx_train": n_ctx_train}) for _ in range(count)]

    def start(self) -> None:
        for s in self.srvs:
            s.start()

    def addresses(self) -> list[tuple[str, int]]:
        return [(HOST, int(s.port)) for s in self.srvs]

    def member_of(self) -> dict[str, str]:
        """The `model` a server puts in its answers (its model file) -> the member's name."""
        return {str(s.model_path): n for s, n in zip(self.srvs, self.names)}

    def cpu_us(self) -> float:
        pids = [s.proc.pid for s in self.srvs if s.proc is not None]
        return sum(procs.cpu_us(p) for p in pids)

    def metrics(self) -> list[dict[str, float]]:
        return [parse_metrics(http_get(HOST, int(s.port), "/metrics")) for s in self.srvs]

    def stop(self) -> None:
        for s in self.srvs:
            try:
                s.cleanup()
            except Exception as e:  # keep stopping the others
                print(f"bench: stopping llama-server: {e!r}", file=sys.stderr)


def http_get(host: str, port: int, path: str, timeout: float = 10.0) -> str:
    import http.client

    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("GET", path)
        return c.getresponse().read().decode("utf-8", "replace")
    finally:
        c.close()


def http_post_json(host: str, port: int, path: str, body: dict, timeout: float = 60.0) -> dict:
    import http.client

    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        return json.loads(c.getresponse().read())
    finally:
        c.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value} for the unlabelled samples (llama-server's)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        parts = line.split()
        if len(parts) >= 2:
            try:
                out[parts[0].removeprefix("llamacpp:")] = float(parts[1])
            except ValueError:
                pass
    return out


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)),
        None,
    )


def haproxy_version() -> str:
    b = haproxy_binary()
    if not b:
        return "not found"
    out = subprocess.run([b, "-v"], capture_output=True, text=True)
    return (out.stdout or out.stderr).splitlines()[0].strip() if (out.stdout or out.stderr) else "?"


def start_proxy(target: str, servers: Servers, logdir: Path, a) -> procs.Proc:
    port = procs.free_port(HOST)
    addrs = servers.addresses()
    if target == "nginx":
        tmp = logdir / "nginx"
        conf = nginx.write_conf(
            tmp, HOST, port, HOST, 0, servers=addrs, keepalive=a.nginx_keepalive
        )
        p = procs.Proc("nginx", nginx.argv(tmp, conf), logdir)
    elif target == "haproxy":
        b = haproxy_binary()
        if not b:
            raise FileNotFoundError("haproxy: not found")
        conf = logdir / "haproxy.cfg"
        conf.write_text(haproxy_conf(HOST, port, addrs))
        p = procs.Proc("haproxy", [b, "-db", "-f", str(conf)], logdir)
    else:
        store = logdir / f"{target}.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{store}{suffix}").unlink(missing_ok=True)
        conf = logdir / f"{target}.toml"
        urls = [f"http://{h}:{p}" for h, p in addrs]
        conf.write_text(
            relay_conf.dumps(relay_config(urls, BALANCE[target], port, store, a.relay_config))
        )
        p = procs.Proc(
            target, [sys.executable, "-m", "relay", "serve", "--config", str(conf)], logdir
        )
        p.store = store
    p.port = port
    try:
        p.wait_http(HOST, port, "/health", timeout=30.0)
    except BaseException:
        p.stop()
        raise
    return p


def relay_rows(store: Path) -> dict:
    """The relay's rows per member: requests, prompt tokens and (when the column exists)
    cached tokens; the pools seen (when `pool` exists)."""
    import sqlite3

    if not store.exists():
        return {}
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        cols = {r[1] for r in db.execute("PRAGMA table_info(request)")}
        cached = "SUM(cached_tokens)" if "cached_tokens" in cols else "NULL"
        out: dict = {
            "per_member": {
                str(m): {"requests": n, "prompt_tokens": pt, "cached_tokens": ct}
                for m, n, pt, ct in db.execute(
                    f"SELECT upstream_served, COUNT(*), SUM(prompt_tokens), {cached}"
                    " FROM request WHERE path = '/v1/chat/completions' GROUP BY upstream_served"
                )
            }
        }
        if "pool" in cols:
            out["pools"] = sorted(
                str(p) for (p,) in db.execute("SELECT DISTINCT pool FROM request")
            )
        return out
    finally:
        db.close()


# -- the client -------------------------------------------------------------------------------


class _Capture(bload.Stream):
    """bench.load's stream reader, keeping the event bytes (for the reply and `timings`)."""

    def __init__(self, request: bytes, fut: asyncio.Future):
        super().__init__(request, fut)
        self.raw = bytearray()

    def _events(self, data: bytes):
        self.raw += data
        super()._events(data)


def _request(host: str, port: int, body: bytes) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _send(host: str, port: int, body: bytes, timeout: float) -> tuple[bload.Result, bytes]:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    s = _Capture(_request(host, port, body), fut)
    try:
        await asyncio.wait_for(loop.create_connection(lambda: s, host, port), timeout)
        r = await asyncio.wait_for(fut, timeout)
    except (TimeoutError, OSError) as e:
        if s.tr is not None:
            s.tr.abort()
        s.r.error = s.r.error or ("timeout" if isinstance(e, TimeoutError) else repr(e))
        r = s.r
    return r, bytes(s.raw)


async def replay(
    host: str,
    port: int,
    convs: Sequence[Conversation],
    max_tokens: int,
    timeout: float,
    member_of: dict[str, str],
) -> tuple[list[dict], list[tuple[int, int, bytes]]]:
    """Every conversation at once, each turn after the previous one's answer and its pause
    (`Shape.think_s`); the turns (one dict each) and (conversation, turn, body) in the order
    sent."""
    turns: list[dict] = []
    sent: list[tuple[int, int, bytes]] = []

    async def conversation(c: Conversation) -> None:
        replies: list[str] = []
        for k in range(len(c.users)):
            if k and c.pauses[k - 1] > 0:
                await asyncio.sleep(c.pauses[k - 1])
            body = json.dumps(c.body(k, replies, max_tokens), separators=(",", ":")).encode()
            sent.append((c.index, k, body))
            r, raw = await _send(host, port, body, timeout)
            out = read_stream(raw)
            tm = out.timings or {}
            error = r.error
            if error is None and not (r.finished and r.done and out.content and out.timings):
                error = f"incomplete answer: {bytes(r.sample[:160])!r}"
            turns.append(
                {
                    "conv": c.index,
                    "turn": k,
                    "ttft_ms": None if r.t_first is None else (r.t_first - r.t_sent) * 1e3,
                    "prompt_n": tm.get("prompt_n"),
                    "cache_n": tm.get("cache_n"),
                    "prompt_ms": tm.get("prompt_ms"),
                    "predicted_ms": tm.get("predicted_ms"),
                    "member": member_of.get(out.model or ""),
                    "reply": out.content,
                    "error": error,
                }
            )
            if error:
                return
            replies.append(out.content)

    await asyncio.gather(*(conversation(c) for c in convs))
    return turns, sent


def rescaled_bodies(
    sent: Sequence[tuple[int, int, bytes]],
    turns: Sequence[dict],
    shape: Shape,
    chars_per_token: float = REAL_CHARS_PER_TOKEN,
) -> list[bytes]:
    """The replay's bodies, in the order sent, with its conversations written at
    `chars_per_token` (the servers' replies kept): what the same prompts weigh in bytes under
    a real tokenizer, for the decision's cost."""
    convs = make_conversations(shape, chars_per_token)
    replies = {(t["conv"], t["turn"]): t["reply"] for t in turns}
    out = []
    for c, k, _ in sent:
        earlier = [replies[(c, j)] for j in range(k)]
        body = convs[c].body(k, earlier, shape.max_tokens)
        out.append(json.dumps(body, separators=(",", ":")).encode())
    return out


def synthetic_replay(
    shape: Shape, chars_per_token: float
) -> tuple[list[tuple[int, int, bytes]], list[dict]]:
    """The replay's bodies as sent (turn by turn, every conversation's turn k before any turn
    k + 1) with seeded words for the servers' replies, `max_tokens` long: the decision's
    inputs without a server (`--decision-only`)."""
    convs = make_conversations(shape, chars_per_token)
    rng = random.Random(f"{shape.seed}:replies")
    reply_chars = max(1, round(shape.max_tokens * chars_per_token))
    replies = {(c.index, k): words(rng, reply_chars) for c in convs for k in range(shape.turns)}
    sent, turns = [], []
    for k in range(shape.turns):
        for c in convs:
            body = c.body(k, [replies[(c.index, j)] for j in range(k)], shape.max_tokens)
            sent.append((c.index, k, json.dumps(body, separators=(",", ":")).encode()))
            turns.append({"conv": c.index, "turn": k, "reply": replies[(c.index, k)]})
    return sent, turns


def decision_only(a, shape: Shape) -> int:
    """`--decision-only`: the routing decision's cost on a synthetic replay, printed."""
    sent, turns = synthetic_replay(shape, a.chars_per_token)
    n = shape.conversations
    decision = {
        "replay": decision_cost([b for _, _, b in sent], a.decision_passes, n),
        "real_size": decision_cost(rescaled_bodies(sent, turns, shape), a.decision_passes, n),
        "chars_per_token": a.chars_per_token,
    }
    lines = ["# The routing decision alone (`python -m bench.fleet --decision-only`)", ""]
    lines += [*report.machine(), f"- commit: {_commit()}", ""]
    lines += [f"- {g.name}: {g.figure} -> **{_mark(g)}**" for g in decision_goals(decision)]
    lines += ["", *render_decision(decision)]
    text = "\n".join(lines) + "\n"
    if a.output:
        Path(a.output).write_text(text)
    print(text, end="")
    if a.json:
        Path(a.json).write_text(json.dumps(decision, indent=1))
    return 0


async def probe_prefill(host: str, port: int, convs: Sequence[Conversation], shape: Shape):
    """One request at a time on an idle server: conversation 0's first turn and conversation
    1's last (another system prompt: nothing cached), each cold. Prompt tokens, prefill ms
    and TTFT of each: what a turn costs with no wait."""
    out = []
    last = shape.turns - 1
    for c, k in ((convs[0], 0), (convs[1 % len(convs)], last)):
        body = c.body(k, ["Hello from a tiny llama."] * k, shape.max_tokens)
        r, raw = await _send(host, port, json.dumps(body).encode(), 600.0)
        tm = read_stream(raw).timings or {}
        out.append(
            {
                "tokens": (tm.get("prompt_n") or 0) + (tm.get("cache_n") or 0),
                "prompt_n": tm.get("prompt_n"),
                "prompt_ms": tm.get("prompt_ms"),
                "predicted_ms": tm.get("predicted_ms"),
                "ttft_ms": None if r.t_first is None else (r.t_first - r.t_sent) * 1e3,
            }
        )
    return out


def chars_per_token(host: str, port: int, seed: int) -> float:
    """The generator's characters per token of the server's tokenizer, on a 20 000-character
    sample."""
    sample = words(random.Random(f"{seed}:calibration"), 20000)
    tokens = http_post_json(host, port, "/tokenize", {"content": sample})["tokens"]
    return len(sample) / len(tokens)


# -- one run ----------------------------------------------------------------------------------


def run_target(target: str, rep: int, convs, shape: Shape, logdir: Path, a) -> dict:
    row: dict = {"target": target, "repeat": rep}
    onebox = target == "onebox"
    slot_ctx = slot_context(shape)
    slots = shape.conversations if onebox else PARALLEL
    names = ["one"] if onebox else [f"m{i + 1}" for i in range(MEMBERS)]
    servers = Servers(len(names), server_args(slots, slot_ctx, a), max(4096, slot_ctx), names)
    proxy = None
    try:
        servers.start()
        if onebox:
            port = servers.addresses()[0][1]
        else:
            try:
                proxy = start_proxy(target, servers, logdir, a)
            except (RuntimeError, TimeoutError, OSError) as e:
                why = str(e).strip().splitlines()
                return {**row, "skipped": f"{target} did not start: {' / '.join(why[-3:])}"[:600]}
            port = proxy.port
        m0, s0 = servers.metrics(), servers.cpu_us()
        x0 = proxy.cpu_us() if proxy else 0.0
        c0, b0, t0 = _self_cpu_us(), procs.system_busy_us(), time.monotonic()
        turns, sent = asyncio.run(
            replay(HOST, port, convs, shape.max_tokens, a.timeout, servers.member_of())
        )
        wall = time.monotonic() - t0
        busy, client = procs.system_busy_us() - b0, _self_cpu_us() - c0
        sv, px = servers.cpu_us() - s0, (proxy.cpu_us() if proxy else 0.0) - x0
        m1 = servers.metrics()
        delta = [{k: m1[i].get(k, 0.0) - m0[i].get(k, 0.0) for k in m1[i]} for i in range(len(m1))]
        loads = [round(d.get("tokens_predicted_total", 0.0) / shape.max_tokens) for d in delta]
        row.update(figures(turns, shape.turns, loads))
        row.update(
            members=names,
            metrics_processed=int(sum(d.get("prompt_tokens_total", 0.0) for d in delta)),
            wall_s=wall,
            cpu_s={"servers": sv / 1e6, "proxy": px / 1e6, "client": client / 1e6},
            other_cpu_frac=max(0.0, busy - sv - px - client) / (wall * 1e6 * (os.cpu_count() or 1)),
            turns=turns,
            error_samples=sorted({t["error"] for t in turns if t["error"]})[:3],
        )
        row["_sent"] = sent
        if proxy is not None and target in RELAY_TARGETS:
            text = http_get(HOST, port, "/metrics")
            row["relay_metrics"] = [
                ln
                for ln in text.splitlines()
                if not ln.startswith("#") and any(w in ln for w in ("pool", "hit", "cached"))
            ][:40]
    finally:
        if proxy is not None:
            proxy.stop()
            if target in RELAY_TARGETS:
                row["relay_rows"] = relay_rows(proxy.store)
            if target == "nginx":
                row["nginx_upstream_errors"] = nginx.upstream_errors(logdir / "nginx")
        servers.stop()
    return row


def _self_cpu_us() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return (ru.ru_utime + ru.ru_stime) * 1e6


def brief(row: dict) -> str:
    if "skipped" in row:
        return row["skipped"]
    return (
        f"hit {_f(row['hit_ratio'], 3)}, processed {row['processed']} (÷ ideal"
        f" {_f(row['over_ideal'], 2)}), follow-up TTFT p50 {_f(row['ttft_p50_ms'], 0)} ms"
        f" p99 {_f(row['ttft_p99_ms'], 0)} ms, loads {row['loads']}, moves {row['moves']},"
        f" errors {row['errors']}, {row['wall_s']:.0f} s"
    )


# -- the report -------------------------------------------------------------------------------


def _f(x, nd=1, suffix="") -> str:
    return "-" if x is None else f"{x:.{nd}f}{suffix}"


def _runs(rows, target):
    return sorted(
        (r for r in rows if r["target"] == target and "skipped" not in r),
        key=lambda r: r["repeat"],
    )


def _cell(runs, key, nd=1, scale=1.0) -> str:
    """**median** (each repeat)."""
    vals = [None if r.get(key) is None else r[key] * scale for r in runs]
    known = [v for v in vals if v is not None]
    if not known:
        return "-"
    each = ", ".join(_f(v, nd) for v in vals)
    return f"**{_f(statistics.median(known), nd)}** ({each})"


def medians(rows, targets) -> dict[str, dict]:
    keys = (
        "hit_ratio",
        "over_ideal",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "load_spread",
        "processed",
        "prefill_share_p50",
    )
    return {t: {k: median_of(_runs(rows, t), k) for k in keys} for t in targets if _runs(rows, t)}


def render(rows: list[dict], decision: dict | None, info: dict, a, targets) -> str:
    shape: Shape = info["shape"]
    out = ["# Fleet: three llama-servers behind one address (bench/fleet.py, issue 32)", ""]
    out += report.machine()
    out += [
        f"- haproxy: {haproxy_version()}",
        f"- commit: {info['commit']}",
        f"- llama-server: {info['build']}",
        f"- command: `{info['command']}`",
        f"- members: 3 llama-servers, each `{' '.join(info['member_args'])}` (slot context"
        f" {info['slot_ctx']} tokens); one box: `{' '.join(info['onebox_args'])}`; the model:"
        f" tests/e2e/tiny_gguf.py's, `n_ctx_train` {max(4096, info['slot_ctx'])}",
        f"- replay: {shape.conversations} conversations x {shape.turns} turns, all at once,"
        + (
            f" a pause before each later turn (exponential, mean {shape.think_s:g} s, the same"
            " pauses for every target),"
            if shape.think_s > 0
            else " each turn sent as the previous one ends,"
        )
        + f" streamed chat, `max_tokens` {shape.max_tokens}, seed {shape.seed}; planned"
        f" {shape.first_tokens} -> {shape.last_tokens} tokens, measured"
        f" {info.get('prompt_sizes', '-')}; {info['chars_per_token']:.3f} characters a token"
        " (`/tokenize`); a new client connection per request",
        "- cold start: every run restarts the llama-servers (empty slots and host cache,"
        " counters at zero) and starts a fresh proxy; target order rotates per repeat",
        f"- repeats: {a.repeat}",
        "",
    ]
    skipped = [r for r in rows if "skipped" in r]
    pending = sorted({r["target"] for r in skipped if r["target"] in RELAY_TARGETS})
    if pending:
        out += [
            f"**Relay targets pending**: {', '.join(pending)} did not start here (the relay's"
            " pools, issue 32 items 1-6, are not in this tree yet): " + skipped[0]["skipped"][:300],
            "",
        ]
    med = medians(rows, targets)
    out += ["## Goals (medians over repeats)", ""]
    judged = [t for t in AFFINITY_TARGETS if t in targets] or ["relay_affinity"]
    for g in [g for t in judged for g in target_goals(med, t)] + decision_goals(decision):
        out.append(f"- {g.name}: {g.figure} -> **{_mark(g)}**")
    out += [
        "",
        "## Per target: **median** (each repeat, in repeat order)",
        "",
        "| target | hit ratio | processed ÷ ideal | follow-up TTFT p50 ms | p99 ms |"
        " prefill share of TTFT | max ÷ mean load | moves |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in targets:
        runs = _runs(rows, t)
        if not runs:
            out.append(f"| {t} | not run | | | | | | |")
            continue
        out.append(
            f"| {t} | {_cell(runs, 'hit_ratio', 3)} | {_cell(runs, 'over_ideal', 2)} |"
            f" {_cell(runs, 'ttft_p50_ms', 0)} | {_cell(runs, 'ttft_p99_ms', 0)} |"
            f" {_cell(runs, 'prefill_share_p50', 2)} | {_cell(runs, 'load_spread', 2)} |"
            f" {_cell(runs, 'moves', 0)} |"
        )
    out += [
        "",
        "## Every run, in the order run",
        "",
        "| # | target | processed | ideal | /metrics | cached | hit | TTFT p50 / p99 ms |"
        " turn-1 TTFT p50 ms | prompt_ms p50 | TTFT − prompt_ms p50 / min | requests per member |"
        " moves | errors | wall s | CPU s servers / proxy / client | other CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):
        if "skipped" in r:
            out.append(f"| {i + 1} | {r['target']} (rep {r['repeat'] + 1}) | skipped |" + " |" * 14)
            continue
        cpu = r["cpu_s"]
        out.append(
            f"| {i + 1} | {r['target']} (rep {r['repeat'] + 1}) | {r['processed']} |"
            f" {r['ideal'] or '-'} | {r['metrics_processed']} | {r['cached']} |"
            f" {_f(r['hit_ratio'], 3)} | {_f(r['ttft_p50_ms'], 0)} / {_f(r['ttft_p99_ms'], 0)} |"
            f" {_f(r['first_ttft_p50_ms'], 0)} | {_f(r['prompt_ms_p50'], 0)} |"
            f" {_f(r['rest_p50_ms'], 0)} / {_f(r['rest_min_ms'], 0)} |"
            f" {' / '.join(map(str, r['loads']))} | {_f(r['moves'], 0)} | {r['errors']} |"
            f" {r['wall_s']:.0f} | {cpu['servers']:.0f} / {cpu['proxy']:.1f} /"
            f" {cpu['client']:.1f} | {r['other_cpu_frac']:.0%} |"
        )
    out += ["", "## The routing decision's cost", ""]
    out += render_decision(decision)
    out += ["", "## Checks", ""]
    mism = [
        f"{r['target']}/{r['repeat'] + 1}: {r['processed']} vs {r['metrics_processed']}"
        for r in rows
        if "skipped" not in r and r["processed"] != r["metrics_processed"]
    ]
    out.append(
        "- Σ `timings.prompt_n` of the answers = Σ `/metrics` `prompt_tokens_total` of the"
        " servers in every run" + ("" if not mism else ": NOT in " + "; ".join(mism))
    )
    ideals = sorted({r["ideal"] for r in rows if r.get("ideal")})
    out.append(
        "- the ideal (each conversation's final prompt, summed) is the same in every run: "
        + ("yes, " + str(ideals[0]) if len(ideals) == 1 else f"NO: {ideals}")
    )
    ng = [r.get("nginx_upstream_errors", 0) for r in rows if r["target"] == "nginx"]
    out.append(f"- nginx upstream errors logged (each retried on the next member): {sum(ng)}")
    for r in rows:
        if r.get("error_samples"):
            out.append(f"- {r['target']}/{r['repeat'] + 1} errors: {'; '.join(r['error_samples'])}")
        if r.get("relay_rows"):
            out.append(
                f"- {r['target']}/{r['repeat'] + 1} relay rows: {json.dumps(r['relay_rows'])}"
            )
    out += ["", "## Reading", ""] + info.get("notes", []) + [""]
    return "\n".join(out)


def render_decision(decision: dict | None) -> list[str]:
    if not decision:
        return ["Not measured (no run completed)."]
    r, w = decision["replay"], decision["real_size"]
    out = [
        f"In this process, on the replay's {r['bodies']} bodies in the order sent, each timed"
        f" {r['samples'] // r['bodies']} times over a `PrefixTable` a first pass filled"
        f" ({r['table_entries']} entries); then the same conversations written at"
        f" {REAL_CHARS_PER_TOKEN:g} characters a token (the servers' replies kept), what these"
        " prompts weigh under a real tokenizer (the tiny model's byte-fallback vocabulary reads"
        f" {decision.get('chars_per_token', 0):.2f} characters a token). µs p50 / p99 / max:",
        "",
        "| step | replay's bodies | at 4 characters a token |",
        "|---|---|---|",
        f"| body size, KiB (p50 / max) | {r['body_kb']['p50']:.1f} / {r['body_kb']['max']:.1f} |"
        f" {w['body_kb']['p50']:.1f} / {w['body_kb']['max']:.1f} |",
    ]
    for key, label in (
        ("decision_us", "**decision** = `want_of` (decode + fingerprint + first_key) + choose"),
        ("heavy_us", "decision, the largest bodies (each conversation's final turn)"),
        ("decode_us", "of it, the JSON decode of the body (timed apart)"),
        ("fingerprint_us", "of it, `prefix.fingerprint(Api.CHAT, body)` + `first_key` (apart)"),
        ("choose_us", "`affinity.choose` (3 members)"),
        ("record_us", "`PrefixTable.record` (after the answer; not in the decision)"),
    ):
        cells = [f"{d[key]['p50']:.1f} / {d[key]['p99']:.1f} / {d[key]['max']:.1f}" for d in (r, w)]
        out.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return out


def _notes(rows: list[dict], a, probe: list[dict]) -> list[str]:
    """What the figures say about the tiny model's prefill, in words with the figures."""
    ok = [r for r in rows if "skipped" not in r]
    if not ok:
        return []
    fixed = min((r["rest_min_ms"] for r in ok if r.get("rest_min_ms") is not None), default=None)
    own = ", ".join(
        f"{t} {_f(median_of(_runs(rows, t), 'prefill_share_p50'), 2)}"
        for t in dict.fromkeys(r["target"] for r in ok)
    )
    return [
        "- Prefill, not fixed costs, makes TTFT here. A follow-up turn's TTFT is its own"
        " prefill (`timings.prompt_ms`), the wait for a slot, and fixed costs (connections,"
        " the proxy, the first token); the fixed costs, the smallest TTFT − prompt_ms of any"
        f" follow-up (a turn that did not wait), are {_f(fixed, 1)} ms. The wait is other turns'"
        " prefill and decode. One request at a time on an idle member, cold: "
        + "; ".join(
            f"{p['tokens']} prompt tokens, TTFT {_f(p['ttft_ms'], 0)} ms of which prefill"
            f" {_f(p['prompt_ms'], 0)} ms, then {_f(p['predicted_ms'], 0)} ms for the"
            f" {a.max_tokens} tokens of decode"
            for p in probe
        )
        + " (attention grows with the context): a turn's work is mostly prefill. The median"
        f" follow-up's own prefill, as a share of its TTFT (the rest mostly the wait): {own}."
        " So the replay's long prompts, not a larger model, make prefill the cost, as a coding"
        " agent's are: the tiny model is kept.",
        f"- The members' host-memory prompt cache (`--cache-ram {a.cache_ram}` MiB) is"
        " llama-server's default 8192 MiB scaled by the tiny model's state per token (528"
        " bytes) against an 8B model's (128 KiB): a member holds some seven conversations at"
        " their longest, as a real box holds a handful. With the default, 8192 MiB, every"
        " member could hold every conversation of the replay (16 x some 4.3 MB), which no"
        " real box does with an 8B model's 16 x 1 GiB.",
        f"- nginx keeps {a.nginx_keepalive} idle upstream connections"
        + (
            " (a new one per request): llama-server closes its connection after a stream, and"
            " a pooled one reused just after that fails and sends the turn to the next member"
            " (see bench/fleet.py's docstring)."
            if not a.nginx_keepalive
            else "."
        )
        + " HAProxy keeps its default `http-reuse safe`: a client's first request never takes"
        " an idle server connection, and every turn here is a new client connection.",
        "- hit = cached ÷ (cached + processed) prompt tokens (`timings.cache_n`, `prompt_n`);"
        " processed ÷ ideal: 1.0 reads each prefix once (a little under it is possible: the"
        " reply's tokens are in the slot's cache, not in any prompt_n); moves: follow-up turns"
        " served by another member than the turn before; load: requests per member from its"
        " `/metrics` (`tokens_predicted_total` ÷ `max_tokens`). CPU is of the whole run; other"
        " CPU: the machine's busy time not used by the servers, the proxy or this process, a"
        " share of all cores (other jobs on a shared machine).",
    ]


# -- main -------------------------------------------------------------------------------------


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(procs.ROOT), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            # (the results the harness writes are no change to what ran)
            [
                "git",
                "-C",
                str(procs.ROOT),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                "relay",
                "bench",
                ":(exclude)bench/RESULTS*.md",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _build() -> str:
    try:
        from tests.e2e.build_llama_server import SDIST

        return f"pinned ({SDIST})"
    except ImportError:
        return "?"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n")[0])
    p.add_argument(
        "--targets", default=",".join(TARGETS), help="comma list of " + ",".join(TARGETS)
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--conversations", type=int, default=Shape.conversations)
    p.add_argument("--turns", type=int, default=Shape.turns)
    p.add_argument("--first-tokens", type=int, default=Shape.first_tokens)
    p.add_argument("--last-tokens", type=int, default=Shape.last_tokens)
    p.add_argument("--max-tokens", type=int, default=Shape.max_tokens)
    p.add_argument("--seed", type=int, default=Shape.seed)
    p.add_argument(
        "--think-s",
        type=float,
        default=Shape.think_s,
        help="mean pause before a conversation's next turn, s (exponential; 0: none)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="6 conversations x 3 turns, 500 -> 1500 tokens, 1 repeat",
    )
    p.add_argument("--threads", type=int, default=1, help="llama-server -t")
    p.add_argument(
        "--cache-ram", type=int, default=CACHE_RAM_MIB, help="llama-server --cache-ram (MiB)"
    )
    p.add_argument(
        "--nginx-keepalive",
        type=int,
        default=0,
        help="idle upstream connections nginx keeps (default 0: see the module's docstring)",
    )
    p.add_argument("--server-args", default="", help="more llama-server flags (all servers)")
    p.add_argument("--decision-passes", type=int, default=20)
    p.add_argument(
        "--decision-only",
        action="store_true",
        help="time the routing decision alone on a synthetic replay (no server)",
    )
    p.add_argument(
        "--chars-per-token",
        type=float,
        default=TINY_CHARS_PER_TOKEN,
        help="the replay's characters a token for --decision-only (the tiny model's)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--relay-config", help="TOML merged over the generated relay config")
    p.add_argument("--output", help="report file (default bench/RESULTS-fleet.md)")
    p.add_argument("--json", help="also write the raw per-run results here")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with child logs")
    a = p.parse_args(argv)
    if a.quick:
        a.conversations, a.turns, a.first_tokens, a.last_tokens = 6, 3, 500, 1500
        a.repeat = 1
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    procs.raise_nofile()
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise SystemExit(f"unknown target: {bad}")
    shape = Shape(
        a.conversations, a.turns, a.first_tokens, a.last_tokens, a.max_tokens, a.seed, a.think_s
    )
    if a.decision_only:
        return decision_only(a, shape)
    logdir = Path(tempfile.mkdtemp(prefix="relay-bench-fleet-"))
    slot_ctx = slot_context(shape)
    info: dict = {
        "shape": shape,
        "slot_ctx": slot_ctx,
        "member_args": server_args(PARALLEL, slot_ctx, a),
        "onebox_args": server_args(shape.conversations, slot_ctx, a),
        "commit": _commit(),
        "build": _build(),
        "command": "python -m bench.fleet " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    rows: list[dict] = []
    sent: list[tuple[int, int, bytes]] = []
    sent_turns: list[dict] = []
    decision = None
    try:
        probe = Servers(1, info["member_args"], max(4096, slot_ctx), ["probe"])
        try:
            probe.start()
            port = probe.addresses()[0][1]
            info["chars_per_token"] = chars_per_token(HOST, port, a.seed)
            convs = make_conversations(shape, info["chars_per_token"])
            info["probe"] = asyncio.run(probe_prefill(HOST, port, convs, shape))
        finally:
            probe.stop()
        for rep in range(a.repeat):
            k = rep % len(targets)
            for target in targets[k:] + targets[:k]:
                print(
                    f"bench: [{rep + 1}/{a.repeat}] fleet -> {target} ...",
                    file=sys.stderr,
                    flush=True,
                )
                row = run_target(target, rep, convs, shape, logdir, a)
                this = row.pop("_sent", None)
                if this and not sent and not row.get("errors"):
                    sent, sent_turns = this, row["turns"]
                rows.append(row)
                print("bench:   " + brief(row), file=sys.stderr, flush=True)
        if sent:
            n = shape.conversations
            decision = {
                "replay": decision_cost([b for _, _, b in sent], a.decision_passes, n),
                "real_size": decision_cost(
                    rescaled_bodies(sent, sent_turns, shape), a.decision_passes, n
                ),
                "chars_per_token": info["chars_per_token"],
            }
    except KeyboardInterrupt:
        print("bench: interrupted; stopping processes", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"bench: error: {e}\nbench: logs in {logdir}", file=sys.stderr)
        a.keep_logs = True
        if isinstance(e, (RuntimeError, TimeoutError, OSError)):
            return 2
        raise
    finally:
        procs.stop_all()
        if not a.keep_logs:
            shutil.rmtree(logdir, ignore_errors=True)
    done = [r for r in rows if "skipped" not in r]
    first = [
        t["prompt_n"] + t["cache_n"]
        for r in done
        for t in r["turns"]
        if t["turn"] == 0 and t["prompt_n"] is not None
    ]
    last = [
        t["prompt_n"] + t["cache_n"]
        for r in done
        for t in r["turns"]
        if t["turn"] == shape.turns - 1 and t["prompt_n"] is not None
    ]
    if first and last:
        info["prompt_sizes"] = (
            f"turn 1 {min(first)}-{max(first)} tokens, turn {shape.turns} {min(last)}-{max(last)}"
        )
    info["notes"] = _notes(rows, a, info.get("probe", []))
    text = render(rows, decision, info, a, targets)
    print(text)
    out = Path(a.output) if a.output else Path(__file__).parent / "RESULTS-fleet.md"
    out.write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "decision": decision}, indent=1))
    print(f"bench: wrote {out}", file=sys.stderr)
    return 1 if any(r.get("errors") for r in done) else 0


if __name__ == "__main__":
    raise SystemExit(main())

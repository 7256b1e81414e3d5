"""A pool of two REAL llama-servers (the reference build, the tiny deterministic model) behind
the relay (issue 32): a conversation's second turn lands on the server that served its first,
and that server's prompt cache shows it (`timings.cache_n` covers the whole first prompt, and
the row's `cached_tokens` says so); a second conversation started while the first is held
goes to the other server.

Each server has 2 slots of 8192 tokens (the model written with a long trained context): a
first turn asked for every token it can take streams for seconds, held until the client
closes it."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support import httpc
from tests.support.helpers import rows, wait_for
from tests.support.pools import Held, members

from .llama_server import start_or_fail
from .rawhttp import request

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
WAIT_S = 30.0
# What a coding agent sends first: a long system prompt, then a question.
SYSTEM = "You are a careful coding agent. Read the code before you answer. " * 24


@pytest.fixture(scope="module")
def servers():
    """Two reference llama-servers, 2 slots of 8192 tokens each."""
    started = []
    try:
        for _ in range(2):
            started.append(
                start_or_fail(model={"n_ctx_train": 32768}, extra_args=("-c", "16384", "-np", "2"))
            )
        yield started
    finally:
        for srv in started:
            srv.cleanup()


def first_turn(name: str, system: str = SYSTEM) -> list[dict]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Explain the parser of module {name}. " * 12},
    ]


async def prompt_tokens(srv, messages: list[dict]) -> int:
    """The tokens of the prompt `messages` make on `srv` (its template, its tokenizer)."""
    prompt = (await request(srv.port, "POST", "/apply-template", {"messages": messages})).json()
    tokens = (await request(srv.port, "POST", "/tokenize", {"content": prompt["prompt"]})).json()
    return len(tokens["tokens"])


def final_timings(raw: bytes) -> dict:
    """The `timings` of the last chat event of a (de-chunked) stream that has some."""
    found = [
        json.loads(line[6:])["timings"]
        for line in raw.split(b"\n")
        if line.startswith(b"data: {") and b'"timings"' in line
    ]
    assert found, raw[-500:]
    return found[-1]


def text_of(raw: bytes) -> str:
    """The content of a stream's events as far as they came (its last line may be cut)."""
    out = []
    for line in raw.split(b"\n")[:-1]:
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    return "".join(out)


async def test_a_second_turn_reuses_the_prompt_cache_of_its_server(servers, make_relay):
    app = await make_relay(upstreams=members(*(s.url for s in servers), parallel=2))
    by_name = dict(zip(("m0", "m1"), servers, strict=True))
    convs = {n: first_turn(n) for n in ("alpha", "beta")}
    helds: dict[str, Held] = {}
    try:
        # Alpha's first turn streams (every token its slot can take); beta's starts meanwhile.
        for n, messages in convs.items():
            body = {"model": "tiny", "messages": messages, "max_tokens": 100000, "stream": True}
            helds[n] = await Held(app.port, CHAT, body, f"{n}1").start(WAIT_S)
            assert helds[n].head is not None and helds[n].head.status == 200
            await wait_for(lambda: helds[n].received.count(b"data: ") >= 20, timeout=WAIT_S)  # noqa: B023
        assert helds["alpha"].streaming, "alpha's first turn ended too soon"
        said = {n: text_of(bytes(h.received)) for n, h in helds.items()}
        for h in helds.values():
            h.close()
        await wait_for(lambda: len(rows(app)) == 2, timeout=WAIT_S)
        home = {
            n: rows(app, "WHERE request_id = ?", (f"{n}1",))[0]["upstream_served"] for n in convs
        }
        assert sorted(home.values()) == ["m0", "m1"]
        await wait_for(
            lambda: all(up.slots.in_flight == 0 for up in app.upstreams.values()), timeout=WAIT_S
        )
        # A third conversation held on one of them, Z: the conversation living on Z sends its
        # second turn there all the same (Z holds 2, within ceil(1.25 x 2 / 2)), the other
        # member idle; the other conversation's once Z is idle again. (Another agent's: with
        # the same system prompt llama-server would give it the slot holding the most alike
        # prompt, and the conversation living there would find it gone.)
        other = first_turn("gamma", system="Review the diff and list its risks. " * 24)
        body = {"model": "tiny", "messages": other, "max_tokens": 100000}
        helds["gamma"] = await Held(app.port, CHAT, {**body, "stream": True}, "gamma1").start()
        await wait_for(lambda: helds["gamma"].received.count(b"data: ") >= 20, timeout=WAIT_S)
        z = next(up.name for up in app.upstreams.values() if up.slots.in_flight == 1)
        order = sorted(convs, key=lambda n: home[n] != z)
        # Each second turn: the first resent, the reply it got, a new question.
        for n in order:
            messages = convs[n]
            first = await prompt_tokens(by_name[home[n]], messages)
            messages += [
                {"role": "assistant", "content": said[n][:200]},
                {"role": "user", "content": "And the lexer?"},
            ]
            body = {"model": "tiny", "messages": messages, "max_tokens": 8, "stream": True}
            resp = await httpc.fetch(app.port, "POST", CHAT, body, {"X-Request-Id": f"{n}2"})
            assert resp.status == 200 and resp.complete
            timings = final_timings(resp.body)
            # The server that held the first turn read only what is new.
            assert timings["cache_n"] >= first, (timings, first)
            print(f"{n}: first turn {first} tokens; second turn on {home[n]}: {timings}")
            assert timings["prompt_n"] < timings["cache_n"] / 10
            await wait_for(
                lambda: rows(app, "WHERE request_id = ?", (f"{n}2",)),  # noqa: B023
                timeout=WAIT_S,
            )
            [row] = rows(app, "WHERE request_id = ?", (f"{n}2",))
            assert (row["upstream_served"], row["pool"], row["fallback_attempts"]) == (
                home[n],
                "tiny",
                0,
            )
            assert (row["cached_tokens"], row["prompt_tokens"]) == (
                timings["cache_n"],
                timings["cache_n"] + timings["prompt_n"],
            )
            if home[n] == z:
                helds["gamma"].close()
                await wait_for(lambda: app.upstreams[z].slots.in_flight == 0, timeout=WAIT_S)
    finally:
        for h in helds.values():
            h.close()
        await asyncio.sleep(0)

"""The simulator's prompt cache over real sockets: the reuse a follow-up turn reports on every
API (timings, usage), the prefill time it spares, the slot each conversation keeps, /slots, and
generations beyond the slots (run at once without a slot, or deferred)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from relay.sim.server import Simulator
from tests.support.helpers import LOOP_EARLY_MS, wait_for
from tests.support.sim_client import Client, T, events, stream

ASK = "Hi there, how are you today?"  # 28 characters: 7 tokens
REPLY6 = "Hello from a tiny llama."  # the model's first 6 tokens on a chat route
THEN = "And then?"  # 2 tokens
CHAT1 = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 6}
CHAT2 = {
    "messages": [
        *CHAT1["messages"],
        {"role": "assistant", "content": REPLY6},
        {"role": "user", "content": THEN},
    ],
    "max_tokens": 6,
}


async def post(sim, path: str, body: dict) -> dict:
    c = await Client.connect(sim)
    await c.send("POST", path, body)
    status, h = await c.head()
    out = json.loads(await c.body(h))
    c.close()
    assert status == 200, out
    return out


async def sse(sim, path: str, body: dict) -> list[dict]:
    """The JSON of every ``data:`` event of a stream (named events too)."""
    c, status, _ = await stream(sim, path, {**body, "stream": True})
    assert status == 200
    out = []
    for chunk in await c.chunks():
        for ev in events(chunk):
            data = ev.split(b"data: ", 1)[1][:-2]
            if data != b"[DONE]":
                out.append(json.loads(data))
    c.close()
    return out


def cache(tm: dict) -> tuple[int, int]:
    return tm["cache_n"], tm["prompt_n"]


async def test_a_follow_up_chat_turn_reuses_the_prompt_and_the_reply(sim):
    first = await post(sim, "/v1/chat/completions", CHAT1)
    assert first["choices"][0]["message"]["content"] == REPLY6
    assert cache(first["timings"]) == (0, 7)
    assert first["usage"]["prompt_tokens"] == 7
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # 7 + 6 + 2 tokens; the slot holds the prompt and the reply but its last token: 7 + 5
    second = await post(sim, "/v1/chat/completions", CHAT2)
    assert cache(second["timings"]) == (12, 3)
    assert second["usage"]["prompt_tokens"] == 15
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 12}
    # streamed, with usage: the same figures in the last events; the slot now holds 15 + 5,
    # the prompt is 15 + 6 + 1 ("More?")
    third = {**CHAT2, "messages": [*CHAT2["messages"], {"role": "assistant", "content": REPLY6}]}
    third["messages"].append({"role": "user", "content": "More?"})
    evs = await sse(
        sim, "/v1/chat/completions", {**third, "stream_options": {"include_usage": True}}
    )
    assert cache(evs[-1]["timings"]) == (20, 2)
    assert evs[-1]["usage"]["prompt_tokens"] == 22
    assert evs[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 20}
    assert sim.prompt_tokens_total == 7 + 3 + 2 and sim.prompt_tokens_cached_total == 12 + 20
    c = await Client.connect(sim)
    await c.send("GET", "/metrics")
    _, h = await c.head()
    text = (await c.body(h)).decode()
    assert "\nllamacpp:prompt_tokens_total 12\n" in text
    assert "\nllamacpp:prompt_tokens_cached_total 32\n" in text


async def test_a_repeated_prompt_reuses_all_but_its_last_token(sim):
    await post(sim, "/v1/chat/completions", CHAT1)
    again = await post(sim, "/v1/chat/completions", CHAT1)
    assert cache(again["timings"]) == (6, 1)
    # unless the request turns the cache off, as llama-server's cache_prompt does
    off = await post(sim, "/v1/chat/completions", {**CHAT1, "cache_prompt": False})
    assert cache(off["timings"]) == (0, 7)


async def test_messages_report_the_reuse_as_llama_server_does(sim):
    # system "Be brief." 2 tokens, the question 7: 9
    m1 = {"model": "tiny", "max_tokens": 6, "system": "Be brief.", "messages": CHAT1["messages"]}
    evs = await sse(sim, "/v1/messages", m1)
    assert evs[0]["message"]["usage"] == {
        "cache_read_input_tokens": 0,
        "input_tokens": 9,
        "output_tokens": 0,
    }
    reply = {"role": "assistant", "content": [{"type": "text", "text": REPLY6}]}
    m2 = {**m1, "messages": [*m1["messages"], reply, {"role": "user", "content": THEN}]}
    # input_tokens is the prompt less what the cache read: 9 + 6 + 2 - (9 + 5)
    body = await post(sim, "/v1/messages", m2)
    assert body["usage"] == {"cache_read_input_tokens": 14, "input_tokens": 3, "output_tokens": 6}
    evs = await sse(sim, "/v1/messages", m2)
    assert evs[0]["message"]["usage"] == {
        "cache_read_input_tokens": 16,
        "input_tokens": 1,
        "output_tokens": 0,
    }


async def test_responses_report_the_reuse(sim):
    r1 = {"model": "tiny", "max_output_tokens": 6, "instructions": "Be brief.", "input": ASK}
    first = await post(sim, "/v1/responses", r1)
    assert first["usage"]["input_tokens"] == 9
    assert first["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    out = first["output"][0]
    r2 = {
        **r1,
        "input": [
            {"role": "user", "content": ASK},
            {"type": "message", "role": "assistant", "content": out["content"]},
            {"role": "user", "content": THEN},
        ],
    }
    evs = await sse(sim, "/v1/responses", r2)
    done = evs[-1]
    assert done["type"] == "response.completed"
    assert done["response"]["usage"]["input_tokens"] == 17
    assert done["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 14}
    assert cache(done["timings"]) == (14, 3)


async def test_completion_prefixes(sim):
    # "abcd" x 10: 10 tokens; the slot then holds them and 2 of the 3 generated
    first = await post(sim, "/completion", {"prompt": "abcd" * 10, "n_predict": 3})
    assert cache(first["timings"]) == (0, 10)
    assert (first["tokens_evaluated"], first["tokens_cached"]) == (10, 12)
    longer = {"prompt": "abcd" * 10 + "wxyz" * 5, "n_predict": 3}
    second = await post(sim, "/completion", longer)
    assert cache(second["timings"]) == (10, 5) and second["id_slot"] == first["id_slot"]
    assert (second["tokens_evaluated"], second["tokens_cached"]) == (15, 17)
    evs = await sse(sim, "/completion", longer)
    assert cache(evs[-1]["timings"]) == (14, 1) and evs[-1]["tokens_evaluated"] == 15
    # /v1/completions reads the same prompt tokens
    text = await post(sim, "/v1/completions", {"prompt": "abcd" * 10, "max_tokens": 2})
    assert cache(text["timings"]) == (9, 1)
    assert text["usage"]["prompt_tokens"] == 10
    assert text["usage"]["prompt_tokens_details"] == {"cached_tokens": 9}
    # a token list: its ids as given
    await post(sim, "/completion", {"prompt": [5, 6, 7, 8], "n_predict": 2})
    toks = await post(sim, "/completion", {"prompt": [5, 6, 7, 8, 9], "n_predict": 2})
    assert cache(toks["timings"]) == (4, 1)


async def ttft(sim, body: dict) -> tuple[float, dict]:
    """Seconds from sending a /completion stream to its first token, and its last event."""
    c = await Client.connect(sim)
    t0 = time.monotonic()
    await c.send("POST", "/completion", {**body, "stream": True})
    await c.head()
    first = await c.chunk()
    took = time.monotonic() - t0
    assert first is not None and b'"content":" Hello"' in first
    last = json.loads(events((await c.chunks())[-1])[-1][6:])
    c.close()
    return took, last


async def test_the_first_token_waits_for_the_prompt_not_reused(sim):
    # 25 tokens at 40 ms: 1 s before the first token; repeated, 1 token: 40 ms
    per = 40.0
    body = {"prompt": "abcd" * 25, "n_predict": 3, "sim": {"prefill_ms_per_token": per}}
    cold, last = await ttft(sim, body)
    assert cold * 1000 >= 25 * per - LOOP_EARLY_MS
    assert cache(last["timings"]) == (0, 25) and last["timings"]["prompt_ms"] == 25 * per
    warm, last = await ttft(sim, body)
    assert per - LOOP_EARLY_MS <= warm * 1000 < 25 * per
    assert cache(last["timings"]) == (24, 1) and last["timings"]["prompt_ms"] == per
    # the server-wide default, and a body that is not streamed
    sim.defaults.prefill_ms_per_token = per
    c = await Client.connect(sim)
    t0 = time.monotonic()
    await c.send("POST", "/completion", {"prompt": "wxyz" * 25, "n_predict": 3})
    await c.head()
    assert (time.monotonic() - t0) * 1000 >= 25 * per - LOOP_EARLY_MS
    c.close()


def slot_of(sim) -> int:
    return sim.requests[-1].lease.slot.id


async def test_two_conversations_keep_their_slots_and_a_third_evicts_the_oldest(sim):
    def turn(opening: str, n: int) -> dict:
        msgs = [{"role": "user", "content": opening}]
        for _ in range(n - 1):
            msgs += [
                {"role": "assistant", "content": "Hello from a"},
                {"role": "user", "content": THEN},
            ]
        return {"messages": msgs, "max_tokens": 3}

    alpha, bravo, charlie = "Alpha asks first here.", "Bravo asks next, here.", "Charlie asks last!"
    a1 = await post(sim, "/v1/chat/completions", turn(alpha, 1))
    # a fresh server's least recently used slot is its last
    assert slot_of(sim) == 1 and cache(a1["timings"]) == (0, 5)
    b1 = await post(sim, "/v1/chat/completions", turn(bravo, 1))
    assert slot_of(sim) == 0 and cache(b1["timings"]) == (0, 5)
    # each follow-up goes where its prefix is: 5 + 2 of the 3 generated
    a2 = await post(sim, "/v1/chat/completions", turn(alpha, 2))
    assert slot_of(sim) == 1 and cache(a2["timings"]) == (7, 3)
    b2 = await post(sim, "/v1/chat/completions", turn(bravo, 2))
    assert slot_of(sim) == 0 and cache(b2["timings"]) == (7, 3)
    # a new conversation takes the least recently used slot, alpha's
    c1 = await post(sim, "/v1/chat/completions", turn(charlie, 1))
    assert slot_of(sim) == 1 and cache(c1["timings"]) == (0, 4)
    # alpha's prefix is nowhere now: it takes the least recently used, bravo's
    a3 = await post(sim, "/v1/chat/completions", turn(alpha, 3))
    assert slot_of(sim) == 0 and cache(a3["timings"]) == (0, 15)
    # bravo's prefix went with it; charlie's stays
    assert cache((await post(sim, "/v1/chat/completions", turn(charlie, 2)))["timings"]) == (6, 3)


async def test_similarity_threshold_and_least_recently_used_only(sim):
    # two prompts of 20 tokens sharing 2 (0.1, not above llama-server's 0.1)
    base = "abcd" * 2
    await post(sim, "/completion", {"prompt": base + "efgh" * 18, "n_predict": 1})
    assert slot_of(sim) == 1
    await post(sim, "/completion", {"prompt": base + "ijkl" * 18, "n_predict": 1})
    assert slot_of(sim) == 0
    # sharing 3 of 20 (0.15), it goes to the slot that holds them, not the oldest
    shares3 = {"prompt": base + "ijkl" + "mnop" * 17, "n_predict": 1}
    assert cache((await post(sim, "/completion", shares3))["timings"]) == (3, 17)
    assert slot_of(sim) == 0
    # threshold 0: the least recently used, even for a repeated prompt
    sim.slot_prompt_similarity = 0.0
    again = await post(sim, "/completion", shares3)
    assert slot_of(sim) == 1 and cache(again["timings"]) == (2, 18)


async def get_json(sim, path: str):
    c = await Client.connect(sim)
    await c.send("GET", path)
    _, h = await c.head()
    out = await c.body(h)
    c.close()
    return json.loads(out) if path != "/metrics" else out.decode()


async def test_slots_show_each_slots_task_and_cache(sim):
    # a fresh slot: llama-server's four fields only
    assert await get_json(sim, "/slots") == [
        {"id": 0, "n_ctx": 2048, "speculative": False, "is_processing": False},
        {"id": 1, "n_ctx": 2048, "speculative": False, "is_processing": False},
    ]
    await post(sim, "/completion", {"prompt": "abcd" * 10, "n_predict": 3})
    body = {"prompt": "abcd" * 10 + "wxyz" * 2, "n_predict": 50, "sim": {"stall_after": 4}}
    c, _, _ = await stream(sim, "/completion", {**body, "stream": True})
    await wait_for(lambda: sim.requests[-1].tokens_sent == 4, T)
    held, done = await get_json(sim, "/slots")
    assert held == {"id": 0, "n_ctx": 2048, "speculative": False, "is_processing": False}
    assert done == {
        "id": 1,
        "n_ctx": 2048,
        "speculative": False,
        "is_processing": True,
        "id_task": 1,
        "n_prompt_tokens": 12,
        "n_prompt_tokens_processed": 2,
        "n_prompt_tokens_cache": 10,
        "next_token": [
            {"has_next_token": True, "has_new_line": False, "n_remain": 46, "n_decoded": 4}
        ],
    }
    c.close()
    await asyncio.wait_for(sim.requests[-2].closed.wait(), T)
    # released: the cache holds the prompt and the tokens sent but the last, 12 + 3
    _, after = await get_json(sim, "/slots")
    assert after["is_processing"] is False and after["n_prompt_tokens"] == 15
    assert (after["id_task"], after["n_prompt_tokens_processed"]) == (1, 0)
    assert after["next_token"] == [
        {"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}
    ]


HOLD = {"n_predict": 50, "sim": {"stall_after": 1}, "stream": True}
WAIT_KNOBS = {"stall_after": 1, "head_delay_ms": 300}


async def held_stream(sim, prompt: str):
    """A stream that sends one token and holds its slot until closed."""
    c, status, _ = await stream(sim, "/completion", {**HOLD, "prompt": prompt})
    assert status == 200 and await c.chunk()
    return c


async def test_beyond_the_slots_a_generation_runs_at_once_without_one(sim):
    held = [await held_stream(sim, p * 4) for p in ("aaaa", "bbbb", "cccc")]
    assert [r.lease.slot.id if r.lease.slot else None for r in sim.requests] == [1, 0, None]
    metrics = await get_json(sim, "/metrics")
    assert "\nllamacpp:requests_processing 2\n" in metrics
    assert "\nllamacpp:requests_deferred 1\n" in metrics
    for c in held:
        c.close()
    await wait_for(lambda: all(r.closed.is_set() for r in sim.requests), T)
    # the two slots kept their prompts; the third left nothing
    a = await post(sim, "/completion", {"prompt": "aaaa" * 4, "n_predict": 1})
    c = await post(sim, "/completion", {"prompt": "cccc" * 4, "n_predict": 1})
    assert cache(a["timings"]) == (3, 1) and cache(c["timings"]) == (0, 4)


async def test_with_defer_a_generation_waits_for_a_slot_first_come_first_served(sim):
    sim.defer = True
    held = [await held_stream(sim, p * 4) for p in ("aaaa", "bbbb")]
    waiting = []
    for p in ("cccc", "dddd"):
        c = await Client.connect(sim)
        await c.send("POST", "/completion", {**HOLD, "prompt": p * 4, "sim": WAIT_KNOBS})
        waiting.append(c)
    await wait_for(lambda: sim.waiting == 2, T)
    metrics = await get_json(sim, "/metrics")
    assert "\nllamacpp:requests_processing 2\n" in metrics
    assert "\nllamacpp:requests_deferred 2\n" in metrics
    assert await waiting[0].silent() and sim.requests[2].lease is None
    # a slot frees: the oldest waiting takes it, its head delay counted from then
    freed = time.monotonic()
    held[0].close()
    status, _ = await waiting[0].head()
    assert (time.monotonic() - freed) * 1000 >= 300 - LOOP_EARLY_MS
    assert status == 200 and await waiting[0].chunk()
    third = sim.requests[2]
    assert third.lease.slot.id == 1 and sim.waiting == 1 and sim.requests[3].lease is None
    # a waiting client that leaves, leaves the queue
    waiting[1].close()
    await wait_for(lambda: sim.waiting == 0, T)
    for c in (held[1], waiting[0]):
        c.close()
    await wait_for(lambda: sim.active_generations == 0, T)


def test_the_command_line_sets_the_slots_and_the_prefill():
    code = (
        "from relay.sim.cli import main; raise SystemExit(main(['--port', '0', '--parallel', '3',"
        " '--prefill-ms-per-token', '2.5', '--slot-prompt-similarity', '0.5', '--defer']))"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(p.stdout.readline())["port"]

        async def go():
            sim = Simulator(port=port)
            props = await get_json(sim, "/props")
            slots = await get_json(sim, "/slots")
            last = await post(sim, "/completion", {"prompt": "abcd" * 4, "n_predict": 1})
            return props, slots, last

        props, slots, last = asyncio.run(go())
        assert props["total_slots"] == 3 and [s["id"] for s in slots] == [0, 1, 2]
        assert last["timings"]["prompt_ms"] == 4 * 2.5 and last["id_slot"] == 2
    finally:
        p.kill()
        p.wait()


async def test_a_tool_call_conversation_on_messages(sim):
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    m1 = {"model": "t", "max_tokens": 50, "tools": tools, "messages": CHAT1["messages"]}
    evs = await sse(sim, "/v1/messages", {**m1, "sim": {"tool_call": True}})
    read = evs[0]["message"]["usage"]["input_tokens"]
    assert evs[-2]["delta"]["stop_reason"] == "tool_use"
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
    m2 = {
        **m1,
        "messages": [
            *m1["messages"],
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ],
    }
    # the call is 5 tokens (its name, then '{"city":"Paris"}'), 4 of them kept; the result 1
    body = await post(sim, "/v1/messages", m2)
    assert body["usage"]["cache_read_input_tokens"] == read + 4
    assert body["usage"]["input_tokens"] == 2

"""The simulator's prompt cache, its rules without sockets: which slot a prompt takes, what its
cache spares, and the tokens the chat template makes of a conversation (a reply kept in a slot
is the start of its next turn)."""

from __future__ import annotations

from relay.sim import tinymodel as TM
from relay.sim.plan import make_plan, prompt_tokens, reply_tokens
from relay.sim.slots import Slot, choose, common_prefix, reuse
from relay.sim.state import SimDefaults
from relay.sim.wire import Kind

ASK = "Hi there, how are you today?"  # 28 characters: 7 tokens
REPLY6 = "Hello from a tiny llama."  # the model's first 6 tokens on a chat route


def slots(*caches: list[int], used: tuple[int, ...] = ()) -> list[Slot]:
    out = [Slot(i, list(c)) for i, c in enumerate(caches)]
    for s, t in zip(out, used, strict=False):
        s.last_used = t
    return out


def test_a_fresh_server_takes_its_last_slot_then_the_least_recently_used():
    fresh = slots([], [], [])
    assert choose(fresh, [1, 2, 3], 0.1) is fresh[2]
    used = slots([], [], [], used=(5, 3, 3))
    # of equally old slots the last, as llama-server's `<=`
    assert choose(used, [1, 2, 3], 0.1) is used[2]
    used[2].busy = True
    assert choose(used, [1, 2, 3], 0.1) is used[1]
    for s in used:
        s.busy = True
    assert choose(used, [1, 2, 3], 0.1) is None


def test_the_most_similar_free_slot_above_the_threshold():
    prompt = list(range(20))
    # slot 0 shares 2 of 20 (0.1, not above the threshold), slot 1 is the least recently used
    two = slots(prompt[:2] + [99], [7], used=(1, 0))
    assert choose(two, prompt, 0.1) is two[1]
    # sharing 3 of 20 (0.15) it is chosen, the least recently used or not
    three = slots(prompt[:3] + [99], [7], used=(1, 0))
    assert choose(three, prompt, 0.1) is three[0]
    # the larger share wins; a busy slot is not looked at
    best = slots(prompt[:5], prompt[:9], prompt[:15], used=(0, 1, 2))
    assert choose(best, prompt, 0.1) is best[2]
    best[2].busy = True
    assert choose(best, prompt, 0.1) is best[1]
    # threshold 0: least recently used only
    assert choose(best, prompt, 0.0) is best[0]


def test_reuse_is_the_common_prefix_but_never_the_last_prompt_token():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0
    assert reuse([1, 2, 3, 4, 5], [1, 2, 3, 9]) == 3
    # a repeated prompt of n tokens: n - 1 (llama-server evaluates the last one again)
    assert reuse([1, 2, 3, 4], [1, 2, 3, 4]) == 3
    assert reuse([1, 2, 3, 4, 7, 8], [1, 2, 3, 4]) == 3
    assert reuse([], [1, 2]) == 0 and reuse([1], [1]) == 0


def test_text_tokens_a_token_per_4_characters():
    assert len(TM.text_tokens("abcdefgh")) == 2 and len(TM.text_tokens("abc")) == 1
    assert TM.text_tokens("") == [] and len(TM.text_tokens("abcdefghijk")) == 2
    # a prefix at every multiple of 4 characters but the text's last token
    short, long = TM.text_tokens("abcdefghij"), TM.text_tokens("abcdefghijklmnop")
    assert common_prefix(short, long) == 1
    assert TM.text_tokens("abcdefgh") == TM.text_tokens("abcdefghijklmnop")[:2]
    # distinct pieces, distinct tokens (no sum of bytes)
    assert TM.text_tokens("abdc") != TM.text_tokens("abcd")
    # the model's own words, in an assistant's text, as it generated them
    assert TM.text_tokens(REPLY6, own=True) == [300, 368, 369, 372, 375, 31]
    assert TM.text_tokens(REPLY6) != [300, 368, 369, 372, 375, 31]


def test_a_turn_is_its_text_with_its_role_on_the_first_token():
    user = TM.template_tokens([TM.Turn("user", (TM.Part(TM.PartKind.TEXT, ASK),))])
    assert len(user) == 7
    mine = TM.template_tokens([TM.Turn("assistant", (TM.Part(TM.PartKind.TEXT, ASK),))])
    assert len(mine) == 7 and mine[0] != user[0] and mine[1:] == user[1:]
    assert TM.template_tokens([]) == [TM.BOS_ID]
    empty = TM.template_tokens([TM.Turn("user", ()), TM.Turn("assistant", ())])
    assert len(empty) == 2 and empty[0] != empty[1]


def test_what_the_model_reads_per_api():
    chat = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]
    }
    assert len(prompt_tokens(Kind.CHAT, chat)) == 2 + 7
    # a string and one text block spelling it are the same, cache_control not read
    blocks = [{"type": "text", "text": ASK, "cache_control": {"type": "ephemeral"}}]
    msgs = {"system": "Be brief.", "messages": [{"role": "user", "content": blocks}]}
    assert prompt_tokens(Kind.MESSAGES, msgs) == prompt_tokens(Kind.CHAT, chat)
    resp = {"instructions": "Be brief.", "input": ASK}
    assert prompt_tokens(Kind.RESPONSES, resp) == prompt_tokens(Kind.CHAT, chat)
    # an image is one token, its digest: another image another token
    img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    other = {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}
    with_img = {"messages": [{"role": "user", "content": [{"type": "text", "text": ASK}, img]}]}
    with_other = {"messages": [{"role": "user", "content": [{"type": "text", "text": ASK}, other]}]}
    a, b = prompt_tokens(Kind.CHAT, with_img), prompt_tokens(Kind.CHAT, with_other)
    assert len(a) == len(b) == 8 and a[:7] == b[:7] and a[7] != b[7]
    # tool definitions are read, before the messages
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with_tools = prompt_tokens(Kind.CHAT, {**chat, "tools": tools})
    assert len(with_tools) > 9 and with_tools[-7:] == prompt_tokens(Kind.CHAT, chat)[-7:]
    # raw prompts: a string's text, a list's token ids as given
    assert len(prompt_tokens(Kind.NATIVE, {"prompt": "abcd" * 10})) == 10
    assert prompt_tokens(Kind.TEXT, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_tokens(Kind.NATIVE, {"prompt": ""}) == [TM.BOS_ID]


def test_a_reply_kept_in_a_slot_starts_the_next_turns_assistant_message():
    turn1 = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 6}
    p1 = make_plan(Kind.CHAT, turn1, SimDefaults())
    assert (p1.prompt_n, p1.predicted_n) == (7, 6)
    # the slot keeps the prompt and the reply but its last token
    kept = p1.tokens + reply_tokens(p1, 6)[:5]
    turn2 = {
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": REPLY6},
            {"role": "user", "content": "And then?"},
        ]
    }
    t2 = prompt_tokens(Kind.CHAT, turn2)
    assert len(t2) == 7 + 6 + 2 and reuse(kept, t2) == 7 + 5
    # a stop word's token is the last generated: the text before it is kept whole
    stop = make_plan(Kind.CHAT, {**turn1, "stop": ["llama"]}, SimDefaults())
    assert (stop.n, stop.predicted_n) == (4, 5)
    kept = stop.tokens + reply_tokens(stop, 5)[:4]
    turn2["messages"][1]["content"] = "Hello from a tiny"
    assert reuse(kept, prompt_tokens(Kind.CHAT, turn2)) == 7 + 4


def test_a_tool_call_kept_in_a_slot_starts_the_next_turn():
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    turn1 = {
        "max_tokens": 50,
        "tools": tools,
        "messages": [{"role": "user", "content": ASK}],
        "sim": {"tool_call": True},
    }
    p1 = make_plan(Kind.MESSAGES, turn1, SimDefaults())
    # '{"', 'city', '": "', 'Paris', '"}'
    assert p1.predicted_n == 5
    kept = p1.tokens + reply_tokens(p1, 5)[:4]
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
    turn2 = {
        **turn1,
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ],
    }
    t2 = prompt_tokens(Kind.MESSAGES, turn2)
    # the call: its name a token, then '{"city":"Paris"}' (16 characters); the result a token
    assert len(t2) == p1.prompt_n + 1 + 4 + 1
    assert reuse(kept, t2) == p1.prompt_n + 4


def test_the_text_routes_keep_the_ids_generated():
    p = make_plan(Kind.NATIVE, {"prompt": "abcd" * 10, "n_predict": 3}, SimDefaults())
    assert reply_tokens(p, 3) == [364, 368, 369]
    # an EOS ends the reply: the text before it is kept whole
    eos = make_plan(Kind.NATIVE, {"prompt": "abcd", "sim": {"tokens": 2}}, SimDefaults())
    assert eos.predicted_n == 3 and reply_tokens(eos, 3) == [364, 368, TM.EOS_ID]

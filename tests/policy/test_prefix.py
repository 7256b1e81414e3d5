"""What the model reads of a request, as cumulative prefix hashes (issue 32, item 3): pure."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from xxhash import xxh3_64_intdigest

from relay.policy import prefix as P
from relay.stream.dialect import Api

ROOT = Path(__file__).resolve().parents[2]


def shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading hashes two fingerprints have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reparsed(body: dict) -> dict:
    """The body as another client would send it: keys reversed at every level, spaced."""

    def flip(v):
        if isinstance(v, dict):
            return {k: flip(v[k]) for k in reversed(list(v))}
        if isinstance(v, list):
            return [flip(x) for x in v]
        return v

    return json.loads(json.dumps(flip(body), indent=3, separators=(" ,  ", " :  ")))


# Chat --------------------------------------------------------------------------------------

CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def chat_turn1() -> dict:
    return {
        "model": "m",
        "stream": True,
        "tools": copy.deepcopy(CHAT_TOOLS),
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Read main.py"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "main.py"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "print('hi')"},
        ],
    }


def chat_turn2() -> dict:
    body = chat_turn1()
    body["messages"] += [
        {"role": "assistant", "content": "It prints hi."},
        {"role": "user", "content": [{"type": "text", "text": "Now make it print bye"}]},
    ]
    return body


def test_chat_units_and_follow_up():
    one = P.fingerprint(Api.CHAT, chat_turn1())
    two = P.fingerprint(Api.CHAT, chat_turn2())
    # The head (tools + system), user, assistant with its call, tool result.
    assert len(one) == 4
    assert len(two) == 6
    assert shared(one, two) == 4
    assert len(set(two)) == 6
    assert all(0 <= h < 1 << 64 for h in two)


def test_chat_key_order_and_whitespace_change_nothing():
    assert P.fingerprint(Api.CHAT, reparsed(chat_turn2())) == P.fingerprint(Api.CHAT, chat_turn2())


def test_chat_string_and_text_parts_are_one_unit():
    a = {"messages": [{"role": "user", "content": "hello world"}]}
    b = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}],
            }
        ]
    }
    assert P.fingerprint(Api.CHAT, a) == P.fingerprint(Api.CHAT, b)


def user(content: object) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # Text on either side of an image is not the same text moved across it.
        (
            [{"type": "text", "text": "ab"}, IMAGE, {"type": "text", "text": "c"}],
            [{"type": "text", "text": "a"}, IMAGE, {"type": "text", "text": "bc"}],
        ),
        # A number, or a list of it, is not the text of it.
        (3, "3"),
        ([3], "3"),
        # Text that spells JSON is text.
        ("[3]", [3]),
        ('"x"', "x"),
        # An image before the text is not the text before the image.
        ([IMAGE, {"type": "text", "text": "x"}], [{"type": "text", "text": "x"}, IMAGE]),
        # The same letter composed another way is other tokens.
        ("é", "e\u0301"),
    ],
)
def test_chat_units_tell_apart_what_the_model_reads_apart(a, b):
    assert P.fingerprint(Api.CHAT, user(a))[1] != P.fingerprint(Api.CHAT, user(b))[1]


def test_chat_a_message_is_the_canonical_json_of_what_the_model_reads():
    fp = P.fingerprint(Api.CHAT, {"messages": [{"content": "hé", "role": "user"}]})
    h = xxh3_64_intdigest(b"relay.prefix chat")
    expected = []
    for unit in (b"[null,[]]", '["user",null,["hé"],null,null]'.encode()):
        h = xxh3_64_intdigest(unit, h)
        expected.append(h)
    assert fp == tuple(expected)


def test_chat_editing_a_message_changes_it_and_after_only():
    base = P.fingerprint(Api.CHAT, chat_turn2())
    edited = chat_turn2()
    edited["messages"][3]["content"] = "print('hello')"
    fp = P.fingerprint(Api.CHAT, edited)
    assert len(fp) == 6
    assert shared(base, fp) == 3
    assert all(x != y for x, y in zip(base[3:], fp[3:], strict=True))


def test_chat_tool_call_arguments_object_is_canonical_string_is_not():
    def with_args(args) -> dict:
        body = chat_turn1()
        body["messages"][2]["tool_calls"][0]["function"]["arguments"] = args
        return body

    obj = P.fingerprint(Api.CHAT, with_args({"a": 1, "b": [1, 2]}))
    assert obj == P.fingerprint(Api.CHAT, with_args({"b": [1, 2], "a": 1}))
    spaced = P.fingerprint(Api.CHAT, with_args('{"path": "main.py"}'))
    tight = P.fingerprint(Api.CHAT, with_args('{"path":"main.py"}'))
    # A string is what the client sent: another spelling is another prompt.
    assert shared(spaced, tight) == 2


@pytest.mark.parametrize("change", ["system", "tools"])
def test_chat_head_change_changes_every_unit(change):
    base = P.fingerprint(Api.CHAT, chat_turn2())
    body = chat_turn2()
    if change == "system":
        body["messages"][0]["content"] = "You are a careful coding agent."
    else:
        body["tools"][0]["function"]["description"] = "Read a whole file"
    fp = P.fingerprint(Api.CHAT, body)
    assert len(fp) == 6
    assert shared(base, fp) == 0
    assert not set(base) & set(fp)


def test_chat_leading_system_and_developer_messages_are_unit_0():
    body = {
        "messages": [
            {"role": "system", "content": "a"},
            {"role": "developer", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "system", "content": "d"},
        ]
    }
    assert len(P.fingerprint(Api.CHAT, body)) == 3


def image_part(data: str) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}


def with_image(data: str) -> dict:
    return {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is this?"}, image_part(data)],
            },
            {"role": "assistant", "content": "A cat."},
        ]
    }


def test_chat_images_by_digest():
    cat = P.fingerprint(Api.CHAT, with_image("Y2F0" * 1000))
    assert cat == P.fingerprint(Api.CHAT, with_image("Y2F0" * 1000))
    dog = P.fingerprint(Api.CHAT, with_image("ZG9n" * 1000))
    assert len(dog) == 3
    assert shared(cat, dog) == 1


# Anthropic Messages ------------------------------------------------------------------------

CC_SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
    {
        "type": "text",
        "text": "You are an interactive CLI tool that helps users with software engineering tasks.",
        "cache_control": {"type": "ephemeral"},
    },
]
CC_TOOLS = [
    {
        "name": "Bash",
        "description": "Executes a given bash command",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
    {
        "name": "Read",
        "description": "Reads a file",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"},
    },
]
EPHEMERAL = {"type": "ephemeral"}


def cc_messages_turn(n: int) -> dict:
    """Claude Code's body for its turn `n` (1 or 2): the whole conversation, its
    cache_control marker on the newest message's last block only."""
    messages: list[dict] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>context</system-reminder>"},
                {"type": "text", "text": "What does main.py do?"},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Read it first.", "signature": "sig1"},
                {"type": "text", "text": "Let me read it."},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": "Read",
                    "input": {"file_path": "/w/main.py"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01",
                    "content": [{"type": "text", "text": "print('hi')"}],
                }
            ],
        },
    ]
    if n == 2:
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": "It prints hi."}]},
            {"role": "user", "content": [{"type": "text", "text": "Make it print bye."}]},
        ]
    messages[-1]["content"][-1]["cache_control"] = dict(EPHEMERAL)
    # The turn before had its marker on its own last message; this one holds none now.
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": copy.deepcopy(CC_SYSTEM),
        "tools": copy.deepcopy(CC_TOOLS),
        "messages": messages,
    }


def test_messages_claude_code_follow_up_shares_every_earlier_message():
    one = P.fingerprint(Api.MESSAGES, cc_messages_turn(1))
    two = P.fingerprint(Api.MESSAGES, cc_messages_turn(2))
    assert len(one) == 4
    assert len(two) == 6
    # The marker moved from message 2 (turn 1's newest) to message 4: nothing changes.
    assert shared(one, two) == 4


def test_messages_cache_control_is_read_nowhere():
    base = P.fingerprint(Api.MESSAGES, cc_messages_turn(2))
    body = cc_messages_turn(2)
    for block in body["system"]:
        block.pop("cache_control", None)
    for tool in body["tools"]:
        tool["cache_control"] = dict(EPHEMERAL)
    body["messages"][-1]["content"][-1].pop("cache_control")
    body["messages"][0]["content"][0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    body["messages"][2]["content"][0]["content"][0]["cache_control"] = dict(EPHEMERAL)
    assert P.fingerprint(Api.MESSAGES, body) == base


def test_messages_many_tools_and_blocks_cache_control_is_read_nowhere():
    # Claude Code with MCP servers: a hundred tools, the marker on the last; a parallel tool
    # round of a hundred results, the marker on the last.
    tools = [{"name": f"mcp_{i}", "input_schema": {"type": "object"}} for i in range(100)]
    results = [
        {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": str(i)} for i in range(100)
    ]
    marked = copy.deepcopy({"tools": tools, "messages": [{"role": "user", "content": results}]})
    marked["tools"][-1]["cache_control"] = dict(EPHEMERAL)
    marked["messages"][0]["content"][-1]["cache_control"] = dict(EPHEMERAL)
    plain = {"tools": tools, "messages": [{"role": "user", "content": results}]}
    assert P.fingerprint(Api.MESSAGES, marked) == P.fingerprint(Api.MESSAGES, plain)


def test_messages_string_content_is_one_text_block():
    a = {"system": "S", "messages": [{"role": "user", "content": "hi"}]}
    b = {
        "system": [{"type": "text", "text": "S", "cache_control": EPHEMERAL}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": EPHEMERAL}],
            }
        ],
    }
    assert P.fingerprint(Api.MESSAGES, a) == P.fingerprint(Api.MESSAGES, b)


def test_messages_key_order_and_whitespace_change_nothing():
    body = cc_messages_turn(2)
    assert P.fingerprint(Api.MESSAGES, reparsed(body)) == P.fingerprint(Api.MESSAGES, body)


@pytest.mark.parametrize(
    ("where", "same"),
    [
        (lambda b: b["messages"][1]["content"][2]["input"].update(file_path="/w/x.py"), 2),
        (lambda b: b["messages"][1]["content"][0].update(thinking="Guess."), 2),
        (lambda b: b["messages"][2]["content"][0].update(content="print('ho')"), 3),
        (lambda b: b["messages"][2]["content"][0].update(is_error=True), 3),
        (lambda b: b["messages"][3]["content"][0].update(text="It prints ho."), 4),
        (lambda b: b["system"][1].update(text="Another agent."), 0),
        (lambda b: b["tools"].pop(), 0),
    ],
)
def test_messages_an_edit_changes_its_unit_and_after_only(where, same):
    base = P.fingerprint(Api.MESSAGES, cc_messages_turn(2))
    body = cc_messages_turn(2)
    where(body)
    fp = P.fingerprint(Api.MESSAGES, body)
    assert len(fp) == 6
    assert shared(base, fp) == same
    assert all(x != y for x, y in zip(base[same:], fp[same:], strict=True))


def test_messages_thinking_signature_is_not_read():
    body = cc_messages_turn(2)
    body["messages"][1]["content"][0]["signature"] = "another"
    assert P.fingerprint(Api.MESSAGES, body) == P.fingerprint(Api.MESSAGES, cc_messages_turn(2))


def anthropic_image(data: str) -> dict:
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": data},
                    },
                    {"type": "text", "text": "What is this?", "cache_control": EPHEMERAL},
                ],
            }
        ]
    }


def test_messages_images_by_digest():
    cat = P.fingerprint(Api.MESSAGES, anthropic_image("Y2F0" * 500))
    again = anthropic_image("Y2F0" * 500)
    del again["messages"][0]["content"][1]["cache_control"]
    assert P.fingerprint(Api.MESSAGES, again) == cat
    dog = P.fingerprint(Api.MESSAGES, anthropic_image("ZG9n" * 500))
    assert len(dog) == 2
    assert shared(cat, dog) == 1


# OpenAI Responses --------------------------------------------------------------------------

CODEX_TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command",
        "strict": False,
        "parameters": {"type": "object", "properties": {"command": {"type": "array"}}},
    }
]


def codex_turn(n: int) -> dict:
    """Codex CLI's body for its turn `n` (1 or 2): the whole conversation in `input`."""
    items: list[dict] = [
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "<environment_context>cwd</environment_context>"}
            ],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "List files"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "Run ls."}],
            "content": None,
            "encrypted_content": None,
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "name": "shell",
            "arguments": '{"command":["ls"]}',
            "call_id": "call_1",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
    ]
    if n == 2:
        items += [
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "content": [{"type": "output_text", "text": "Two files."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Open a.py"}],
            },
        ]
    return {
        "model": "gpt-5-codex",
        "instructions": "You are Codex, a coding agent.",
        "tools": copy.deepcopy(CODEX_TOOLS),
        "input": items,
        "stream": True,
        "store": False,
    }


def test_responses_codex_follow_up_shares_every_earlier_item():
    one = P.fingerprint(Api.RESPONSES, codex_turn(1))
    two = P.fingerprint(Api.RESPONSES, codex_turn(2))
    assert len(one) == 6
    assert len(two) == 8
    assert shared(one, two) == 6


def test_responses_key_order_whitespace_and_item_ids_change_nothing():
    body = codex_turn(2)
    again = reparsed(body)
    for item in again["input"]:
        item.pop("id", None)
        item["status"] = "completed"
    assert P.fingerprint(Api.RESPONSES, again) == P.fingerprint(Api.RESPONSES, body)


def test_responses_string_input_is_one_user_message():
    text = {"instructions": "I", "input": "hello"}
    listed = {
        "instructions": "I",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
    }
    fp = P.fingerprint(Api.RESPONSES, text)
    assert len(fp) == 2
    assert fp == P.fingerprint(Api.RESPONSES, listed)


@pytest.mark.parametrize(
    ("where", "same"),
    [
        (lambda b: b.update(instructions="You are another agent."), 0),
        (lambda b: b["tools"][0].update(name="exec"), 0),
        (lambda b: b["input"][3].update(arguments='{"command":["ls","-l"]}'), 4),
        (lambda b: b["input"][4].update(output="a.py"), 5),
        (lambda b: b["input"][2]["summary"][0].update(text="Run ls -l."), 3),
    ],
)
def test_responses_an_edit_changes_its_unit_and_after_only(where, same):
    base = P.fingerprint(Api.RESPONSES, codex_turn(2))
    body = codex_turn(2)
    where(body)
    fp = P.fingerprint(Api.RESPONSES, body)
    assert len(fp) == 8
    assert shared(base, fp) == same
    assert all(x != y for x, y in zip(base[same:], fp[same:], strict=True))


# Legacy and native completions -------------------------------------------------------------


@pytest.mark.parametrize("api", [Api.TEXT, Api.NATIVE])
@pytest.mark.parametrize("length", [0, 1, 255, 256, 257, 5000, 5120])
def test_prompt_extended_by_1000_bytes_shares_its_whole_blocks(api, length):
    prompt = ("abcdefghij" * 600)[:length]
    fp = P.fingerprint(api, {"prompt": prompt})
    longer = P.fingerprint(api, {"prompt": prompt + "k" * 1000})
    whole = {0: 0, 1: 0, 255: 0, 256: 1, 257: 1, 5000: 19, 5120: 20}[length]
    blocks = {0: 0, 1: 1, 255: 1, 256: 1, 257: 2, 5000: 20, 5120: 20}[length]
    assert len(fp) == blocks
    assert shared(fp, longer) == whole
    assert len(longer) == {0: 4, 1: 4, 255: 5, 256: 5, 257: 5, 5000: 24, 5120: 24}[length]


def test_prompt_blocks_are_the_documented_chain():
    prompt = "x" * 300
    # Each unit is hashed seeded with the hash of the units before it, from the seed's.
    h = xxh3_64_intdigest(b"relay.prefix blocks of bytes")
    expected = []
    for block in (b"x" * 256, b"x" * 44):
        h = xxh3_64_intdigest(block, h)
        expected.append(h)
    assert P.fingerprint(Api.TEXT, {"prompt": prompt}) == tuple(expected)
    # The same prompt is the same prefix on either completions API.
    assert P.fingerprint(Api.NATIVE, {"prompt": prompt}) == tuple(expected)


def test_prompt_tokens_in_blocks_of_64():
    tokens = list(range(1, 201))
    fp = P.fingerprint(Api.NATIVE, {"prompt": tokens})
    assert len(fp) == 4
    assert shared(fp, P.fingerprint(Api.NATIVE, {"prompt": [*tokens, 7, 8]})) == 3
    assert shared(fp, P.fingerprint(Api.NATIVE, {"prompt": [*tokens[:64], 0, *tokens[65:]]})) == 1


def test_prompt_list_of_prompts_is_read_by_its_first():
    first = P.fingerprint(Api.TEXT, {"prompt": "a" * 600})
    assert P.fingerprint(Api.TEXT, {"prompt": ["a" * 600, "b"]}) == first
    assert len(P.fingerprint(Api.NATIVE, {"prompt": [[1, 2, 3], [4]]})) == 1
    assert P.fingerprint(Api.NATIVE, {"prompt": [1, "mixed", 2]}) == ()


# first_key ---------------------------------------------------------------------------------


def test_first_key_is_the_head_and_first_message():
    one = P.fingerprint(Api.MESSAGES, cc_messages_turn(1))
    two = P.fingerprint(Api.MESSAGES, cc_messages_turn(2))
    assert P.first_key(one) == P.first_key(two) == one[1]
    other = cc_messages_turn(2)
    other["messages"][0]["content"][1]["text"] = "What does test.py do?"
    fp = P.fingerprint(Api.MESSAGES, other)
    assert fp[0] == one[0]
    assert P.first_key(fp) != P.first_key(one)
    assert P.first_key((5,)) == 5
    assert P.first_key((5, 6, 7)) == 6
    assert P.first_key(()) is None


# Processes ---------------------------------------------------------------------------------

SCRIPT = """
import json, sys
from relay.policy import prefix as P
from relay.stream.dialect import Api
cases = json.load(sys.stdin)
print(json.dumps([list(P.fingerprint(Api(api), body)) for api, body in cases]))
"""


def test_the_same_hashes_in_another_process_with_another_hash_seed():
    cases = [
        ["chat", chat_turn2()],
        ["messages", cc_messages_turn(2)],
        ["responses", codex_turn(2)],
        ["text", {"prompt": "p" * 700}],
        ["native", {"prompt": list(range(130))}],
    ]
    here = [list(P.fingerprint(Api(api), body)) for api, body in cases]
    assert [len(fp) for fp in here] == [6, 6, 8, 3, 3]
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            input=json.dumps(cases),
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=120,
        )
        assert json.loads(out.stdout) == here


# Hostile and malformed bodies --------------------------------------------------------------


def deep(n: int) -> object:
    value: object = "x"
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize("api", list(Api))
@pytest.mark.parametrize(
    "body",
    [
        None,
        3,
        "messages",
        [],
        {},
        {"messages": "not a list"},
        {"messages": {"role": "user"}},
        {"messages": [3, None, "x", []]},
        {"messages": [{"role": "user", "content": 3}]},
        {"messages": [{"role": 7, "content": {"text": 1}, "tool_calls": "no"}]},
        {"messages": [{"role": "assistant", "tool_calls": [3, {"function": "f"}, {}]}]},
        {"messages": [{"role": "user", "content": [3, None, {"type": "text", "text": 5}]}]},
        {
            "system": 3,
            "tools": "t",
            "messages": [{"content": [{"type": "tool_result", "content": 3}]}],
        },
        {"messages": [{"role": ["system"], "content": [{"type": ["text"], "text": "t"}]}]},
        {"messages": [{"role": {"r": 1}, "content": [{"type": {}, "text": "t"}]}]},
        {"input": [{"type": ["message"], "role": "user"}, {"type": {}}]},
        {"instructions": [1], "input": 4},
        {"input": [3, {"type": "function_call"}, {"type": "message", "content": 5}]},
        {"prompt": 3.5},
        {"prompt": [True, 2**70]},
        {"prompt": [2**70]},
        {"prompt": [[], "a"]},
        {"prompt": {"prompt_string": "x"}},
        {
            "messages": [{"role": "user", "content": "\ud800"}],
            "input": "\ud800",
            "prompt": "\ud800",
        },
        {"messages": [{"role": "user", "content": deep(5000)}], "input": [deep(5000)]},
        {"messages": [{"role": "user", "content": [deep(5000)]}], "prompt": [deep(5000)]},
    ],
)
def test_hostile_bodies_give_a_tuple(api, body):
    fp = P.fingerprint(api, body)
    assert isinstance(fp, tuple)
    assert all(isinstance(h, int) for h in fp)


def test_wrong_shapes_give_no_units():
    assert P.fingerprint(Api.CHAT, {"messages": "not a list"}) == ()
    assert P.fingerprint(Api.CHAT, [{"role": "user"}]) == ()
    assert P.fingerprint(Api.RESPONSES, {"input": 4}) == ()
    assert P.fingerprint(Api.TEXT, {"prompt": 3.5}) == ()
    # A content of the wrong type is still a message the upstream will refuse: it counts.
    assert len(P.fingerprint(Api.CHAT, {"messages": [{"role": "user", "content": 3}]})) == 2


def test_units_are_capped_the_last_absorbing_the_rest():
    messages = [{"role": "user", "content": str(i)} for i in range(P.MAX_UNITS + 100)]
    fp = P.fingerprint(Api.CHAT, {"messages": messages})
    assert len(fp) == 4096
    more = P.fingerprint(Api.CHAT, {"messages": [*messages, {"role": "user", "content": "x"}]})
    assert len(more) == 4096
    assert shared(fp, more) == 4095
    blocks = P.fingerprint(Api.TEXT, {"prompt": "z" * (256 * 5000)})
    assert len(blocks) == 4096


def test_nothing_past_max_bytes_is_read():
    # The unit that reaches MAX_BYTES is the last read, cut there.
    head = "z" * P.MAX_BYTES
    fp = P.fingerprint(Api.TEXT, {"prompt": head + "a"})
    assert fp == P.fingerprint(Api.TEXT, {"prompt": head + "b" * 1000})
    assert fp != P.fingerprint(Api.TEXT, {"prompt": "y" + head[1:] + "a"})
    assert fp[:-1] == P.fingerprint(Api.TEXT, {"prompt": head[:-1] + "y"})[:-1]
    assert fp[-1] != P.fingerprint(Api.TEXT, {"prompt": head[:-1] + "y"})[-1]


def test_many_small_parts_and_messages_stay_bounded():
    # Past MAX_STEPS items the rest of the messages is one unit: fewer units than messages.
    # Each message reads 1 + 256 items (the rest of its 300 parts as their JSON): 64 messages
    # read one by one (16384 steps), the head before them, the other 336 one unit after.
    many = {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 300}] * 400}
    fp = P.fingerprint(Api.CHAT, many)
    assert len(fp) == 66
    # A second body differing only past the steps still differs in its last unit.
    other = copy.deepcopy(many)
    other["messages"][-1] = {"role": "user", "content": "changed"}
    assert P.fingerprint(Api.CHAT, other)[:-1] == fp[:-1]
    assert P.fingerprint(Api.CHAT, other)[-1] != fp[-1]


def test_msgspec_parsed_bodies_read_the_same():
    raw = msgspec.json.encode(cc_messages_turn(2))
    assert P.fingerprint(Api.MESSAGES, msgspec.json.decode(raw)) == P.fingerprint(
        Api.MESSAGES, json.loads(raw)
    )

"""The simulator's other servers' chunk shapes (vLLM, OpenAI) and coalesced events (issue 15)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import types

import pytest

from relay.sim import frames as F
from relay.sim.gen import Gen
from relay.sim.plan import make_plan
from relay.sim.server import SimDefaults
from relay.sim.shapes import OBF_MAX
from relay.sim.tinymodel import gen_text
from tests.support.sim_client import CHAT, events, hval, stream

ENVELOPE = {
    "vllm": ["id", "object", "created", "model", "choices"],
    "openai": ["id", "object", "created", "model", "service_tier", "system_fingerprint", "choices"],
}


async def chat_events(sim, knobs: dict, usage: bool) -> list[bytes]:
    body = {**CHAT, "stream": True, "sim": knobs}
    if usage:
        body["stream_options"] = {"include_usage": True}
    c, status, headers = await stream(sim, "/v1/chat/completions", body)
    assert status == 200
    if hval(headers, b"content-length") is not None:
        payloads = [await c.body(headers)]
    else:
        payloads = await c.chunks()
    c.close()
    return [e for p in payloads for e in events(p)], payloads


@pytest.mark.parametrize("kind", ["vllm", "openai"])
@pytest.mark.parametrize("usage", [False, True])
async def test_chat_chunks_in_another_servers_shape(sim, kind, usage):
    evs, payloads = await chat_events(sim, {"shape": kind, "tokens": 9}, usage)
    # one chunk each, but the role event with the first token, and the finish and usage events
    assert len(payloads) == len(evs) - 1 - usage
    assert evs[-1] == F.DONE_EVENT
    docs = [json.loads(e[6:]) for e in evs[:-1]]
    tail = (["usage"] if usage else []) + (["obfuscation"] if kind == "openai" else [])
    for d in docs:
        assert list(d) == ENVELOPE[kind] + tail
        assert d["object"] == "chat.completion.chunk"
        if kind == "openai":
            assert re.fullmatch(rf"[A-Za-z0-9]{{1,{OBF_MAX}}}", d["obfuscation"])
    last = -1 if usage else len(docs)
    for d in docs[:last]:
        (ch,) = d["choices"]
        assert list(ch)[:4] == ["index", "delta", "logprobs", "finish_reason"]
        assert ch["logprobs"] is None
        if usage:
            assert d["usage"] is None
    assert docs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert docs[0]["choices"][0]["delta"]["content"] == ""
    text = "".join(d["choices"][0]["delta"].get("content") or "" for d in docs[:last])
    assert text == gen_text(9, True)
    assert docs[last - 1 if usage else -1]["choices"][0]["finish_reason"] == "stop"
    if usage:
        assert docs[-1]["choices"] == []
        assert docs[-1]["usage"]["completion_tokens"] == 9
        assert docs[-1]["usage"]["total_tokens"] == 9 + docs[-1]["usage"]["prompt_tokens"]
    if kind == "openai":  # the padding's length differs from chunk to chunk
        assert len({len(d["obfuscation"]) for d in docs}) > 1


async def test_openai_shape_in_a_content_length_stream_is_exactly_its_length(sim):
    evs, _ = await chat_events(
        sim, {"shape": "openai", "tokens": 40, "content_length_stream": True}, True
    )
    assert evs[-1] == F.DONE_EVENT  # (c.body read exactly Content-Length bytes)
    assert json.loads(evs[-2][6:])["usage"]["completion_tokens"] == 40


@pytest.mark.parametrize("per_chunk,per_write", [(3, 1), (1, 4), (2, 3)])
async def test_coalesced_events_arrive_whole_and_counted(sim, per_chunk, per_write):
    evs, payloads = await chat_events(
        sim,
        {
            "shape": "vllm",
            "tokens": 13,
            "interval_ms": 1,
            "events_per_chunk": per_chunk,
            "chunks_per_write": per_write,
        },
        False,
    )
    contents = [e for e in evs if b'"content":"' in e and b'"content":""' not in e]
    assert len(contents) == 13
    sizes = [len(events(p)) for p in payloads[:-2]]  # (finish and [DONE] are a chunk each)
    assert sizes[0] == min(per_chunk, 13) + 1  # the role event joins the first chunk
    assert all(s == per_chunk for s in sizes[1:-1]) and 1 <= sizes[-1] <= per_chunk


def _writes(knobs: dict, n: int) -> list[bytes]:
    """The writes of one paced-at-once stream, through a stand-in connection."""
    loop = asyncio.new_event_loop()
    try:
        writes: list[bytes] = []
        conn = types.SimpleNamespace(
            loop=loop,
            paused=False,
            keep_alive=False,
            transport=types.SimpleNamespace(write=writes.append),
            sim=types.SimpleNamespace(tokens_sent_total=0),
            finish_stream=lambda: None,
        )
        req = types.SimpleNamespace(started_at=loop.time(), tokens_sent=0, completion_tokens=None)
        body = {**CHAT, "stream": True, "sim": {"tokens": n, **knobs}}
        plan = make_plan("chat", body, SimDefaults())
        Gen(
            conn, req, plan, F.StreamFrames("chat", "m", 1, shape=plan.shape, rng=random.Random(1))
        ).start()
        assert req.tokens_sent == n and conn.sim.tokens_sent_total == n
        return writes
    finally:
        loop.close()


def test_chunks_per_write_puts_that_many_whole_chunks_in_one_write():
    writes = _writes({"shape": "openai", "events_per_chunk": 2, "chunks_per_write": 3}, 14)
    body = writes[1:-1]  # (the head; the tail: finish, [DONE], last chunk)
    assert [w.count(b"\r\ndata: ") for w in body] == [3, 3, 1]  # 6 + 6 + 2 events
    assert [w.count(b"\n\n\r\n") for w in body] == [3, 3, 1]
    assert sum(w.count(b'"content":"') - w.count(b'"content":""') for w in body) == 14


def test_the_default_knobs_write_one_event_per_chunk_per_write():
    writes = _writes({}, 5)
    assert [w.count(b"\r\ndata: ") for w in writes[1:-1]] == [1] * 5


def test_bad_knob_values_fall_back_to_the_defaults():
    d = SimDefaults(shape="vllm", events_per_chunk=2)
    p = make_plan(
        "chat", {"sim": {"shape": "nope", "events_per_chunk": 0, "chunks_per_write": True}}, d
    )
    assert (p.shape, p.events_per_chunk, p.chunks_per_write) == ("vllm", 2, 1)


@pytest.mark.parametrize(
    "argv", [["--events-per-chunk", "0"], ["--chunks-per-write", "5000"], ["--shape", "sglang"]]
)
def test_the_command_line_refuses_bad_framing_flags(argv, capsys):
    from relay.sim.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--port", "0", *argv])
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err

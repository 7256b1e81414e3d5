"""Hostile request bodies over real sockets (issue 21, items 1, 5, 6): a field the relay decides
on named twice is refused before any upstream sees it; `n` / `best_of` in every spelling a
server honours are reserved; no body within max_body_bytes stalls another stream."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from relay.config import UpstreamConfig
from relay.policy import admission as A
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import error_of, rows_of, wait_for
from tests.support.keys import OTHER_SECRET as OTHER
from tests.support.keys import bearer, key

CHAT = "/v1/chat/completions"
OK = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
    b"Connection: close\r\n\r\n{}"
)
MESSAGES = b'"messages":[{"role":"user","content":"hi"}]'


async def answer_ok(up, index, reader, writer):
    while await up.read_request(reader) is not None:
        writer.write(OK)
        await writer.drain()


@pytest.fixture
async def recorder():
    up = await Scripted(answer_ok).start()
    yield up
    await up.stop()


def mapped(url: str) -> list[UpstreamConfig]:
    return [UpstreamConfig(name="llm", url=url, parallel=64, model_map={"*": "cheap-model"})]


async def post(port: int, path: str, body: bytes, headers=None) -> httpc.Response:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    return await httpc.fetch(port, "POST", path, body, hdrs, timeout=30.0)


# (path, body): the relay would route / map / charge one member, a parser could run the other
AMBIGUOUS = [
    (CHAT, b'{"model":"gpt-4o",' + MESSAGES + b',"model":"o1-pro-expensive"}'),
    (CHAT, b'{"model":"gpt-4o","mo\\u0064el":"o1-pro-expensive",' + MESSAGES + b"}"),
    (CHAT, b'{"model":null,' + MESSAGES + b',"model":"o1-pro-expensive"}'),
    (CHAT, b'{"model":"o1-pro-expensive",' + MESSAGES + b',"model":null}'),
    (CHAT, b'{"MODEL":"x","\\u006D\\u006F\\u0044el":"y","m\\u006Fdel":"z","model":"a"}'),
    (CHAT, b'{"model":"a","stream":false,"stream":true,' + MESSAGES + b"}"),
    (CHAT, b'{"model":"a","str\\u0065am":true,"stream":false,' + MESSAGES + b"}"),
    (CHAT, b'{"model":"a","max_tokens":5,' + MESSAGES + b',"max_tokens":-1}'),
    (CHAT, b'{"model":"a","n_predict":5,"n_predict":9000,' + MESSAGES + b"}"),
    (CHAT, b'{"model":"a","max_completion_tokens":5,"max_completion_tokens":null}'),
    (CHAT, b'{"model":"a","n":1,' + MESSAGES + b',"n":8}'),
    ("/v1/completions", b'{"model":"a","prompt":"x","prompt":["a","b","c"]}'),
    ("/v1/completions", b'{"model":"a","best_of":1,"best_of":8,"prompt":"x"}'),
    ("/v1/responses", b'{"model":"a","input":"x","max_output_tokens":5,"max_output_tokens":-1}'),
]


@pytest.mark.parametrize("path,body", AMBIGUOUS)
async def test_a_deciding_member_named_twice_is_refused_before_the_upstream(
    make_relay, recorder, path, body
):
    app = await make_relay(upstreams=mapped(recorder.url))
    resp = await post(app.port, path, body)
    assert resp.status == 400, resp.body
    assert error_of(resp)["code"] == "invalid_json"
    assert "named more than once" in error_of(resp)["message"]
    [row] = await rows_of(app, 1)
    assert (row["status"], row["error_code"]) == (400, "invalid_json")
    assert recorder.bodies == []  # nothing reached the upstream


async def test_an_unambiguous_body_reaches_the_upstream_with_one_model(make_relay, recorder):
    app = await make_relay(upstreams=mapped(recorder.url))
    bodies = [
        # a nested member and a string value of the same spellings are not the top level
        b'{"tools":[{"parameters":{"properties":{"model":{},"n":{},"prompt":{}}}}],'
        b'"model":"gpt-4o","role":"model",' + MESSAGES + b"}",
        # an escaped name that is not one the relay reads, an escape in a value
        b'{"mo\\u0064al":"x","model":"gpt-4o","note":"\\u0041",' + MESSAGES + b"}",
        b'{"mod\\u0065l":"gpt-4o",' + MESSAGES + b"}",  # one member, escaped: still one
    ]
    for body in bodies:
        resp = await post(app.port, CHAT, body)
        assert resp.status == 200, resp.body
    assert len(recorder.bodies) == len(bodies)
    for sent, got in zip(bodies, recorder.bodies, strict=True):
        pairs = json.loads(got, object_pairs_hook=lambda p: p)
        assert [v for k, v in pairs if k == "model"] == ["cheap-model"]
        assert [(k, v) for k, v in pairs if k != "model"] == [
            (k, v) for k, v in json.loads(sent, object_pairs_hook=lambda p: p) if k != "model"
        ]
    rows = await rows_of(app, len(bodies))
    assert [r["model"] for r in rows] == ["gpt-4o"] * len(bodies)


async def test_the_token_cap_replaces_the_members_the_client_sent(make_relay, recorder):
    # an unbounded max_tokens is capped where it was sent: the upstream sees one member
    app = await make_relay(upstreams=mapped(recorder.url), keys=[key(tokens_per_day=100_000)])
    body = b'{"model":"a","max_tokens":-1,' + MESSAGES + b"}"
    resp = await post(app.port, CHAT, body, bearer())
    assert resp.status == 200, resp.body
    [got] = recorder.bodies
    assert got == b'{"model":"cheap-model","max_tokens":1024,' + MESSAGES + b"}"


# tokens_per_day = 1000, 300 tokens x 4 choices: every spelling an upstream reads as 4
FOUR = [
    (CHAT, b'"n":4'),
    (CHAT, b'"n":"4"'),
    (CHAT, b'"n":4.0'),
    (CHAT, b'"n":" 4"'),
    (CHAT, b'"n":4e0'),
    ("/v1/completions", b'"best_of":4'),
    ("/v1/completions", b'"best_of":"4","n":2'),
]


@pytest.mark.parametrize("path,member", FOUR)
async def test_choices_are_reserved_in_every_spelling(make_relay, recorder, path, member):
    app = await make_relay(upstreams=mapped(recorder.url), keys=[key(tokens_per_day=1000)])
    body = b'{"model":"a","prompt":"p",' + MESSAGES + b',"max_tokens":300,' + member + b"}"
    resp = await post(app.port, path, body, bearer())
    assert resp.status == 429, resp.body
    assert recorder.bodies == []
    one = body.replace(member, b'"n":1')
    assert (await post(app.port, path, one, bearer())).status == 200


@pytest.mark.parametrize("member", [b'"n":1.5', b'"n":"four"', b'"n":true', b'"best_of":[4]'])
async def test_choices_no_server_reads_are_refused(make_relay, recorder, member):
    app = await make_relay(upstreams=mapped(recorder.url), keys=[key(tokens_per_day=1000)])
    body = b'{"model":"a",' + MESSAGES + b',"max_tokens":300,' + member + b"}"
    resp = await post(app.port, CHAT, body, bearer())
    assert (resp.status, error_of(resp)["code"]) == (400, "bad_request")
    assert recorder.bodies == []


# ---- item 5: no body stalls the loop ------------------------------------------------------
# s of CPU in one turn of the loop while a body is read (1.3 s and 0.22-0.38 s of the other
# stream's gap on the code before the body was read in passes). A pass over a body that holds
# the loop is CPU time on the loop's thread within one turn; a busy machine adds its wait for
# a core to the stream's gaps, not to that time.
STALL_BOUND = 0.15


def many_members(n: int) -> bytes:
    return b'{"model":"gpt-4o",' + b",".join(b'"%x":0' % i for i in range(n)) + b"}"


def many_prompts(n: int) -> bytes:
    return b'{"model":"gpt-4o","max_tokens":1,"prompt":[' + b",".join([b'"a"'] * n) + b"]}"


HEAVY = [
    pytest.param(CHAT, many_members(780_000), id="780k-members"),
    # the same members with a nested `model`: the walk the gate sends it to stops early
    pytest.param(CHAT, many_members(780_000)[:-1] + b',"x":{"model":1}}', id="780k-members-walked"),
    pytest.param("/v1/completions", many_prompts(1_900_000), id="1.9M-prompts"),
    # an escaped name sends it to the walk, past a value of 4 million escapes
    pytest.param(
        CHAT, b'{"\\u006dodel":"gpt-4o","x":"' + b"\\n" * 3_900_000 + b'"}', id="walked-escapes"
    ),
    # a Messages body as an agent sends it: a 7 MB system prompt, a tool with a `model` field
    pytest.param(
        "/v1/messages",
        b'{"model":"gpt-4o","max_tokens":5,"system":"'
        + b"code = 1; // comment\\n" * 320_000
        + b'","tools":[{"name":"t","input_schema":{"properties":{"model":{}}}}],'
        + MESSAGES
        + b"}",
        id="agent-body",
    ),
    pytest.param(
        "/v1/completions",
        b'{"model":"gpt-4o","prompt":[' + b",".join([b"[]"] * 2_600_000) + b"]}",
        id="2.6M-token-lists",
    ),
]


async def paced_reads(port: int, done: asyncio.Event, reads: list[int]) -> None:
    """A paced stream (10 ms per token) read until `done`, each read's size into `reads`."""
    body = httpc.chat(100_000, model="tiny", interval_ms=10)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(httpc.build_request("POST", CHAT, body))
    await httpc.read_head(reader)
    try:
        while not done.is_set():
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            assert chunk
            reads.append(len(chunk))
    finally:
        writer.close()


async def loop_turns(done: asyncio.Event, turns: list[float]) -> None:
    """The CPU time of the loop's thread in each turn of the loop, until `done`: the relay,
    the simulator and the test share the loop, so a turn holds every callback the loop ran
    between two of these wake-ups."""
    while not done.is_set():
        t = time.thread_time()
        await asyncio.sleep(0)
        turns.append(time.thread_time() - t)


@pytest.mark.parametrize("path,body", HEAVY)
async def test_no_body_stalls_another_stream(make_relay, sim, recorder, path, body):
    ups = [
        UpstreamConfig(name="paced", url=sim.url, models=["tiny"], parallel=4),
        UpstreamConfig(
            name="mapped", url=recorder.url, models=["gpt-4o"], model_map={"*": "cheap-model"}
        ),
    ]
    app = await make_relay(upstreams=ups)
    done, reads = asyncio.Event(), []
    stream = asyncio.create_task(paced_reads(app.port, done, reads))
    await wait_for(lambda: len(reads) >= 5)  # the stream flows
    before = len(reads)
    posted, turns = asyncio.Event(), []
    probe = asyncio.create_task(loop_turns(posted, turns))
    resp = await post(app.port, path, body)
    posted.set()
    await probe
    await wait_for(lambda: len(reads) >= before + 5)  # and flows on after the body is answered
    done.set()
    await stream
    assert resp.status in (200, 400), resp.body
    assert max(turns) < STALL_BOUND, f"a turn of the loop took {max(turns):.3f} s of CPU"


async def test_responses_limits_are_the_fields_llama_server_reads(make_relay, recorder):
    # it reads n_predict, max_completion_tokens, max_output_tokens, max_tokens on /v1/responses
    app = await make_relay(upstreams=mapped(recorder.url), keys=[key(tokens_per_day=2000)])
    path = "/v1/responses"
    body = b'{"model":"a","input":"Hi","max_output_tokens":3,"n_predict":-1}'
    assert (await post(app.port, path, body, bearer())).status == 200
    [got] = recorder.bodies  # the cap is written over every limit the body names
    assert got == b'{"model":"cheap-model","input":"Hi","max_output_tokens":1024,"n_predict":1024}'
    over = b'{"model":"a","input":"Hi","max_output_tokens":3,"max_completion_tokens":1500}'
    resp = await post(app.port, path, over, bearer())
    assert (resp.status, error_of(resp)["code"]) == (429, "budget_exceeded")
    assert len(recorder.bodies) == 1


@pytest.mark.parametrize("member", [b'"n":1e400', b'"best_of":-1e400', b'"n_cmpl":1e999'])
async def test_a_count_out_of_range_is_refused_not_a_crash(make_relay, recorder, member):
    app = await make_relay(upstreams=mapped(recorder.url))
    resp = await post(app.port, CHAT, b'{"model":"a",' + MESSAGES + b"," + member + b"}")
    assert (resp.status, error_of(resp)["code"]) == (400, "bad_request")
    assert recorder.bodies == []


async def test_a_prompt_list_past_the_count_is_served_but_not_reserved(make_relay, recorder):
    # counted up to MAX_PROMPTS (msgspec skips the rest in C): forwarded as any request, but a
    # token budget cannot reserve what it cannot count
    body = many_prompts(A.MAX_PROMPTS + 1)
    app = await make_relay(
        upstreams=mapped(recorder.url), keys=[key(), key("b", OTHER, tokens_per_day=10**9)]
    )
    assert (await post(app.port, "/v1/completions", body, bearer())).status == 200
    resp = await post(app.port, "/v1/completions", body, bearer(OTHER))
    assert (resp.status, error_of(resp)["code"]) == (400, "bad_request")
    assert "prompts" in error_of(resp)["message"] and len(recorder.bodies) == 1

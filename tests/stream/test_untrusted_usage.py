"""A hostile upstream's token figures over real sockets (issue 31): a figure that is no
plausible count (negative, not an integer, over 10^9) is not trusted. The row says
`tokens_source = 'untrusted'`, the key is charged what the relay counted (a stream) or
reserved (a body), one `upstream_usage_untrusted` line is logged, and a relay whose rows hold
such figures still starts. Every API's usage shape; the expected figures are written out
from the documented rule (docs/budgets.md): prompt estimate = request body bytes // 4, a
stream's completion = its content events."""

from __future__ import annotations

import json
import time

import pytest

from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import rows_of
from tests.support.keys import SECRET, bearer, key

BIG = 10**9
LIMITS = dict(
    requests_per_day=100, tokens_per_day=BIG, requests_per_month=100, tokens_per_month=BIG
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
WORDS = ("Hello", " there", " friend")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def data(doc: dict, event: str | None = None) -> bytes:
    name = f"event: {event}\n" if event else ""
    return (name + "data: " + json.dumps(doc, separators=(",", ":")) + "\n\n").encode()


# ---- each API's stream: three content events, then its usage ----------------------------------
def chat_stream(usage: dict) -> list[bytes]:
    out = [
        data(
            {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": w}}]}
        )
        for w in WORDS
    ]
    out.append(data({"object": "chat.completion.chunk", "choices": [], "usage": usage}))
    return [*out, b"data: [DONE]\n\n"]


def completions_stream(usage: dict) -> list[bytes]:
    out = [data({"object": "text_completion", "choices": [{"index": 0, "text": w}]}) for w in WORDS]
    out.append(data({"object": "text_completion", "choices": [], "usage": usage}))
    return [*out, b"data: [DONE]\n\n"]


def native_stream(final: dict) -> list[bytes]:
    # llama-server's last event carries its timings (which is what marks it as the usage event)
    out = [data({"content": w, "stop": False}) for w in WORDS]
    return [*out, data({"content": "", "stop": True, "timings": {"prompt_ms": 1.5}, **final})]


def messages_stream(start: dict, delta: dict) -> list[bytes]:
    msg = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "usage": start}
    out = [
        data({"type": "message_start", "message": msg}, "message_start"),
        data(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            "content_block_start",
        ),
    ]
    out += [
        data(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}},
            "content_block_delta",
        )
        for w in WORDS
    ]
    out.append(data({"type": "content_block_stop", "index": 0}, "content_block_stop"))
    out.append(
        data(
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": delta},
            "message_delta",
        )
    )
    return [*out, data({"type": "message_stop"}, "message_stop")]


def responses_stream(usage: dict) -> list[bytes]:
    resp = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    out = [data({"type": "response.created", "response": resp}, "response.created")]
    out += [
        data(
            {"type": "response.output_text.delta", "item_id": "m1", "delta": w},
            "response.output_text.delta",
        )
        for w in WORDS
    ]
    done = {**resp, "status": "completed", "usage": usage}
    return [*out, data({"type": "response.completed", "response": done}, "response.completed")]


# Each API's path and request body (max tokens 16), and its stream with the figures given.
REQUESTS = {
    "chat": (
        "/v1/chat/completions",
        {
            "model": "m",
            "stream": True,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ),
    "completions": (
        "/v1/completions",
        {"model": "m", "stream": True, "max_tokens": 16, "prompt": "hi"},
    ),
    "native": ("/completion", {"model": "m", "stream": True, "n_predict": 16, "prompt": "hi"}),
    "messages": (
        "/v1/messages",
        {
            "model": "m",
            "stream": True,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ),
    "responses": (
        "/v1/responses",
        {"model": "m", "stream": True, "max_output_tokens": 16, "input": "hi"},
    ),
}
HUGE = 9223372036854775000

# (API, the stream's events, the figure made absurd): every figure each API's usage carries.
CASES = [
    ("chat", lambda v: chat_stream({"prompt_tokens": v, "completion_tokens": 3}), "prompt_tokens"),
    (
        "chat",
        lambda v: chat_stream({"prompt_tokens": 5, "completion_tokens": v}),
        "completion_tokens",
    ),
    (
        "chat",
        lambda v: chat_stream({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": v}),
        "total_tokens",
    ),
    (
        "completions",
        lambda v: completions_stream({"prompt_tokens": 5, "completion_tokens": v}),
        "completion_tokens",
    ),
    (
        "native",
        lambda v: native_stream({"tokens_evaluated": v, "tokens_predicted": 3}),
        "tokens_evaluated",
    ),
    (
        "native",
        lambda v: native_stream({"tokens_evaluated": 5, "tokens_predicted": v}),
        "tokens_predicted",
    ),
    (
        "native",
        lambda v: native_stream({"timings": {"prompt_n": 1, "cache_n": v, "predicted_n": 3}}),
        "timings.cache_n",
    ),
    (
        "native",
        lambda v: native_stream({"timings": {"prompt_n": 5, "predicted_n": v}}),
        "timings.predicted_n",
    ),
    (
        "messages",
        lambda v: messages_stream({"input_tokens": v}, {"output_tokens": 3}),
        "input_tokens",
    ),
    (
        "messages",
        lambda v: messages_stream(
            {"input_tokens": 5, "cache_creation_input_tokens": v}, {"output_tokens": 3}
        ),
        "cache_creation_input_tokens",
    ),
    (
        "messages",
        lambda v: messages_stream(
            {"input_tokens": 5, "cache_read_input_tokens": v}, {"output_tokens": 3}
        ),
        "cache_read_input_tokens",
    ),
    (
        "messages",
        lambda v: messages_stream({"input_tokens": 5}, {"output_tokens": v}),
        "output_tokens",
    ),
    (
        "responses",
        lambda v: responses_stream({"input_tokens": v, "output_tokens": 3, "total_tokens": 8}),
        "input_tokens",
    ),
    (
        "responses",
        lambda v: responses_stream({"input_tokens": 5, "output_tokens": v, "total_tokens": 8}),
        "output_tokens",
    ),
    (
        "responses",
        lambda v: responses_stream({"input_tokens": 5, "output_tokens": 3, "total_tokens": v}),
        "total_tokens",
    ),
]


def answering(events: list[bytes]):
    """An upstream script: every request answered with these events, chunked."""

    async def script(up, index, reader, writer):
        while await up.read_request(reader) is not None:
            writer.write(SSE_HEAD + b"".join(chunk(e) for e in events) + b"0\r\n\r\n")
            await writer.drain()

    return script


def body_len(body: dict) -> int:
    """Bytes of the request body exactly as tests.support.httpc sends it."""
    return len(json.dumps(body).encode())


async def _one(make_relay, api: str, events: list[bytes], **relay) -> tuple:
    up = await Scripted(answering(events)).start()
    app = await make_relay(up.url, keys=relay.pop("keys", [key(**LIMITS)]), **relay)
    path, body = REQUESTS[api]
    resp = await httpc.fetch(app.port, "POST", path, body, headers=bearer())
    assert resp.status == 200 and resp.complete
    [row] = await rows_of(app, 1)
    return app, row, body_len(body) // 4


def _assert_untrusted_once(app, row, figure: str) -> None:
    [line] = app.log.of("upstream_usage_untrusted")
    assert line["request_id"] == row["request_id"] and line["upstream"] == "llm"
    assert figure in line["figures"]
    assert SECRET not in json.dumps(line)


@pytest.mark.parametrize(
    "value", [HUGE, -1000000, BIG + 1], ids=["huge", "negative", "over-the-bound"]
)
@pytest.mark.parametrize("api,stream,figure", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
async def test_an_absurd_figure_is_untrusted_and_the_counted_events_are_charged(
    make_relay, api, stream, figure, value
):
    app, row, prompt_est = await _one(make_relay, api, stream(value))
    # three content events counted; the prompt as estimated from the body
    assert (row["tokens_source"], row["prompt_tokens"], row["completion_tokens"]) == (
        "untrusted",
        prompt_est,
        3,
    )
    used = {"requests": 1, "tokens": prompt_est + 3, "reserved_requests": 0, "reserved_tokens": 0}
    assert app.budgets.usage("alpha", time.time()) == {"daily": used, "monthly": used}
    _assert_untrusted_once(app, row, figure)


@pytest.mark.parametrize("value", [1.5, 3.0, True, "12", [3], {"n": 3}])
async def test_a_figure_that_is_no_integer_is_untrusted(make_relay, value):
    events = messages_stream({"input_tokens": value}, {"output_tokens": 3})
    app, row, prompt_est = await _one(make_relay, "messages", events)
    assert (row["tokens_source"], row["prompt_tokens"], row["completion_tokens"]) == (
        "untrusted",
        prompt_est,
        3,
    )
    assert app.budgets.usage("alpha", time.time())["daily"]["tokens"] == prompt_est + 3
    _assert_untrusted_once(app, row, "input_tokens")


async def test_absurd_figures_in_two_events_are_logged_once(make_relay):
    events = messages_stream({"input_tokens": -1000000}, {"output_tokens": HUGE})
    app, row, prompt_est = await _one(make_relay, "messages", events)
    assert (row["tokens_source"], row["prompt_tokens"], row["completion_tokens"]) == (
        "untrusted",
        prompt_est,
        3,
    )
    [line] = app.log.of("upstream_usage_untrusted")
    assert "input_tokens" in line["figures"] and "output_tokens" in line["figures"]


async def test_an_absurd_figure_in_a_body_charges_the_reservation(make_relay):
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    doc = json.dumps(
        {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}}],
            "usage": {"prompt_tokens": -1000000, "completion_tokens": 3},
        }
    ).encode()

    async def script(up, index, reader, writer):
        while await up.read_request(reader) is not None:
            writer.write(JSON_HEAD % len(doc) + doc)

    up = await Scripted(script).start()
    app = await make_relay(up.url, keys=[key(**LIMITS)])
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", body, headers=bearer())
    assert resp.status == 200
    [row] = await rows_of(app, 1)
    prompt_est = body_len(body) // 4
    # no event counted: what was reserved, the prompt estimate and max_tokens
    assert (row["tokens_source"], row["prompt_tokens"], row["completion_tokens"]) == (
        "untrusted",
        prompt_est,
        16,
    )
    assert app.budgets.usage("alpha", time.time())["daily"]["tokens"] == prompt_est + 16
    _assert_untrusted_once(app, row, "prompt_tokens")


async def test_plausible_figures_stay_exact_and_log_nothing(make_relay):
    # the bound itself is a plausible count
    events = messages_stream(
        {"input_tokens": 5, "cache_read_input_tokens": BIG - 100}, {"output_tokens": 3}
    )
    up = await Scripted(answering(events)).start()
    app = await make_relay(up.url, keys=[key(requests_per_day=100, requests_per_month=100)])
    path, body = REQUESTS["messages"]
    assert (await httpc.fetch(app.port, "POST", path, body, headers=bearer())).status == 200
    [row] = await rows_of(app, 1)
    assert (row["tokens_source"], row["prompt_tokens"], row["completion_tokens"]) == (
        "exact",
        999999905,
        3,
    )
    assert app.budgets.usage("alpha", time.time())["daily"]["tokens"] == 999999908
    assert app.log.of("upstream_usage_untrusted") == []


# ---- nonzero figures, written out by hand -------------------------------------------------------
async def test_anthropic_prompt_adds_its_cache_reads_and_writes(make_relay):
    # the prompt is input + cache_creation + cache_read: 7 + 100 + 2000
    events = messages_stream(
        {"input_tokens": 7, "cache_creation_input_tokens": 100, "cache_read_input_tokens": 2000},
        {"output_tokens": 3},
    )
    app, row, _ = await _one(make_relay, "messages", events)
    assert (row["tokens_source"], row["prompt_tokens"], row["completion_tokens"]) == (
        "exact",
        2107,
        3,
    )
    assert app.budgets.usage("alpha", time.time())["daily"]["tokens"] == 2110


async def test_responses_total_counts_its_input_tokens(make_relay):
    events = responses_stream({"input_tokens": 11, "output_tokens": 3, "total_tokens": 14})
    app, row, _ = await _one(make_relay, "responses", events)
    assert (row["tokens_source"], row["prompt_tokens"], row["completion_tokens"]) == (
        "exact",
        11,
        3,
    )
    assert app.budgets.usage("alpha", time.time())["daily"]["tokens"] == 14


# ---- a start never fails on the rows -------------------------------------------------------------
async def test_two_streams_of_absurd_prompts_then_the_relay_starts_again(make_relay, tmp_path):
    db = str(tmp_path / "relay.db")
    # request limits only: the first relay's token figures never refuse the second stream
    limits = dict(requests_per_day=100, requests_per_month=100)
    events = messages_stream({"input_tokens": HUGE}, {"output_tokens": 3})
    up = await Scripted(answering(events)).start()
    app = await make_relay(up.url, keys=[key(**limits)], store=db)
    path, body = REQUESTS["messages"]
    for _ in range(2):
        assert (await httpc.fetch(app.port, "POST", path, body, headers=bearer())).status == 200
    rows = await rows_of(app, 2)
    prompt_est = body_len(body) // 4
    assert [(r["tokens_source"], r["prompt_tokens"]) for r in rows] == [
        ("untrusted", prompt_est)
    ] * 2
    before = app.budgets.usage("alpha", time.time())
    assert before["daily"]["tokens"] == 2 * (prompt_est + 3)
    await app.stop()
    again = await make_relay(up.url, keys=[key(**limits)], store=db)
    assert again.budgets.usage("alpha", time.time()) == before

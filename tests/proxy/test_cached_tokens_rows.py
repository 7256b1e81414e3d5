"""A request's row tells what the upstream reused of its prompt (issue 32, item 6): over real
sockets, the relay in front of the simulator and of scripted upstreams that send a fixed usage
in each API's spelling. `cached_tokens` sits beside `prompt_tokens` when the row's tokens are the
upstream's own; a figure above the prompt is left out and the row stays exact; a row charged
what was counted, reserved or untrusted has none."""

from __future__ import annotations

import json
import time

import pytest

from tests.stream.test_untrusted_usage import (
    JSON_HEAD,
    LIMITS,
    REQUESTS,
    answering,
    body_len,
    chat_stream,
    completions_stream,
    messages_stream,
    native_stream,
    responses_stream,
)
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import rows_of
from tests.support.keys import bearer, key


async def _row(make_relay, api: str, events: list[bytes]) -> tuple:
    up = await Scripted(answering(events)).start()
    app = await make_relay(up.url, keys=[key(**LIMITS)])
    path, body = REQUESTS[api]
    resp = await httpc.fetch(app.port, "POST", path, body, headers=bearer())
    assert resp.status == 200 and resp.complete
    [row] = await rows_of(app, 1)
    return app, row, body_len(body) // 4


def _figures(row: dict) -> tuple:
    return (
        row["tokens_source"],
        row["prompt_tokens"],
        row["cached_tokens"],
        row["completion_tokens"],
    )


# Each API's stream with 1200 prompt tokens of which 1100 came from the cache, 3 generated.
SPELLINGS = [
    (
        "chat",
        chat_stream(
            {
                "prompt_tokens": 1200,
                "completion_tokens": 3,
                "total_tokens": 1203,
                "prompt_tokens_details": {"cached_tokens": 1100},
            }
        ),
    ),
    (
        "completions",
        completions_stream(
            {
                "prompt_tokens": 1200,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 1100},
            }
        ),
    ),
    # llama-server's timings alone: 100 read, 1100 reused
    (
        "native",
        native_stream({"timings": {"prompt_n": 100, "cache_n": 1100, "predicted_n": 3}}),
    ),
    # message_start tells the prompt and its cache reads: 100 + 1100
    (
        "messages",
        messages_stream(
            {"input_tokens": 100, "cache_read_input_tokens": 1100, "output_tokens": 1},
            {"output_tokens": 3},
        ),
    ),
    (
        "responses",
        responses_stream(
            {
                "input_tokens": 1200,
                "output_tokens": 3,
                "total_tokens": 1203,
                "input_tokens_details": {"cached_tokens": 1100},
            }
        ),
    ),
]


@pytest.mark.parametrize("api,events", SPELLINGS, ids=[s[0] for s in SPELLINGS])
async def test_each_apis_cached_tokens_reach_the_row(make_relay, api, events):
    app, row, _ = await _row(make_relay, api, events)
    assert _figures(row) == ("exact", 1200, 1100, 3)
    # charged the prompt and the completion: the cached tokens are part of the prompt
    assert app.budgets.usage("alpha", time.time())["daily"]["tokens"] == 1203
    # the access line says it too
    [line] = app.log.of("access")
    assert (line["prompt_tokens"], line["cached_tokens"]) == (1200, 1100)


async def test_a_bodys_cached_tokens_reach_the_row(make_relay):
    doc = json.dumps(
        {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}}],
            "usage": {
                "prompt_tokens": 1200,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 1100},
            },
        }
    ).encode()

    async def script(up, index, reader, writer):
        while await up.read_request(reader) is not None:
            writer.write(JSON_HEAD % len(doc) + doc)

    up = await Scripted(script).start()
    app = await make_relay(up.url, keys=[key(**LIMITS)])
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", body, headers=bearer())
    assert resp.status == 200
    [row] = await rows_of(app, 1)
    assert _figures(row) == ("exact", 1200, 1100, 3)


async def test_a_cached_figure_above_the_prompt_is_left_out_and_the_row_stays_exact(make_relay):
    events = chat_stream(
        {
            "prompt_tokens": 1200,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 1201},
        }
    )
    app, row, _ = await _row(make_relay, "chat", events)
    assert _figures(row) == ("exact", 1200, None, 3)
    assert app.budgets.usage("alpha", time.time())["daily"]["tokens"] == 1203
    assert app.log.of("upstream_usage_untrusted") == []


async def test_a_cached_figure_that_is_no_count_makes_the_row_untrusted(make_relay):
    events = chat_stream(
        {
            "prompt_tokens": 1200,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": -5},
        }
    )
    app, row, prompt_est = await _row(make_relay, "chat", events)
    # three content events counted, the prompt estimated from the body
    assert _figures(row) == ("untrusted", prompt_est, None, 3)
    [line] = app.log.of("upstream_usage_untrusted")
    assert line["figures"] == {"prompt_tokens_details.cached_tokens": "negative"}


async def test_a_row_charged_what_was_counted_has_no_cached_tokens(make_relay):
    # no usage at all: the content events are counted (approx)
    events = chat_stream({})[:-2] + [b"data: [DONE]\n\n"]
    _, row, prompt_est = await _row(make_relay, "chat", events)
    assert _figures(row) == ("approx", prompt_est, None, 3)


async def test_rows_in_front_of_the_simulator_say_what_it_said(make_relay, sim):
    """Two turns of one conversation: each row's figure is the one the client read in the
    stream's last usage event (the simulator's own; 0 where it keeps no cache)."""
    app = await make_relay()
    first = {
        "model": "tiny",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi there"}],
    }
    second = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "Hello from a tiny"},
            {"role": "user", "content": "And again"},
        ],
    }
    told = []
    for body in (first, second):
        resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", body)
        assert resp.status == 200 and resp.complete
        [usage] = [e["usage"] for e in resp.data_events() if isinstance(e, dict) and e.get("usage")]
        told.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    rows = await rows_of(app, 2)
    assert [(r["prompt_tokens"], r["cached_tokens"]) for r in rows] == told
    assert all(r["tokens_source"] == "exact" for r in rows)

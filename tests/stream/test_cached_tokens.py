"""What the upstream reused of the prompt from its cache (issue 32, item 4): `Usage.cached_tokens`
in every API's spelling, read off the pinned llama-server's own bytes, then literal documents
for each rule (which spelling wins, a stream's first and last events, the plausibility of the
figure). The expected figures are the ones the captures show, written out."""

from __future__ import annotations

import pytest

from relay.stream.sse import SseScanner
from relay.stream.usage import Implausible, Refused, Usage, exact_usage, stream_usage
from tests.support.api_captures import body_of

NEG, BIG, NOINT = Implausible.NEGATIVE, Implausible.TOO_LARGE, Implausible.NOT_INTEGER


def figures(u: Usage | None) -> tuple[int | None, int | None, int | None]:
    assert u is not None
    return u.prompt_tokens, u.completion_tokens, u.cached_tokens


def streamed(name: str) -> Usage | None:
    """A captured stream's usage as the observer reads it: its last and first usage events."""
    s = SseScanner()
    s.feed(body_of(name))
    return stream_usage(s.meta, s.meta_first)


# ---- the real server's bytes ------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,want",
    [
        # `"prompt_tokens_details":{"cached_tokens":0}` (and timings cache_n 0)
        ("llama-server/chat_nonstream.http", (28, 8, 0)),
        ("llama-server/completions_nonstream.http", (12, 5, 0)),
        # Anthropic: `"cache_read_input_tokens":14,"input_tokens":1`: the prompt is 15
        ("messages_nonstream.http", (15, 8, 14)),
        # Responses: `"input_tokens_details":{"cached_tokens":14}` at the top of the body
        ("responses_nonstream.http", (15, 4, 14)),
    ],
)
def test_a_body_tells_its_cached_tokens(name, want):
    assert figures(exact_usage(body_of(name))) == want


@pytest.mark.parametrize(
    "name,want",
    [
        # `"prompt_tokens_details":{"cached_tokens":27}` in the usage event
        ("llama-server/chat_stream_usage.http", (28, 8, 27)),
        ("llama-server/completions_stream_usage.http", (8, 5, 7)),
        # no usage asked for: timings `"cache_n":27,"prompt_n":1`
        ("llama-server/chat_stream.http", (28, 8, 27)),
        ("llama-server/completions_stream.http", (12, 5, 11)),
        # native /completion: timings `"cache_n":7,"prompt_n":1`, not its `tokens_cached` 10
        ("llama-server/native_completion_stream.http", (8, 3, 7)),
        # Anthropic: message_start's `"cache_read_input_tokens":0,"input_tokens":15`, the
        # output from message_delta
        ("messages_stream.http", (15, 8, 0)),
        # Responses: response.completed's response.usage.input_tokens_details
        ("responses_stream.http", (15, 4, 14)),
        ("responses_stream_function_call.http", (708, 1, 620)),
    ],
)
def test_a_stream_tells_its_cached_tokens(name, want):
    assert figures(streamed(name)) == want


# ---- each spelling, literal -------------------------------------------------------------------
@pytest.mark.parametrize(
    "doc,want",
    [
        (
            b'{"usage":{"prompt_tokens":900,"completion_tokens":3,'
            b'"prompt_tokens_details":{"cached_tokens":850,"audio_tokens":0}}}',
            (900, 3, 850),
        ),
        (
            b'{"type":"response.completed","response":{"usage":{"input_tokens":900,'
            b'"output_tokens":3,"input_tokens_details":{"cached_tokens":850}}}}',
            (900, 3, 850),
        ),
        (
            b'{"type":"response.incomplete","response":{"usage":{"input_tokens":900,'
            b'"output_tokens":3,"input_tokens_details":{"cached_tokens":850}}}}',
            (900, 3, 850),
        ),
        # Anthropic, top-level: 50 + 850 read + 0 written
        (
            b'{"type":"message","usage":{"input_tokens":50,"cache_read_input_tokens":850,'
            b'"cache_creation_input_tokens":0,"output_tokens":3}}',
            (900, 3, 850),
        ),
        # llama-server's timings alone: prompt 50 + 850 reused
        (b'{"timings":{"prompt_n":50,"cache_n":850,"predicted_n":3}}', (900, 3, 850)),
        # native /completion: its counters and timings
        (
            b'{"content":"","stop":true,"tokens_predicted":3,"tokens_evaluated":900,'
            b'"tokens_cached":903,"timings":{"prompt_n":50,"cache_n":850}}',
            (900, 3, 850),
        ),
        # no cached figure anywhere, or null ones
        (b'{"usage":{"prompt_tokens":900,"completion_tokens":3}}', (900, 3, None)),
        (
            b'{"usage":{"prompt_tokens":900,"completion_tokens":3,"prompt_tokens_details":null}}',
            (900, 3, None),
        ),
        (
            b'{"usage":{"prompt_tokens":900,"completion_tokens":3,'
            b'"prompt_tokens_details":{"cached_tokens":null}}}',
            (900, 3, None),
        ),
    ],
)
def test_each_spelling(doc, want):
    assert figures(exact_usage(doc)) == want


def test_a_usage_that_names_it_wins_over_the_timings():
    doc = (
        b'{"usage":{"prompt_tokens":900,"completion_tokens":3,'
        b'"prompt_tokens_details":{"cached_tokens":800}},'
        b'"timings":{"prompt_n":50,"cache_n":850,"predicted_n":3}}'
    )
    assert figures(exact_usage(doc)) == (900, 3, 800)
    # a usage with no cached figure: the timings' is taken
    doc = (
        b'{"usage":{"prompt_tokens":900,"completion_tokens":3},'
        b'"timings":{"prompt_n":50,"cache_n":850,"predicted_n":3}}'
    )
    assert figures(exact_usage(doc)) == (900, 3, 850)


# ---- a stream: the last event, then the first -------------------------------------------------
START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
    b'{"input_tokens":50,"cache_read_input_tokens":850,"output_tokens":1}}}'
)
DELTA = b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":42}}'


def test_a_streams_cached_figure_comes_from_its_first_event():
    assert figures(stream_usage(DELTA, START)) == (900, 42, 850)


def test_the_last_events_cached_figure_wins():
    # Anthropic's newer message_delta repeats the input figures, cumulative
    delta = (
        b'data: {"type":"message_delta","usage":{"input_tokens":50,'
        b'"cache_read_input_tokens":849,"output_tokens":42}}'
    )
    assert figures(stream_usage(delta, START)) == (899, 42, 849)
    # the last event lacks only the cached figure: the first event's is taken
    last = b'data: {"choices":[],"usage":{"prompt_tokens":900,"completion_tokens":3}}'
    first = b'data: {"choices":[{"delta":{"content":"a"}}],"timings":{"prompt_n":50,"cache_n":850}}'
    assert figures(stream_usage(last, first)) == (900, 3, 850)


def test_a_first_event_whose_cached_figure_is_no_count_refuses_the_stream():
    # consulted for the cached figure alone, the first event still refuses what it is part of
    last = b'data: {"choices":[],"usage":{"prompt_tokens":900,"completion_tokens":3}}'
    first = b'data: {"timings":{"prompt_n":50,"cache_n":-850}}'
    u = stream_usage(last, first)
    assert u.refused == (Refused("timings.cache_n", NEG),)
    assert figures(u) == (None, None, None)


# ---- plausibility -----------------------------------------------------------------------------
HUGE = b"9223372036854775000"


@pytest.mark.parametrize(
    "value,why",
    [
        (b"-1", NEG),
        (b"1.5", NOINT),
        (b"true", NOINT),
        (b'"850"', NOINT),
        (HUGE, BIG),
        (b"1000000001", BIG),
    ],
)
@pytest.mark.parametrize(
    "template,figure",
    [
        (
            b'{"usage":{"prompt_tokens":900,"completion_tokens":3,'
            b'"prompt_tokens_details":{"cached_tokens":%s}}}',
            "prompt_tokens_details.cached_tokens",
        ),
        (
            b'{"type":"response.completed","response":{"usage":{"input_tokens":900,'
            b'"output_tokens":3,"input_tokens_details":{"cached_tokens":%s}}}}',
            "input_tokens_details.cached_tokens",
        ),
        (
            b'{"type":"message","usage":{"input_tokens":50,"cache_read_input_tokens":%s,'
            b'"output_tokens":3}}',
            "cache_read_input_tokens",
        ),
        (
            b'{"type":"message_start","message":{"usage":{"input_tokens":50,'
            b'"cache_read_input_tokens":%s,"output_tokens":1}}}',
            "cache_read_input_tokens",
        ),
        (b'{"timings":{"prompt_n":50,"cache_n":%s,"predicted_n":3}}', "timings.cache_n"),
    ],
)
def test_a_cached_figure_that_is_no_count_refuses_its_document(template, figure, value, why):
    u = exact_usage(template % value)
    assert figures(u) == (None, None, None)
    assert u.refused == (Refused(figure, why),)


@pytest.mark.parametrize(
    "doc,want",
    [
        # one above the prompt: dropped, the token figures kept
        (
            b'{"usage":{"prompt_tokens":900,"completion_tokens":3,'
            b'"prompt_tokens_details":{"cached_tokens":901}}}',
            (900, 3, None),
        ),
        (
            b'{"response":{"usage":{"input_tokens":900,"output_tokens":3,'
            b'"input_tokens_details":{"cached_tokens":1000000000}}}}',
            (900, 3, None),
        ),
        (
            b'{"usage":{"prompt_tokens":900,"completion_tokens":3},'
            b'"timings":{"prompt_n":50,"cache_n":901}}',
            (900, 3, None),
        ),
        # the whole prompt reused: kept
        (
            b'{"usage":{"prompt_tokens":900,"completion_tokens":3,'
            b'"prompt_tokens_details":{"cached_tokens":900}}}',
            (900, 3, 900),
        ),
        # no prompt figure to hold it: dropped
        (
            b'{"usage":{"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":5}}}',
            (None, 3, None),
        ),
    ],
)
def test_a_cached_figure_above_the_prompt_is_dropped_alone(doc, want):
    u = exact_usage(doc)
    assert figures(u) == want
    assert u.refused == ()


def test_a_streams_cached_figure_is_held_to_the_prompt_it_ends_with():
    # the cached figure of the first event, the prompt of the last: 850 > 800
    last = b'data: {"choices":[],"usage":{"prompt_tokens":800,"completion_tokens":3}}'
    first = b'data: {"timings":{"prompt_n":50,"cache_n":850}}'
    u = stream_usage(last, first)
    assert figures(u) == (800, 3, None)
    assert u.refused == ()
    # Anthropic: the delta's cache reads, the prompt from message_start
    delta = (
        b'data: {"type":"message_delta","usage":{"cache_read_input_tokens":901,"output_tokens":4}}'
    )
    assert figures(stream_usage(delta, START)) == (900, 4, None)

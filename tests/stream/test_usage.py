"""Unit tests for relay/stream/usage.py: exact token figures from usage / timings."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.http.chunked import ChunkTracker
from relay.stream.sse import SseScanner
from relay.stream.usage import Implausible, Refused, Usage, exact_usage, stream_usage, token_count
from tests.support.fixtures import FIXTURES

SEP = b"======== RESPONSE (raw bytes) ========\n"


def response_body(name: str) -> bytes:
    raw = Path(f"{FIXTURES}/{name}").read_bytes()
    head, _, body = raw.partition(SEP)[2].partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        t = ChunkTracker()
        _, payloads = t.feed(body)
        body = b"".join(payloads)
    return body


def meta_of(name: str) -> bytes:
    s = SseScanner()
    s.feed(response_body(name))
    return s.meta


@pytest.mark.parametrize(
    "name,prompt,completion",
    [
        ("chat_nonstream.http", 28, 8),
        ("completions_nonstream.http", 12, 5),
    ],
)
def test_nonstream_bodies(name, prompt, completion):
    assert counts(exact_usage(response_body(name))) == Usage(prompt, completion, None, None)


@pytest.mark.parametrize(
    "name,prompt,completion",
    [
        ("chat_stream.http", 28, 8),  # timings only: predicted_n 8, prompt_n 1 + cache_n 27
        ("chat_stream_stopword.http", 28, 6),  # timings only: predicted_n 6
        ("chat_stream_usage.http", 28, 8),  # usage event after the finish event
        ("completions_stream.http", 12, 5),
        ("completions_stream_usage.http", 8, 5),
        ("native_completion_stream.http", 8, 3),  # native: timings 1 + 7 cached, predicted 3
    ],
)
def test_stream_final_events(name, prompt, completion):
    assert counts(stream_usage(meta_of(name))) == Usage(prompt, completion, None, None)


def counts(u: Usage) -> Usage:
    """The token figures alone (the recorded llama-server bodies also carry its timings)."""
    return Usage(u.prompt_tokens, u.completion_tokens, u.decoding_speed_tps, u.kv_occupancy_pct)


def test_upstream_timings_read():
    u = stream_usage(meta_of("native_completion_stream.http"))
    assert (u.prompt_ms, u.prompt_per_second, u.predicted_per_second) == (
        0.194,
        5154.639175257732,
        6944.444444444445,
    )
    u = exact_usage(
        b'{"timings":{"prompt_ms":12.5,"prompt_per_second":80.0,"predicted_per_second":25.5}}'
    )
    assert u == Usage(None, None, None, None, 12.5, 80.0, 25.5)


def test_stream_without_meta():
    assert meta_of("disconnect_huge_npredict.http") == b""
    assert stream_usage(b"") is None


def test_usage_preferred_over_timings():
    doc = (
        b'{"usage":{"prompt_tokens":10,"completion_tokens":20},'
        b'"timings":{"prompt_n":1,"cache_n":5,"predicted_n":99}}'
    )
    # the usage names no cached figure: the timings' is taken
    assert exact_usage(doc) == Usage(10, 20, None, None, cached_tokens=5)


def test_partial_usage_filled_from_timings():
    doc = b'{"usage":{"prompt_tokens":10},"timings":{"prompt_n":1,"predicted_n":7}}'
    assert exact_usage(doc) == Usage(10, 7, None, None)
    doc = b'{"usage":{"completion_tokens":4},"timings":{"prompt_n":3,"cache_n":2}}'
    assert exact_usage(doc) == Usage(5, 4, None, None, cached_tokens=2)


def test_timings_only():
    assert exact_usage(b'{"timings":{"prompt_n":3,"predicted_n":9}}') == Usage(3, 9, None, None)
    assert exact_usage(b'{"timings":{"predicted_n":9}}') == Usage(None, 9, None, None)
    assert exact_usage(b'{"timings":{"prompt_n":2,"cache_n":40}}') == Usage(
        42, None, None, None, cached_tokens=40
    )


def test_native_tokens_predicted_evaluated():
    doc = b'{"content":"","stop":true,"tokens_predicted":3,"tokens_evaluated":8}'
    assert exact_usage(doc) == Usage(8, 3, None, None)
    # timings win over the native counters
    doc = (
        b'{"tokens_predicted":3,"tokens_evaluated":8,'
        b'"timings":{"prompt_n":1,"cache_n":2,"predicted_n":4}}'
    )
    assert exact_usage(doc) == Usage(3, 4, None, None, cached_tokens=2)


def test_speed_and_kv_fields():
    doc = (
        b'{"usage":{"prompt_tokens":1,"completion_tokens":2,"decoding_speed_tps":12.5,'
        b'"kv_token_occupancy_rate_percentage":33}}'
    )
    assert exact_usage(doc) == Usage(1, 2, 12.5, 33.0)


@pytest.mark.parametrize(
    "doc",
    [
        b"",
        b"not json",
        b"{",
        b"[]",
        b"[1,2]",
        b"null",
        b"42",
        b'"str"',
        b"{}",
        b'{"usage":null}',
        b'{"usage":"x"}',
        b'{"usage":{}}',
        b'{"timings":{}}',
        b'{"error":{"code":400,"message":"bad"}}',
        b"\xff\xfe\x00",
        b'{"usage":{"prompt_tokens":1}',
    ],
)
def test_garbage_is_none(doc):
    assert exact_usage(doc) is None


@pytest.mark.parametrize(
    "event",
    [
        b"data: [DONE]",
        b": comment",
        b"data: not json",
        b"event: usage",
        b"data: {oops",
        b'data: {"choices":[]}',
    ],
)
def test_stream_usage_garbage_is_none(event):
    assert stream_usage(event) is None


def test_stream_usage_multiline_event():
    assert stream_usage(
        b'event: done\ndata: {"usage":{"prompt_tokens":2,"completion_tokens":3}}'
    ) == Usage(2, 3, None, None)


# ---- the plausibility rule (issue 31): a figure that is no plausible count is refused ----------
@pytest.mark.parametrize(
    "raw,want",
    [
        (b"0", 0),
        (b"12", 12),
        (b"-0", 0),
        (b"1000000000", 1000000000),  # the bound itself
        (b"", None),  # absent
        (b"null", None),
        (b"-1", Implausible.NEGATIVE),
        (b"-1000000", Implausible.NEGATIVE),
        (b"1000000001", Implausible.TOO_LARGE),
        (b"9223372036854775000", Implausible.TOO_LARGE),
        (b"99999999999999999999999999", Implausible.TOO_LARGE),
        (b"1.5", Implausible.NOT_INTEGER),
        (b"3.0", Implausible.NOT_INTEGER),
        (b"1e3", Implausible.NOT_INTEGER),
        (b"1e400", Implausible.NOT_INTEGER),
        (b"-1.5", Implausible.NOT_INTEGER),
        (b"true", Implausible.NOT_INTEGER),
        (b"false", Implausible.NOT_INTEGER),
        (b'"12"', Implausible.NOT_INTEGER),
        (b"[3]", Implausible.NOT_INTEGER),
        (b'{"n":3}', Implausible.NOT_INTEGER),
    ],
)
def test_token_count_rule(raw, want):
    assert token_count(raw) == want


def refused(*pairs) -> tuple:
    return tuple(Refused(f, w) for f, w in pairs)


NEG, BIG, NOINT = Implausible.NEGATIVE, Implausible.TOO_LARGE, Implausible.NOT_INTEGER
HUGE = b"9223372036854775000"


@pytest.mark.parametrize(
    "doc,why",
    [
        # chat/completions and legacy completions: `usage`
        (b'{"usage":{"prompt_tokens":-1000000,"completion_tokens":3}}', [("prompt_tokens", NEG)]),
        (
            b'{"usage":{"prompt_tokens":5,"completion_tokens":%s}}' % HUGE,
            [("completion_tokens", BIG)],
        ),
        (
            b'{"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":1.5}}',
            [("total_tokens", NOINT)],
        ),
        # native /completion, and llama-server's timings
        (b'{"tokens_evaluated":true,"tokens_predicted":3}', [("tokens_evaluated", NOINT)]),
        (b'{"tokens_evaluated":5,"tokens_predicted":-3}', [("tokens_predicted", NEG)]),
        (
            b'{"tokens_predicted":3,"timings":{"prompt_n":1,"cache_n":%s,"predicted_n":3}}' % HUGE,
            [("timings.cache_n", BIG)],
        ),
        (b'{"timings":{"prompt_n":"5","predicted_n":3}}', [("timings.prompt_n", NOINT)]),
        (b'{"timings":{"prompt_n":5,"predicted_n":1.5}}', [("timings.predicted_n", NOINT)]),
        # Anthropic Messages: message_start's usage, message_delta's
        (
            b'{"type":"message_start","message":{"usage":{"input_tokens":%s,"output_tokens":0}}}'
            % HUGE,
            [("input_tokens", BIG)],
        ),
        (
            b'{"type":"message_start","message":{"usage":{"input_tokens":5,'
            b'"cache_creation_input_tokens":-1,"cache_read_input_tokens":1000000001}}}',
            [("cache_read_input_tokens", BIG), ("cache_creation_input_tokens", NEG)],
        ),
        (b'{"type":"message_delta","usage":{"output_tokens":[3]}}', [("output_tokens", NOINT)]),
        # each under the bound, the prompt they add up to over it
        (
            b'{"usage":{"input_tokens":400000000,"cache_read_input_tokens":400000000,'
            b'"cache_creation_input_tokens":200000001,"output_tokens":3}}',
            [("input_tokens+cache", BIG)],
        ),
        (
            b'{"timings":{"prompt_n":1,"cache_n":1000000000,"predicted_n":3}}',
            [("timings.prompt_n+cache_n", BIG)],
        ),
        # OpenAI Responses: response.completed's response.usage
        (
            b'{"type":"response.completed","response":{"usage":'
            b'{"input_tokens":-5,"output_tokens":3,"total_tokens":-2}}}',
            [("input_tokens", NEG), ("total_tokens", NEG)],
        ),
        (
            b'{"type":"response.completed","response":{"usage":'
            b'{"input_tokens":5,"output_tokens":1e400,"total_tokens":8}}}',
            [("output_tokens", NOINT)],
        ),
    ],
)
def test_an_implausible_figure_refuses_the_documents_counts(doc, why):
    u = exact_usage(doc)
    assert (u.prompt_tokens, u.completion_tokens, u.refused) == (None, None, refused(*why))


def test_a_refused_figure_takes_nothing_else_of_its_document():
    doc = b'{"tokens_predicted":-3,"timings":{"prompt_ms":12.5,"predicted_per_second":25.5}}'
    assert exact_usage(doc) == Usage(None, None, refused=refused(("tokens_predicted", NEG)))
    # another member of the wrong type beside it: the figure is still named
    doc = b'{"usage":{"prompt_tokens":-1,"completion_tokens":2,"decoding_speed_tps":"fast"}}'
    assert exact_usage(doc) == Usage(None, None, refused=refused(("prompt_tokens", NEG)))
    # that member alone: no usage at all, as before
    assert exact_usage(b'{"usage":{"completion_tokens":2,"decoding_speed_tps":"fast"}}') is None


def test_a_stream_is_refused_by_either_of_its_events():
    start = b'data: {"type":"message_start","message":{"usage":{"input_tokens":-1000000}}}'
    delta = b'data: {"type":"message_delta","usage":{"output_tokens":3}}'
    u = stream_usage(delta, start)
    assert (u.prompt_tokens, u.completion_tokens, u.refused) == (
        None,
        None,
        refused(("input_tokens", NEG)),
    )
    ok_start = b'data: {"type":"message_start","message":{"usage":{"input_tokens":5}}}'
    bad_delta = b'data: {"type":"message_delta","usage":{"output_tokens":%s}}' % HUGE
    u = stream_usage(bad_delta, ok_start)
    assert (u.prompt_tokens, u.completion_tokens, u.refused) == (
        None,
        None,
        refused(("output_tokens", BIG)),
    )
    # both refused: both named, the last event's first
    u = stream_usage(bad_delta, start)
    assert u.refused == refused(("output_tokens", BIG), ("input_tokens", NEG))


# ---- nonzero figures, the expected values written out by hand -----------------------------------
def test_anthropic_prompt_is_input_plus_cache_writes_plus_cache_reads():
    start = (
        b'data: {"type":"message_start","message":{"usage":{"input_tokens":7,'
        b'"cache_creation_input_tokens":100,"cache_read_input_tokens":2000,"output_tokens":1}}}'
    )
    delta = b'data: {"type":"message_delta","usage":{"output_tokens":42}}'
    # 7 + 100 + 2000; the cache reads are the cached figure
    assert stream_usage(delta, start) == Usage(2107, 42, None, None, cached_tokens=2000)
    body = (
        b'{"type":"message","usage":{"input_tokens":3,"cache_creation_input_tokens":40,'
        b'"cache_read_input_tokens":500,"output_tokens":9}}'
    )
    assert exact_usage(body) == Usage(543, 9, None, None, cached_tokens=500)
    # up to the bound: 400000000 + 400000000 + 200000000
    bound = (
        b'{"usage":{"input_tokens":400000000,"cache_read_input_tokens":400000000,'
        b'"cache_creation_input_tokens":200000000,"output_tokens":3}}'
    )
    assert exact_usage(bound) == Usage(1000000000, 3, None, None, cached_tokens=400000000)


def test_responses_usage_with_input_tokens():
    doc = (
        b'{"type":"response.completed","response":{"usage":{"input_tokens":1500,'
        b'"input_tokens_details":{"cached_tokens":1200},"output_tokens":37,"total_tokens":1537}}}'
    )
    # the cached tokens are inside input_tokens: not added again
    assert exact_usage(doc) == Usage(1500, 37, None, None, cached_tokens=1200)

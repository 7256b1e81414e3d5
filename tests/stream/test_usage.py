"""Unit tests for relay/stream/usage.py: exact token figures from usage / timings."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.http.chunked import ChunkTracker
from relay.stream.sse import SseScanner
from relay.stream.usage import Usage, exact_usage, stream_usage
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
    assert exact_usage(doc) == Usage(10, 20, None, None)


def test_partial_usage_filled_from_timings():
    doc = b'{"usage":{"prompt_tokens":10},"timings":{"prompt_n":1,"predicted_n":7}}'
    assert exact_usage(doc) == Usage(10, 7, None, None)
    doc = b'{"usage":{"completion_tokens":4},"timings":{"prompt_n":3,"cache_n":2}}'
    assert exact_usage(doc) == Usage(5, 4, None, None)


def test_timings_only():
    assert exact_usage(b'{"timings":{"prompt_n":3,"predicted_n":9}}') == Usage(3, 9, None, None)
    assert exact_usage(b'{"timings":{"predicted_n":9}}') == Usage(None, 9, None, None)
    assert exact_usage(b'{"timings":{"prompt_n":2,"cache_n":40}}') == Usage(42, None, None, None)


def test_native_tokens_predicted_evaluated():
    doc = b'{"content":"","stop":true,"tokens_predicted":3,"tokens_evaluated":8}'
    assert exact_usage(doc) == Usage(8, 3, None, None)
    # timings win over the native counters
    doc = (
        b'{"tokens_predicted":3,"tokens_evaluated":8,'
        b'"timings":{"prompt_n":1,"cache_n":2,"predicted_n":4}}'
    )
    assert exact_usage(doc) == Usage(3, 4, None, None)


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
        b'{"usage":{"prompt_tokens":"12"}}',
        b'{"timings":{"predicted_n":1.5}}',
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

"""Exact token figures read from what the upstream said (usage / timings), once per request."""

from __future__ import annotations

import msgspec

from relay.stream.sse import event_json


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    decoding_speed_tps: float | None = None
    kv_token_occupancy_rate_percentage: float | None = None


class _Timings(msgspec.Struct):
    prompt_n: int | None = None
    predicted_n: int | None = None
    cache_n: int | None = None
    prompt_ms: float | None = None
    prompt_per_second: float | None = None
    predicted_per_second: float | None = None


class _Meta(msgspec.Struct):
    usage: _Usage | None = None
    timings: _Timings | None = None
    # llama-server's native /completion
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int | None
    completion_tokens: int | None
    decoding_speed_tps: float | None = None
    kv_occupancy_pct: float | None = None
    # llama-server's own timings of the request (prompt processing ms, prompt and
    # generation speeds in tokens/s)
    prompt_ms: float | None = None
    prompt_per_second: float | None = None
    predicted_per_second: float | None = None


_decoder = msgspec.json.Decoder(_Meta)


def exact_usage(doc: bytes) -> Usage | None:
    """Usage from a JSON document (a whole non-streamed body, or one SSE event's JSON).

    `usage` wins over `timings` (it is what OpenAI clients bill on); llama-server's timings
    count prompt tokens without the cached ones, so prompt_n is only a fallback.
    """
    if not doc:
        return None
    try:
        meta = _decoder.decode(doc)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    prompt = completion = None
    tps = kv = None
    if meta.usage is not None:
        prompt = meta.usage.prompt_tokens
        completion = meta.usage.completion_tokens
        tps = meta.usage.decoding_speed_tps
        kv = meta.usage.kv_token_occupancy_rate_percentage
    timed: tuple = ()
    if meta.timings is not None:
        t = meta.timings
        timed = (t.prompt_ms, t.prompt_per_second, t.predicted_per_second)
        if completion is None:
            completion = meta.timings.predicted_n
        if prompt is None and meta.timings.prompt_n is not None:
            prompt = meta.timings.prompt_n + (meta.timings.cache_n or 0)
    if completion is None:
        completion = meta.tokens_predicted
    if prompt is None:
        prompt = meta.tokens_evaluated
    if completion is None and prompt is None and not any(v is not None for v in timed):
        return None
    return Usage(prompt, completion, tps, kv, *timed)


def stream_usage(meta_event: bytes) -> Usage | None:
    """Usage from the last SSE event that carried usage/timings."""
    body = event_json(meta_event) if meta_event else None
    return exact_usage(body) if body else None


class JsonBody:
    """Keeps a non-streamed JSON body (up to a bound) to read its usage once at the end.

    It stands where the SSE scanner stands on the body path, so it takes the same calls.
    """

    __slots__ = ("content_events", "error_first", "parts", "size")
    LIMIT = 1 << 20

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.error_first = False
        self.content_events = 0

    def feed(self, data: bytes) -> None:
        self.size += len(data)
        if self.size <= self.LIMIT:
            self.parts.append(data)

    def feed_span(self, data: bytes, start: int, end: int) -> None:
        self.feed(data[start:end])

    def usage(self) -> Usage | None:
        if self.size > self.LIMIT:
            return None
        return exact_usage(b"".join(self.parts))

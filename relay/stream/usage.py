"""Exact token figures read from what the upstream said (usage / timings), once per request.

Every API's spelling: OpenAI's `usage.prompt_tokens` / `completion_tokens`; Anthropic's
`usage.input_tokens` (plus `cache_read_input_tokens` and `cache_creation_input_tokens`, which
it counts apart: the prompt figure is all three) and `output_tokens`, at the top of a body or
a `message_delta`, under `message` in `message_start`; OpenAI Responses' `input_tokens` /
`output_tokens`, at the top of a body or under `response` in `response.completed`; then
llama-server's `timings` and native `/completion` figures.
"""

from __future__ import annotations

import msgspec
import msgspec.structs

from relay.stream.sse import event_json


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # Anthropic, Responses; Anthropic counts its cache reads and writes apart from its
    # input_tokens.
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    decoding_speed_tps: float | None = None
    kv_token_occupancy_rate_percentage: float | None = None

    def prompt(self) -> int | None:
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        if self.input_tokens is None:
            return None
        return (
            self.input_tokens
            + (self.cache_read_input_tokens or 0)
            + (self.cache_creation_input_tokens or 0)
        )

    def completion(self) -> int | None:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.output_tokens


class _Timings(msgspec.Struct):
    prompt_n: int | None = None
    predicted_n: int | None = None
    cache_n: int | None = None
    prompt_ms: float | None = None
    prompt_per_second: float | None = None
    predicted_per_second: float | None = None


class _Inner(msgspec.Struct):
    """Anthropic's `message`, Responses' `response`."""

    usage: _Usage | None = None
    timings: _Timings | None = None


class _Meta(msgspec.Struct):
    usage: _Usage | None = None
    timings: _Timings | None = None
    message: _Inner | None = None
    response: _Inner | None = None
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

    def _replace_tokens(self, other: Usage) -> Usage:
        """These figures, a token count missing here taken from `other`."""
        return msgspec.structs.replace(
            self,
            prompt_tokens=self.prompt_tokens
            if self.prompt_tokens is not None
            else other.prompt_tokens,
            completion_tokens=(
                self.completion_tokens
                if self.completion_tokens is not None
                else other.completion_tokens
            ),
        )


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
    inner = meta.response or meta.message
    usage = meta.usage or (inner.usage if inner is not None else None)
    timings = meta.timings or (inner.timings if inner is not None else None)
    if usage is not None:
        prompt = usage.prompt()
        completion = usage.completion()
        tps = usage.decoding_speed_tps
        kv = usage.kv_token_occupancy_rate_percentage
    timed: tuple[float | None, float | None, float | None] | tuple[()] = ()
    if timings is not None:
        t = timings
        timed = (t.prompt_ms, t.prompt_per_second, t.predicted_per_second)
        if completion is None:
            completion = t.predicted_n
        if prompt is None and t.prompt_n is not None:
            prompt = t.prompt_n + (t.cache_n or 0)
    if completion is None:
        completion = meta.tokens_predicted
    if prompt is None:
        prompt = meta.tokens_evaluated
    if completion is None and prompt is None and not any(v is not None for v in timed):
        return None
    return Usage(prompt, completion, tps, kv, *timed)


def stream_usage(meta_event: bytes, first_event: bytes = b"") -> Usage | None:
    """Usage from the last SSE event that carried usage/timings; a figure it lacks from the
    first such event (Anthropic tells the prompt in `message_start` only)."""
    body = event_json(meta_event) if meta_event else None
    last = exact_usage(body) if body else None
    if (
        first_event
        and first_event is not meta_event
        and (last is None or last.prompt_tokens is None or last.completion_tokens is None)
    ):
        body = event_json(first_event)
        first = exact_usage(body) if body else None
        if first is not None:
            if last is None:
                return first
            return last._replace_tokens(first)
    return last


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

    def document(self) -> bytes | None:
        """The body as kept; None when it was larger than kept."""
        if self.size > self.LIMIT:
            return None
        return b"".join(self.parts)

    def usage(self) -> Usage | None:
        doc = self.document()
        return exact_usage(doc) if doc is not None else None

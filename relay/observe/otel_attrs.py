"""What a request's row says in the OpenTelemetry GenAI semantic conventions (pure).

Names, units and bucket boundaries are the conventions' (docs/gen-ai/gen-ai-metrics.md and
gen-ai-spans.md of open-telemetry/semantic-conventions-genai, status Development): the
model-server metrics `gen_ai.server.request.duration`, `gen_ai.server.time_to_first_token`,
`gen_ai.server.time_per_output_token` and the token histogram `gen_ai.client.token.usage`
(`gen_ai.token.type` input / output); the relay's own under `relay.`.

The operation comes from the request's path: chat completions, Anthropic Messages and
OpenAI Responses are `chat` (the Responses API told by `openai.api.type`, as its openai.md
says), the legacy and llama-server completions `text_completion`, embeddings `embeddings`;
another path is no GenAI operation (its span is named by its method, and it has no gen_ai
metric points). The provider is the API's flavour (`openai`, `anthropic`; `llama.cpp` for
llama-server's own routes) unless `[otel].provider_name` says.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

import msgspec

from relay.observe.record import Record

# Explicit bucket boundaries the conventions recommend.
DURATION_BUCKETS = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (
    1,
    4,
    16,
    64,
    256,
    1024,
    4096,
    16384,
    65536,
    262144,
    1048576,
    4194304,
    16777216,
    67108864,
)
# The relay's queue wait (slot), as its Prometheus histogram: 1 ms - 300 s.
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# An attribute's value, as OpenTelemetry takes it; the attributes of a span or a point.
AttrValue = str | bool | int | float | tuple[str, ...]
Attrs = dict[str, AttrValue]


class Operation(StrEnum):
    """`gen_ai.operation.name`."""

    CHAT = "chat"
    TEXT = "text_completion"
    EMBEDDINGS = "embeddings"


class Provider(StrEnum):
    """`gen_ai.provider.name`: the API's flavour."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    LLAMA_CPP = "llama.cpp"


class Route(NamedTuple):
    """What a GenAI path is: its operation, its provider, and `openai.api.type` where the
    OpenAI API has several."""

    operation: Operation
    provider: Provider
    api_type: str | None


CHAT, TEXT, EMBEDDINGS = Operation.CHAT, Operation.TEXT, Operation.EMBEDDINGS
OPENAI, ANTHROPIC, LLAMA_CPP = Provider.OPENAI, Provider.ANTHROPIC, Provider.LLAMA_CPP

# The normalised paths of the GenAI operations.
OPERATIONS: dict[str, Route] = {
    "/v1/chat/completions": Route(CHAT, OPENAI, "chat_completions"),
    "/chat/completions": Route(CHAT, OPENAI, "chat_completions"),
    "/v1/responses": Route(CHAT, OPENAI, "responses"),
    "/responses": Route(CHAT, OPENAI, "responses"),
    "/v1/messages": Route(CHAT, ANTHROPIC, None),
    "/messages": Route(CHAT, ANTHROPIC, None),
    "/v1/completions": Route(TEXT, OPENAI, None),
    "/completions": Route(TEXT, OPENAI, None),
    "/completion": Route(TEXT, LLAMA_CPP, None),
    "/infill": Route(TEXT, LLAMA_CPP, None),
    "/v1/embeddings": Route(EMBEDDINGS, OPENAI, None),
    "/embeddings": Route(EMBEDDINGS, OPENAI, None),
    "/embedding": Route(EMBEDDINGS, LLAMA_CPP, None),
}


def route(path: str) -> Route | None:
    """The GenAI route of a normalised path; None off them."""
    return OPERATIONS.get(path)


def span_name(rec: Record) -> str:
    """`{gen_ai.operation.name} {gen_ai.request.model}`; the method alone off GenAI routes."""
    route = OPERATIONS.get(rec.path)
    if route is None:
        return rec.method or "HTTP"
    op = route.operation
    return f"{op} {rec.model}" if rec.model else str(op)


def error_type(rec: Record) -> str | None:
    """`error.type`: the row's error code (the relay's, `upstream_<status>`, ...)."""
    if rec.ok:
        return None
    return rec.error_code or "_OTHER"


# ---- what the response said: its model and finish reasons -----------------------------------
class _Choice(msgspec.Struct):
    finish_reason: str | None = None


class _Delta(msgspec.Struct):
    """Anthropic's `message_delta`."""

    stop_reason: str | None = None


class _Inner(msgspec.Struct):
    """Anthropic's `message`, the Responses API's `response`."""

    model: str | None = None
    stop_reason: str | None = None
    status: str | None = None


class _Doc(msgspec.Struct):
    """`stop_reason` is Anthropic's, not streamed; `stop_type` llama-server's native
    /completion's (eos, limit, word)."""

    model: str | None = None
    choices: list[_Choice] | None = None
    stop_reason: str | None = None
    delta: _Delta | None = None
    message: _Inner | None = None
    response: _Inner | None = None
    stop_type: str | None = None


_decode = msgspec.json.Decoder(_Doc).decode


class ResponseFacts(NamedTuple):
    """What a response said of itself: its model and its finish reasons."""

    model: str | None
    finish_reasons: tuple[str, ...]


_NO_FACTS = ResponseFacts(None, ())


def response_facts(doc: bytes | None) -> ResponseFacts:
    """The response's model and finish reasons from a JSON document: a whole body, or the
    last event a stream's scanner kept (llama-server's final chunk: the finish reason and
    the timings together). Neither when it says neither or is no JSON."""
    if not doc:
        return _NO_FACTS
    try:
        d = _decode(doc)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _NO_FACTS
    inner = d.response or d.message
    model = d.model or (inner.model if inner is not None else None)
    reasons: tuple[str, ...] = ()
    if d.choices:
        reasons = tuple(c.finish_reason for c in d.choices if c.finish_reason)
    elif d.delta is not None and d.delta.stop_reason:
        reasons = (d.delta.stop_reason,)
    elif d.stop_reason:
        reasons = (d.stop_reason,)
    elif inner is not None and (inner.stop_reason or inner.status):
        reasons = (inner.stop_reason or inner.status or "",)
    elif d.stop_type:
        reasons = (d.stop_type,)
    return ResponseFacts(model, reasons)


# ---- attributes ---------------------------------------------------------------------------
def metric_attributes(
    rec: Record,
    route: Route,
    provider: str | None,
    response_model: str | None,
    server: tuple[str, int] | None,
) -> Attrs:
    """The attributes every gen_ai metric point of this request carries (error.type added
    by the caller where the metric takes it)."""
    attrs: Attrs = {
        "gen_ai.operation.name": route.operation,
        "gen_ai.provider.name": provider or route.provider,
    }
    if rec.model:
        attrs["gen_ai.request.model"] = rec.model
    if response_model:
        attrs["gen_ai.response.model"] = response_model
    if server is not None:
        attrs["server.address"], attrs["server.port"] = server
    return attrs


def span_attributes(
    rec: Record,
    provider: str | None,
    response: ResponseFacts,
    server: tuple[str, int] | None,
    max_tokens: int | None,
) -> Attrs:
    """The span's attributes at settlement, from the row: the GenAI ones on a GenAI route,
    then the HTTP ones and the relay's own."""
    route = OPERATIONS.get(rec.path)
    a: Attrs = {}
    if route is not None:
        a.update(metric_attributes(rec, route, provider, response.model, server))
        _gen_ai_span(a, rec, route, response.finish_reasons, max_tokens)
    elif server is not None:
        a["server.address"], a["server.port"] = server
    _http_span(a, rec)
    _relay_span(a, rec)
    return a


def _gen_ai_span(
    a: Attrs,
    rec: Record,
    route: Route,
    finish_reasons: tuple[str, ...],
    max_tokens: int | None,
) -> None:
    if route.api_type is not None:
        a["openai.api.type"] = route.api_type
    a["gen_ai.request.stream"] = rec.stream
    if max_tokens is not None and max_tokens > 0:
        a["gen_ai.request.max_tokens"] = max_tokens
    if finish_reasons:
        a["gen_ai.response.finish_reasons"] = finish_reasons
    if rec.prompt_tokens is not None:
        a["gen_ai.usage.input_tokens"] = rec.prompt_tokens
    if rec.completion_tokens is not None:
        a["gen_ai.usage.output_tokens"] = rec.completion_tokens
    if rec.ttft_ms is not None and rec.stream:
        a["gen_ai.response.time_to_first_chunk"] = rec.ttft_ms / 1000


def _http_span(a: Attrs, rec: Record) -> None:
    a["http.request.method"] = rec.method
    a["url.path"] = rec.path
    if rec.status is not None:
        a["http.response.status_code"] = rec.status
    err = error_type(rec)
    if err is not None:
        a["error.type"] = err
    if rec.client_addr:
        a["client.address"] = rec.client_addr


def _relay_span(a: Attrs, rec: Record) -> None:
    a["relay.request_id"] = rec.request_id
    if rec.key_id is not None:
        a["relay.key_id"] = rec.key_id
    if rec.upstream_requested is not None:
        a["relay.upstream.requested"] = rec.upstream_requested
    if rec.upstream_served is not None:
        a["relay.upstream.served"] = rec.upstream_served
    a["relay.fallback.attempts"] = rec.fallback_attempts
    if rec.outcome is not None:
        a["relay.outcome"] = rec.outcome
    if rec.tokens_source is not None:
        a["relay.tokens.source"] = rec.tokens_source
    if rec.queue_ms is not None:
        a["relay.queue.duration"] = rec.queue_ms / 1000
    if rec.tpot_ms is not None:
        a["relay.time_per_output_token"] = rec.tpot_ms / 1000
    a["relay.client_closed"] = rec.client_closed

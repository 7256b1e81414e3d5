"""Exact token figures read from what the upstream said (usage / timings), once per request.

Every API's spelling: OpenAI's `usage.prompt_tokens` / `completion_tokens`; Anthropic's
`usage.input_tokens` (plus `cache_read_input_tokens` and `cache_creation_input_tokens`, which
it counts apart: the prompt figure is all three) and `output_tokens`, at the top of a body or
a `message_delta`, under `message` in `message_start`; OpenAI Responses' `input_tokens` /
`output_tokens`, at the top of a body or under `response` in `response.completed`; then
llama-server's `timings` and native `/completion` figures.

A figure is taken only when it is a plausible count (`token_count`): a JSON integer from 0
to MAX_TOKENS, and so is a prompt the relay adds up from several. One that is not (negative,
a float, a bool, a string, beyond the bound) refuses its whole document: the usage then names
each such figure and why (`Usage.refused`) and carries nothing else, and the request is
charged what the relay counted or reserved (proxy.settle).
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
import msgspec.structs

from relay.stream.sse import event_json

# The most tokens one figure may count: no model's context comes near (the largest hold ~10^7
# tokens), and a row's few figures stay far within the 64-bit sums of SQLite and PostgreSQL.
MAX_TOKENS = 10**9
_MAX_DIGITS = len(str(MAX_TOKENS))


class Implausible(enum.StrEnum):
    """Why a token figure the upstream sent is no plausible count."""

    NEGATIVE = "negative"
    NOT_INTEGER = "not_integer"
    TOO_LARGE = "too_large"


class Refused(msgspec.Struct, frozen=True):
    """A figure not trusted: its name (`timings.` before llama-server's timings) and why."""

    figure: str
    why: Implausible


def token_count(raw: bytes) -> int | Implausible | None:
    """A token figure as sent (its JSON text): the count, None when none was sent (absent or
    null), or why it is no plausible count."""
    if not raw or raw == b"null":
        return None
    negative = raw[:1] == b"-"
    digits = raw[1:] if negative else raw
    if not digits.isdigit():
        return Implausible.NOT_INTEGER
    if negative and digits.strip(b"0"):
        return Implausible.NEGATIVE
    if len(digits) > _MAX_DIGITS or int(digits) > MAX_TOKENS:
        return Implausible.TOO_LARGE
    return int(digits)


# A count the typed read takes: the rule `token_count` states, checked in C; a document it
# fails is read again (`_refused`) to name each figure and why.
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)] | None


class _Usage(msgspec.Struct):
    prompt_tokens: Count = None
    completion_tokens: Count = None
    # Anthropic, Responses; Anthropic counts its cache reads and writes apart from its
    # input_tokens.
    input_tokens: Count = None
    output_tokens: Count = None
    cache_read_input_tokens: Count = None
    cache_creation_input_tokens: Count = None
    # Read to be checked only.
    total_tokens: Count = None
    decoding_speed_tps: float | None = None
    kv_token_occupancy_rate_percentage: float | None = None

    def prompt(self) -> int | Refused | None:
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        if self.input_tokens is None:
            return None
        parts = (self.cache_read_input_tokens or 0, self.cache_creation_input_tokens or 0)
        return _added(self.input_tokens, *parts, figure="input_tokens+cache")

    def completion(self) -> int | None:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.output_tokens


class _Timings(msgspec.Struct):
    prompt_n: Count = None
    predicted_n: Count = None
    cache_n: Count = None
    prompt_ms: float | None = None
    prompt_per_second: float | None = None
    predicted_per_second: float | None = None


def _added(*parts: int, figure: str) -> int | Refused:
    """A figure the relay adds up from the upstream's (a prompt and its cached tokens): under
    the same bound."""
    total = sum(parts)
    return total if total <= MAX_TOKENS else Refused(figure, Implausible.TOO_LARGE)


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
    tokens_predicted: Count = None
    tokens_evaluated: Count = None


# The count figures of each place the typed read reads them from (those of the timings named
# with `timings.` before them), in the order a refusal names them.
_USAGE_FIGURES = (
    "prompt_tokens",
    "completion_tokens",
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
    "total_tokens",
)
_TIMINGS_FIGURES = ("prompt_n", "predicted_n", "cache_n")
_NATIVE_FIGURES = ("tokens_predicted", "tokens_evaluated")
_members_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])


def _members(doc: bytes | msgspec.Raw) -> dict[str, msgspec.Raw]:
    """An object's members as sent; {} for anything else."""
    try:
        return _members_decoder.decode(doc)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return {}


def _check(
    members: dict[str, msgspec.Raw], figures: tuple[str, ...], prefix: str, out: list[Refused]
) -> None:
    for f in figures:
        got = token_count(bytes(members.get(f, b"")))
        if isinstance(got, Implausible):
            out.append(Refused(prefix + f, got))


def _refused(doc: bytes) -> tuple[Refused, ...]:
    """The figures of a document the typed read failed that are no plausible count, each
    place it reads (the top, Anthropic's `message`, Responses' `response`) in turn; none
    when what failed was something else (then the document gives no usage at all)."""
    top = _members(doc)
    out: list[Refused] = []
    for place in (top, _members(top.get("message", b"")), _members(top.get("response", b""))):
        _check(_members(place.get("usage", b"")), _USAGE_FIGURES, "", out)
        _check(_members(place.get("timings", b"")), _TIMINGS_FIGURES, "timings.", out)
    _check(top, _NATIVE_FIGURES, "", out)
    return tuple(out)


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
    # The figures that were no plausible count: then no token figure is given.
    refused: tuple[Refused, ...] = ()
    # The prompt tokens the upstream reused from its prompt cache, when it said.
    cached_tokens: int | None = None

    def _replace_tokens(self, other: Usage) -> Usage:
        """These figures, a token count missing here taken from `other`; none when either
        refused a figure."""
        refused = self.refused + other.refused
        if refused:
            return msgspec.structs.replace(
                self, prompt_tokens=None, completion_tokens=None, refused=refused
            )
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
    except msgspec.ValidationError:
        refused = _refused(doc)
        return Usage(None, None, refused=refused) if refused else None
    except msgspec.DecodeError:
        return None
    prompt: int | Refused | None = None
    completion = None
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
            prompt = _added(t.prompt_n, t.cache_n or 0, figure="timings.prompt_n+cache_n")
    if isinstance(prompt, Refused):
        return Usage(None, None, refused=(prompt,))
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

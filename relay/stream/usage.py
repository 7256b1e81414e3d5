"""Exact token figures read from what the upstream said (usage / timings), once per request.

Every API's spelling: OpenAI's `usage.prompt_tokens` / `completion_tokens`; Anthropic's
`usage.input_tokens` (plus `cache_read_input_tokens` and `cache_creation_input_tokens`, which
it counts apart: the prompt figure is all three) and `output_tokens`, at the top of a body or
a `message_delta`, under `message` in `message_start`; OpenAI Responses' `input_tokens` /
`output_tokens`, at the top of a body or under `response` in `response.completed`; then
llama-server's `timings` and native `/completion` figures.

What the upstream reused of the prompt from its cache (`Usage.cached_tokens`, part of the
prompt figure, never added to it): OpenAI chat and completions'
`usage.prompt_tokens_details.cached_tokens`, Responses' `usage.input_tokens_details
.cached_tokens`, Anthropic's `cache_read_input_tokens`; where no usage names it,
llama-server's `timings.cache_n` (chat, completions, native `/completion`). A stream's may
come from its first usage-carrying event (Anthropic's `message_start`), the rest from its last.

A figure is taken only when it is a plausible count (`token_count`): a JSON integer from 0
to MAX_TOKENS, and so is a prompt the relay adds up from several. One that is not (negative,
a float, a bool, a string, beyond the bound) refuses its whole document: the usage then names
each such figure and why (`Usage.refused`) and carries nothing else, and the request is
charged what the relay counted or reserved (proxy.settle). A cached figure is plausible only
beside a prompt figure it does not exceed (`cached_within`): one above the prompt, or with
no prompt figure to hold it, is dropped (cached_tokens None) and the rest of the usage stays
trusted, since nothing is charged on it.
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


class _Details(msgspec.Struct):
    """OpenAI's `prompt_tokens_details`, Responses' `input_tokens_details`."""

    cached_tokens: Count = None


class _Usage(msgspec.Struct):
    prompt_tokens: Count = None
    completion_tokens: Count = None
    # Anthropic, Responses; Anthropic counts its cache reads and writes apart from its
    # input_tokens.
    input_tokens: Count = None
    output_tokens: Count = None
    cache_read_input_tokens: Count = None
    cache_creation_input_tokens: Count = None
    # OpenAI's (chat, completions) and Responses' cached part of the prompt.
    prompt_tokens_details: _Details | None = None
    input_tokens_details: _Details | None = None
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

    def cached(self) -> int | None:
        for details in (self.prompt_tokens_details, self.input_tokens_details):
            if details is not None and details.cached_tokens is not None:
                return details.cached_tokens
        return self.cache_read_input_tokens


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
_DETAILS = ("prompt_tokens_details", "input_tokens_details")
_DETAILS_FIGURES = ("cached_tokens",)
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
        usage = _members(place.get("usage", b""))
        _check(usage, _USAGE_FIGURES, "", out)
        for d in _DETAILS:
            _check(_members(usage.get(d, b"")), _DETAILS_FIGURES, d + ".", out)
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
    # What the upstream reused of the prompt from its cache: part of prompt_tokens.
    cached_tokens: int | None = None

    def lacks_a_count(self) -> bool:
        """Whether a token figure is missing (a stream's first event may hold it)."""
        return None in (self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def _replace_tokens(self, other: Usage) -> Usage:
        """These figures, a token count missing here taken from `other`; none when either
        refused a figure."""
        refused = self.refused + other.refused
        if refused:
            return msgspec.structs.replace(
                self,
                prompt_tokens=None,
                completion_tokens=None,
                cached_tokens=None,
                refused=refused,
            )
        return msgspec.structs.replace(
            self,
            prompt_tokens=_either(self.prompt_tokens, other.prompt_tokens),
            completion_tokens=_either(self.completion_tokens, other.completion_tokens),
            cached_tokens=_either(self.cached_tokens, other.cached_tokens),
        )


def _either(mine: int | None, other: int | None) -> int | None:
    return mine if mine is not None else other


def cached_within(cached: float | None, prompt: float | None) -> float | None:
    """A cached figure where a prompt figure holds it (from 0 up to the prompt: a cache cannot
    have given more of the prompt than the prompt), else None. Also how `relay report` takes
    a stored row's."""
    if cached is None or prompt is None or not 0 <= cached <= prompt:
        return None
    return cached


def _cache_bounded(u: Usage) -> Usage:
    """The usage with its cached figure only where a prompt figure holds it. Only that figure
    is dropped."""
    if u.cached_tokens is None or cached_within(u.cached_tokens, u.prompt_tokens) is not None:
        return u
    return msgspec.structs.replace(u, cached_tokens=None)


_decoder = msgspec.json.Decoder(_Meta)


def exact_usage(doc: bytes) -> Usage | None:
    """Usage from a JSON document (a whole non-streamed body, or one SSE event's JSON).

    `usage` wins over `timings` (it is what OpenAI clients bill on); llama-server's timings
    count prompt tokens without the cached ones, so prompt_n is only a fallback.
    """
    u = _read(doc)
    return _cache_bounded(u) if u is not None else None


def _read(doc: bytes) -> Usage | None:
    """A document's figures as sent, the cached one not yet held to the prompt."""
    if not doc:
        return None
    try:
        meta = _decoder.decode(doc)
    except msgspec.ValidationError:
        refused = _refused(doc)
        return Usage(None, None, refused=refused) if refused else None
    except msgspec.DecodeError:
        return None
    return _figures(meta)


def _figures(meta: _Meta) -> Usage | None:
    """The figures of a document the typed read took: none when it names none."""
    prompt: int | Refused | None = None
    completion = cached = None
    tps = kv = None
    inner = meta.response or meta.message
    usage = meta.usage or (inner.usage if inner is not None else None)
    timings = meta.timings or (inner.timings if inner is not None else None)
    if usage is not None:
        prompt = usage.prompt()
        completion = usage.completion()
        cached = usage.cached()
        tps = usage.decoding_speed_tps
        kv = usage.kv_token_occupancy_rate_percentage
    timed: tuple[float | None, float | None, float | None] = (None, None, None)
    if timings is not None:
        t = timings
        timed = (t.prompt_ms, t.prompt_per_second, t.predicted_per_second)
        if completion is None:
            completion = t.predicted_n
        if cached is None:
            cached = t.cache_n
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
    prompt_ms, prompt_speed, predicted_speed = timed
    return Usage(
        prompt, completion, tps, kv, prompt_ms, prompt_speed, predicted_speed, cached_tokens=cached
    )


def stream_usage(meta_event: bytes, first_event: bytes = b"") -> Usage | None:
    """Usage from the last SSE event that carried usage/timings; a figure it lacks from the
    first such event (Anthropic tells the prompt and its cache reads in `message_start`
    only). The cached figure is held to the prompt once they are put together."""
    body = event_json(meta_event) if meta_event else None
    last = _read(body) if body else None
    if first_event and first_event is not meta_event and (last is None or last.lacks_a_count()):
        body = event_json(first_event)
        first = _read(body) if body else None
        if first is not None:
            last = first if last is None else last._replace_tokens(first)
    return _cache_bounded(last) if last is not None else None


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

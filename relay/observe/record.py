"""What the relay knows about one request: filled in along the way, written once as a row."""

from __future__ import annotations

from enum import StrEnum
from itertools import compress, repeat
from operator import attrgetter, is_not

import msgspec

from relay.errors import Outcome
from relay.http.fields import HeaderPairs, get
from relay.stream.usage import Usage


class TokensSource(StrEnum):
    """Where a row's token figures come from: the upstream's usage, the relay's count of
    content events (higher than the usage, or alone), the reservation (no count known), or
    the count or the reservation charged instead of upstream figures that were no plausible
    count (`untrusted`: stream.usage)."""

    EXACT = "exact"
    APPROX = "approx"
    RESERVED = "reserved"
    UNTRUSTED = "untrusted"


# The error code of a request a crash cut (store.admissions), and the tokens source of a row
# charged its reservation.
CRASHED = Outcome.RELAY_CRASHED
EXACT, APPROX, RESERVED, UNTRUSTED = TokensSource


# One per request, alive for the whole stream: a msgspec Struct, made in C with its defaults
# (a dataclass's generated __init__ ran some 120 opcodes a request), no instance dict, not
# tracked by the cyclic collector (it holds strings and numbers only).
class Record(msgspec.Struct, gc=False):
    ts: float
    request_id: str
    path: str
    method: str = ""
    key_id: str | None = None
    model: str | None = None
    stream: bool = False
    upstream_requested: str | None = None
    upstream_served: str | None = None
    # The pool the serving upstream was chosen from (the upstreams that list the model).
    pool: str | None = None
    fallback_attempts: int = 0
    status: int | None = None
    ok: bool = False
    error_code: str | None = None
    # What failed, in words (a TLS reason, say), when known.
    error: str | None = None
    queue_ms: float | None = None
    # Its place among its key's waiting requests when it was queued (None: it took a free
    # slot at once).
    queue_position: int | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    prompt_tokens: int | None = None
    # What the upstream reused of the prompt from its cache (part of prompt_tokens), when it
    # said so in figures the row's tokens are taken from.
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_source: TokensSource | None = None
    bytes_out: int = 0
    client_closed: bool = False
    # Benchmark timings (observe.row_timings), ms measured at the relay on the client side:
    # to the first byte out, to the end of the response, to the read holding the last
    # content event; per output token; the gaps between content events, and their buckets
    # (stream.itl), which `relay report` pools.
    first_byte_ms: float | None = None
    e2e_ms: float | None = None
    last_content_ms: float | None = None
    tpot_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_max_ms: float | None = None
    itl_hist: str | None = None
    # The upstream's own `timings` (llama-server), when it sent them.
    prompt_ms: float | None = None
    prompt_per_second: float | None = None
    predicted_per_second: float | None = None
    # For the access line only: how the request ended, the client's address, and its
    # User-Agent, bounded (MAX_AGENT_CHARS).
    outcome: Outcome | None = None
    client_addr: str | None = None
    user_agent: str | None = None

    def row(self) -> dict[str, object]:
        # One C call reads every field.
        out = dict(zip(ROW_FIELDS, _row_values(self)))
        for k in ("stream", "ok", "client_closed"):
            out[k] = int(out[k])
        return out

    def log_fields(self) -> dict[str, object]:
        # dataclasses.asdict deep-copies every value (60 us a call on an edge box); here the
        # None values are left out in C, of about 40 fields.
        values = _log_values(self)
        return dict(compress(zip(LOG_FIELDS, values), map(is_not, values, repeat(None))))

    def set_tokens(
        self, exact: Usage | None, approx_completion: int | None, approx_prompt: int | None
    ) -> None:
        """Exact figures when the upstream sent them, else the relay's estimate. A stream's
        final usage may cover one completion of several (prompts x choices): the completion
        charged is never below the content events counted. The cached figure comes only with
        the exact prompt it is part of."""
        if exact is not None and exact.completion_tokens is not None:
            counted = approx_completion or 0
            self.completion_tokens = max(exact.completion_tokens, counted)
            self.prompt_tokens = exact.prompt_tokens
            self.cached_tokens = exact.cached_tokens
            self.tokens_source = EXACT if exact.completion_tokens >= counted else APPROX
        elif approx_completion is not None:
            self.completion_tokens = approx_completion
            self.prompt_tokens = approx_prompt
            self.tokens_source = APPROX

    def set_reserved(self, prompt: int, completion: int) -> None:
        """No usable figure for a request that was served: it is charged what it reserved
        (the rule crash recovery follows, store.admissions)."""
        self.prompt_tokens, self.completion_tokens = prompt, completion
        self.tokens_source = RESERVED

    def set_untrusted(self) -> None:
        """The upstream sent figures that were no plausible count (stream.usage): the row's
        tokens, set from what was counted or reserved instead, say so."""
        if self.tokens_source is not None:
            self.tokens_source = UNTRUSTED

    @property
    def total_tokens(self) -> int:
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)


FIELDS: tuple[str, ...] = Record.__struct_fields__
# Every field, in order: Record(*field_values(rec)) is a copy.
field_values = attrgetter(*FIELDS)
LOG_FIELDS = tuple(f for f in FIELDS if f not in ("ts", "itl_hist"))
ROW_FIELDS = tuple(f for f in FIELDS if f not in ("outcome", "client_addr", "user_agent"))
_row_values = attrgetter(*ROW_FIELDS)
_log_values = attrgetter(*LOG_FIELDS)
MAX_AGENT_CHARS = 200


def user_agent(headers: HeaderPairs) -> str | None:
    """The request's User-Agent for the access log: bounded, control characters replaced."""
    v = get(headers, b"user-agent")
    if v is None:
        return None
    text = v[:MAX_AGENT_CHARS].decode("latin-1")
    if text.isprintable() and text.isascii():
        return text
    return "".join(c if " " <= c != "\x7f" else "?" for c in text)

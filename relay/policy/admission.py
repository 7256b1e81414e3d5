"""Admission decisions on one request, without sockets: who may send a body, what it asks for.

- `head_check`: decided as soon as the head is in, before one body byte is read or a
  `100 Continue` is sent: a caller without a valid key never makes the relay buffer its body.
- `generates`: every POST takes a slot and a reservation unless it is a known cheap route
  (tokenize, count, admin, ...): a generating route the relay does not know cannot dodge
  slots or budgets.
- `peek_body`: the few JSON fields the relay reads. On the known JSON generation routes
  (`PATH_LIMITS`) the body is read as JSON whatever its Content-Type says, as llama-server
  parses any body as JSON; one that is not a JSON object is refused there (400
  `invalid_json`). Nesting too deep for the decoder is invalid JSON too, not a relay error.
  A field the relay decides on named twice is refused (`body_fields`): the upstream's parser
  could read the other one. `n`, `best_of` and llama-server's `n_cmpl` are read as the servers
  that honour them read them (`4`, `4.0`, `"4"`); a count they would not read as a whole
  number is refused.
- `completion_limit` / `estimate_tokens`: the most tokens the upstream may generate per
  prompt is the largest of the limit fields this path's API honours (llama-server reads
  `n_predict` before `max_tokens`; a field another API names is ignored, so it limits
  nothing); none, or a negative one, is unbounded. The reservation is that limit times the
  prompts (`"prompt": [p1 ... pN]`) times the choices (the largest of `n`, `best_of`,
  `n_cmpl`).
- `with_limit`: when a token budget applies, an unbounded request is capped by writing the
  cap into the limit fields of the path's API (never a field it does not know), so the
  reservation is what the upstream honours.
"""

from __future__ import annotations

import bisect
import functools
import re
from typing import TypeVar

import msgspec
import msgspec.structs

from relay.errors import Code, RelayError
from relay.http import fields
from relay.http.fields import HeaderPairs
from relay.http.request_path import bounded
from relay.policy import admin_access as access
from relay.policy import body_fields as B
from relay.policy.keys import Auth

# The limit fields each generation API honours (llama-server reads n_predict first, then
# max_tokens and its alias; a field another API names is ignored on this path: a
# `max_output_tokens` on chat/completions limits nothing). () = the route generates no
# completion tokens (embeddings, rerank). Every route here takes a JSON object.
_OPENAI = ("n_predict", "max_tokens", "max_completion_tokens")
_NATIVE = ("n_predict", "max_tokens")
# llama-server's Responses route reads n_predict, then max_completion_tokens, then
# max_output_tokens, then max_tokens (seen on the pinned build): the largest is reserved.
_RESPONSES = ("n_predict", "max_completion_tokens", "max_output_tokens", "max_tokens")
_MESSAGES = ("max_tokens",)
PATH_LIMITS: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": _OPENAI,
    "/chat/completions": _OPENAI,
    "/v1/completions": _OPENAI,
    "/completions": _OPENAI,
    "/completion": _NATIVE,
    "/infill": _NATIVE,
    "/v1/responses": _RESPONSES,
    "/responses": _RESPONSES,
    "/v1/messages": _MESSAGES,
    "/v1/embeddings": (),
    "/embeddings": (),
    "/embedding": (),
    "/v1/rerank": (),
    "/v1/reranking": (),
    "/rerank": (),
    "/reranking": (),
}
LIMIT_FIELDS = ("n_predict", "max_tokens", "max_completion_tokens", "max_output_tokens")
# POST routes of llama-server that never generate (no slot; no "unknown means reserved"):
# tokenizing, templating, counting, admin (props, LoRA, slots, router-mode model loading),
# the control of a running stream and the experimental tools runtime / CORS proxy (checked
# against the pinned build's route table). Every other POST - known or not (/v1/messages,
# /responses, /v1/rerank, /v1/audio/transcriptions, GCP's /predict, a newer build's
# routes) - is taken to generate: a slot and a reservation.
CHEAP_PATHS = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/apply-template",
        "/props",
        "/health",
        "/v1/health",
        "/lora-adapters",
        "/slots",
        "/metrics",
        "/cors-proxy",
        "/tools",
        "/v1/chat/completions/control",
        "/v1/streams/lookup",
    }
)
_CHEAP_PREFIXES = ("/slots/", "/models/", "/cors-proxy/")
_CHEAP_SUFFIXES = ("/count_tokens", "/input_tokens")


# The health check the relay answers itself, as llama-server does: with no key asked.
HEALTH_PATHS = frozenset({"/health", "/v1/health"})


def is_health(method: bytes, path: str) -> bool:
    """`GET`/`HEAD /health` or `/v1/health`: answered by the relay from its upstreams'
    health, open to anyone (a key sent anyway is not looked at), never charged."""
    return path in HEALTH_PATHS and (method == b"GET" or method == b"HEAD")


def generates(method: bytes, path: str) -> bool:
    """Whether a request may make the upstream generate: it takes a slot and a reservation.
    Turned around on purpose: any POST but a known cheap route, so a route the relay does
    not know (a newer llama-server's) cannot dodge slots or budgets."""
    if method != b"POST":
        return False
    return not (
        path in CHEAP_PATHS
        or path == "/models"
        or path.startswith(_CHEAP_PREFIXES)
        or path.endswith(_CHEAP_SUFFIXES)
    )


def json_route(path: str) -> bool:
    """A known generation route: its body must be a JSON object (the strict peek)."""
    return path in PATH_LIMITS


# The characters of client text quoted in an error message; the bytes of a body read over
# more than one loop turn; the choices a larger `n` is reserved as (any budget refuses it).
MAX_ECHO = 256
LARGE_BODY = 1 << 20
MAX_CHOICES = 1 << 20


class Peek(msgspec.Struct, frozen=True):
    """The few request fields the relay reads (`body_fields.DECIDING`), each named once:
    `choices` is the completions per prompt (`n`, `best_of` or llama-server's `n_cmpl`),
    `members` the deciding members each as sent."""

    model: str | None = None
    stream: bool | None = None
    n_predict: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None
    choices: int = 1
    members: B.Members = msgspec.field(default_factory=B.Members)


_T = TypeVar("_T")

_str: msgspec.json.Decoder[str | None] = msgspec.json.Decoder(str | None)
_bool: msgspec.json.Decoder[bool | None] = msgspec.json.Decoder(bool | None)
_int: msgspec.json.Decoder[int | None] = msgspec.json.Decoder(int | None)
_any: msgspec.json.Decoder[object] = msgspec.json.Decoder()
# A count sent as a string, as float() reads it but without its `_` and `inf`.
_NUMBER = re.compile(r"[+-]?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]{1,3})?")


def head_check(
    auth: Auth,
    method: bytes,
    path: str,
    headers: HeaderPairs,
    peer_host: str | None,
    listen_host: str = "",
) -> tuple[str | None, RelayError | None]:
    """(key id, refusal) decided on the head alone: 401/403 for a caller the request will be
    refused for anyway, so its body is never read. Admin endpoints follow `admin_access`
    (`listen_host`: `[server].host`; empty: only loopback names name the relay). The health
    check asks for nothing."""
    if is_health(method, path):
        return None, None
    if access.is_admin(method, path):
        refused = access.admin_refusal(auth, method, headers, peer_host, listen_host)
        return None, (RelayError(*refused) if refused is not None else None)
    if not auth.enabled:
        return None, None
    key_id = auth.identify(headers)
    if key_id is None:
        return None, RelayError(Code.INVALID_API_KEY, "missing or unknown API key")
    return key_id, None


def _invalid(reason: str) -> RelayError:
    """400 `invalid_json`, saying why."""
    return RelayError(
        Code.INVALID_JSON, bounded(f"request body is not valid JSON: {reason}", MAX_ECHO)
    )


def _bad_field(name: str, why: str) -> RelayError:
    """400 `bad_request` for the member `name` the relay cannot read as it must."""
    return RelayError(
        Code.BAD_REQUEST, bounded(f"invalid request field: {why} - at `$.{name}`", MAX_ECHO)
    )


def peek_body(method: bytes, headers: HeaderPairs, body: bytes, llm: bool) -> Peek:
    """The peeked fields. `llm`: the path is an LLM endpoint, where the body must be one JSON
    object (strict). Elsewhere a body declared JSON (its Content-Type names json, or it has
    none) is held to that too; any other body that is not a JSON object is not read, and one
    that is follows the same rules (a deciding member named twice is refused wherever the
    relay reads it).

    A member absent, the usual case, costs a test, not a call."""
    if method != b"POST":
        return Peek()
    strict = llm
    if not llm:
        if not body:
            return Peek()
        ctype = (fields.get(headers, b"content-type") or b"application/json").lower()
        strict = ctype.find(b"json") >= 0
    if not body:
        raise _invalid("the body is empty, a JSON object is expected")
    try:
        m = B.read(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        if not strict:
            return Peek()
        raise _invalid(_not_an_object(exc)) from None
    try:
        B.check(body, m)
    except (B.Ambiguous, msgspec.DecodeError) as exc:
        raise _invalid(str(exc)) from None
    except B.TooManyMembers as exc:
        raise RelayError(Code.BAD_REQUEST, f"request body not read: {exc}") from None
    return Peek(
        model=_typed(_str, m.model, "model") if m.model else None,
        stream=_typed(_bool, m.stream, "stream") if m.stream else None,
        n_predict=_typed(_int, m.n_predict, "n_predict") if m.n_predict else None,
        max_tokens=_typed(_int, m.max_tokens, "max_tokens") if m.max_tokens else None,
        max_completion_tokens=(
            _typed(_int, m.max_completion_tokens, "max_completion_tokens")
            if m.max_completion_tokens
            else None
        ),
        max_output_tokens=(
            _typed(_int, m.max_output_tokens, "max_output_tokens") if m.max_output_tokens else None
        ),
        choices=(
            max(_count(m.n, "n"), _count(m.best_of, "best_of"), _count(m.n_cmpl, "n_cmpl"))
            if m.n or m.best_of or m.n_cmpl
            else 1
        ),
        members=m,
    )


def _not_an_object(exc: msgspec.DecodeError | RecursionError) -> str:
    """Why a body is not read as one JSON object: its top level is another value (msgspec's
    ValidationError), it is no JSON at all, or it is nested too deeply for the decoder."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, msgspec.ValidationError):
        return f"a JSON object is expected ({exc})"
    return str(exc)


def _typed(decoder: msgspec.json.Decoder[_T], raw: msgspec.Raw, name: str) -> _T:
    """The member `name`, sent as `raw`, as `decoder` reads it; 400 for another type."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise _bad_field(name, str(exc)) from None


def _count(raw: msgspec.Raw, name: str) -> int:
    """The member `name` (`n`, `best_of`, `n_cmpl`), sent as `raw`, as the servers that
    honour it read it (vLLM and pydantic take `4`, `4.0` and `"4"` alike): absent, null or
    below 2 is one; a count no server reads as a whole number (a number out of range such
    as 1e400 included) is refused rather than reserved as one."""
    if not raw:
        return 1
    try:
        value = _any.decode(raw)
    except msgspec.DecodeError:
        raise _bad_field(name, "expected a whole number") from None
    if value is None:
        return 1
    if isinstance(value, str):
        value = float(value) if _NUMBER.fullmatch(value.strip()) else None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad_field(name, "expected a whole number")
    return min(max(value, 1), MAX_CHOICES)


def completion_limit(peek: Peek, path: str) -> int | None:
    """The most completion tokens the upstream may generate for one prompt and choice, None
    when unbounded: the largest of the fields this path's API honours (0 on a route that
    generates no completion; None on a route the relay does not know the fields of)."""
    honoured = PATH_LIMITS.get(path)
    if honoured is None:
        return None
    if not honoured:
        return 0
    asked: list[int] = [v for v in (getattr(peek, f) for f in honoured) if v is not None]
    if not asked or min(asked) < 0:
        return None
    return max(asked)


# The prompts counted in one request's `"prompt": [...]` (more: at least that many).
MAX_PROMPTS = 16384


@functools.cache
def _first_items() -> msgspec.json.Decoder[msgspec.Struct]:
    """The first MAX_PROMPTS + 1 items of an array as sent; msgspec skips the rest in C, so
    a list of millions costs what its bytes cost to scan, never an object each. (Made on
    first use, once: ~25 ms, which start-up and `relay report` need not pay.)"""
    return msgspec.json.Decoder(
        msgspec.defstruct(
            "FirstItems",
            [(f"i{k}", msgspec.Raw, msgspec.Raw()) for k in range(MAX_PROMPTS + 1)],
            array_like=True,
        )
    )


def prompt_count(peek: Peek) -> int:
    """How many prompts a request carries: `"prompt": [p1 ... pN]` (strings, token lists or
    multimodal objects) is N, each generating up to the limit; a flat list of token ids, or
    of ids mixed with strings (llama-server's one-prompt forms), is one. A list of more than
    MAX_PROMPTS items that is not all ids counts as MAX_PROMPTS + 1 (at least that many:
    counting it would cost an object per item)."""
    raw = bytes(peek.members.prompt)
    if not raw.startswith(b"["):
        return 1
    # Numbers only (token ids, of any length) are one prompt.
    if 34 not in raw and 123 not in raw and raw.find(b"[", 1) < 0:
        return 1
    try:
        items = msgspec.structs.astuple(_first_items().decode(raw))
    except (msgspec.DecodeError, RecursionError):
        return 1
    if items[MAX_PROMPTS]:
        return MAX_PROMPTS + 1
    # The items sent come first; the rest of the tuple holds the empty Raw of the default.
    n = bisect.bisect_left(items, True, key=lambda item: not item)
    kinds = {bytes(item)[:1] for item in items[:n]}
    # Token ids, or ids mixed with strings, are one prompt (llama-server's rule).
    if not kinds & {b"[", b"{", b'"'} or (not kinds & {b"[", b"{"} and kinds - {b'"'}):
        return 1
    return max(1, n)


def choices(peek: Peek) -> int:
    """Completions per prompt (`Peek.choices`: OpenAI's `n`, or `best_of` when larger)."""
    return peek.choices


def estimate_tokens(body: bytes, peek: Peek, default_max: int, path: str) -> tuple[int, int]:
    """(prompt, completion) estimate for the budget pre-flight: chars/4, and the limit
    (or `default_max` when unbounded) times the prompts times the choices."""
    return estimates(body, peek, default_max, path)[:2]


def estimates(body: bytes, peek: Peek, default_max: int, path: str) -> tuple[int, int, int, int]:
    """`estimate_tokens`, the number of completions (prompts x choices) it counted, and the
    prompts (more than MAX_PROMPTS: a count a token budget cannot reserve on)."""
    limit = completion_limit(peek, path)
    per = default_max if limit is None else limit
    prompts = prompt_count(peek)
    completions = prompts * choices(peek)
    return len(body) // 4, per * completions, completions, prompts


# The limit field each API names when a request gives none (llama-server's native endpoints
# read n_predict, the Responses API max_output_tokens, chat/completions and messages max_tokens).
_OWN_LIMIT = {
    "/completion": "n_predict",
    "/infill": "n_predict",
    "/v1/responses": "max_output_tokens",
    "/responses": "max_output_tokens",
}


def with_limit(body: bytes, peek: Peek, limit: int, path: str) -> bytes:
    """The body with `limit` written into every limit field of this path's API the request
    carries, or into the one field its API reads when it carries none, so the upstream
    cannot generate more.

    Only fields the path's API knows are written: a hosted API refuses a field it does not
    know (OpenAI answers 400 to `n_predict`). Only called for a body `peek_body` accepted as
    a JSON object. A value is replaced where it was sent and a missing field added before
    the closing brace (`body_fields.splice`), never re-encoded: the body names each field
    once, so what the relay reserved on is what any parser reads.
    """
    honoured = PATH_LIMITS.get(path, _OPENAI)
    value = b"%d" % limit
    # A limit field sent as `null` is sent all the same: it is written over too.
    try:
        spans = B.locate(body, peek.members)
        sent = [f for f in honoured if f in spans]
        return B.splice(
            body, spans, dict.fromkeys(sent or [_OWN_LIMIT.get(path, "max_tokens")], value)
        )[0]
    except msgspec.DecodeError:
        raise _invalid("cannot apply the token limit") from None

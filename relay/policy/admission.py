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
- `completion_limit` / `estimate_tokens`: the most tokens the upstream may generate per
  prompt is the largest of the limit fields this path's API honours (llama-server reads
  `n_predict` before `max_tokens`; a field another API names is ignored, so it limits
  nothing); none, or a negative one, is unbounded. The reservation is that limit times the
  prompts (`"prompt": [p1 ... pN]`) times OpenAI's `n`.
- `with_limit`: when a token budget applies, an unbounded request is capped by splicing the
  cap into the limit fields of the path's API (never a field it does not know), so the
  reservation is what the upstream honours.
"""

from __future__ import annotations

import msgspec

from relay.errors import RelayError
from relay.http import fields
from relay.http.request_path import bounded
from relay.policy import admin_access as access

# The limit fields each generation API honours (llama-server reads n_predict first, then
# max_tokens and its alias; a field another API names is ignored on this path: a
# `max_output_tokens` on chat/completions limits nothing). () = the route generates no
# completion tokens (embeddings, rerank). Every route here takes a JSON object.
_OPENAI = ("n_predict", "max_tokens", "max_completion_tokens")
_NATIVE = ("n_predict", "max_tokens")
_RESPONSES = ("max_output_tokens",)
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


MAX_ECHO = 256  # characters of client text quoted in an error message


class Peek(msgspec.Struct):
    """The few request fields the relay reads; everything else is skipped by the decoder."""

    model: str | None = None
    stream: bool | None = None
    n_predict: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None
    # raw (empty when absent): counted, never decoded whole; any JSON type is accepted
    n: msgspec.Raw = msgspec.Raw()  # OpenAI: completions (choices) per prompt
    prompt: msgspec.Raw = msgspec.Raw()  # `prompt_count`


_peek = msgspec.json.Decoder(Peek)


def head_check(
    auth, method: bytes, path: str, headers, peer_host: str | None
) -> tuple[str | None, RelayError | None]:
    """(key id, refusal) decided on the head alone: 401/403 for a caller the request will be
    refused for anyway, so its body is never read. Admin endpoints follow `relay.access`."""
    if access.is_relay_admin(path) or access.is_upstream_admin(method, path):
        refused = access.admin_refusal(auth, headers, peer_host)
        return None, (RelayError(*refused) if refused is not None else None)
    if not auth.enabled:
        return None, None
    key_id = auth.identify(headers)
    if key_id is None:
        return None, RelayError("invalid_api_key", "missing or unknown API key")
    return key_id, None


def _invalid(reason: str) -> RelayError:
    return RelayError(
        "invalid_json", bounded(f"request body is not valid JSON: {reason}", MAX_ECHO)
    )


def peek_body(method: bytes, headers, body: bytes, llm: bool) -> Peek:
    """The peeked fields; `llm`: the path is an LLM endpoint (strict: a JSON object needed)."""
    if method != b"POST":
        return Peek()
    if not llm:
        if not body:
            return Peek()
        ctype = (fields.get(headers, b"content-type") or b"application/json").lower()
        if b"json" not in ctype:  # another kind of body on another endpoint: nothing to read
            try:
                return _peek.decode(body)
            except (msgspec.DecodeError, RecursionError):
                return Peek()
    if not body:
        raise _invalid("the body is empty, a JSON object is expected")
    try:
        return _peek.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if " - at `" not in text:  # the top level itself is not an object
            raise _invalid(f"a JSON object is expected ({text})") from None
        raise RelayError(
            "bad_request", bounded(f"invalid request field: {text}", MAX_ECHO)
        ) from None
    except msgspec.DecodeError as exc:
        raise _invalid(str(exc)) from None
    except RecursionError:
        raise _invalid("nested too deeply") from None


def completion_limit(peek: Peek, path: str) -> int | None:
    """The most completion tokens the upstream may generate for one prompt and choice, None
    when unbounded: the largest of the fields this path's API honours (0 on a route that
    generates no completion; None on a route the relay does not know the fields of)."""
    fields = PATH_LIMITS.get(path)
    if fields is None:
        return None
    if not fields:
        return 0
    asked = [v for v in (getattr(peek, f) for f in fields) if v is not None]
    if not asked or min(asked) < 0:
        return None
    return max(asked)


_raw_items = msgspec.json.Decoder(list[msgspec.Raw])
_int = msgspec.json.Decoder(int)


def prompt_count(peek: Peek) -> int:
    """How many prompts a request carries: `"prompt": [p1 ... pN]` (strings, token lists or
    multimodal objects) is N, each generating up to the limit; a flat list of token ids, or
    of ids mixed with strings (llama-server's one-prompt forms), is one."""
    raw = peek.prompt
    if not bytes(raw).lstrip().startswith(b"["):
        return 1
    try:
        items = _raw_items.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return 1
    kinds = {bytes(i).lstrip()[:1] for i in items}
    if not kinds & {b"[", b"{", b'"'} or (not kinds & {b"[", b"{"} and kinds - {b'"'}):
        return 1  # token ids, or ids mixed with strings: one prompt (llama-server's rule)
    return max(1, len(items))


def choices(peek: Peek) -> int:
    """OpenAI's `n`: completions per prompt (1 when absent or not a positive integer)."""
    if not peek.n:
        return 1
    try:
        n = _int.decode(peek.n)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 1
    return n if n > 1 else 1


def estimate_tokens(body: bytes, peek: Peek, default_max: int, path: str) -> tuple[int, int]:
    """(prompt, completion) estimate for the budget pre-flight: chars/4, and the limit
    (or `default_max` when unbounded) times the prompts times the choices."""
    return estimates(body, peek, default_max, path)[:2]


def estimates(body: bytes, peek: Peek, default_max: int, path: str) -> tuple[int, int, int]:
    """`estimate_tokens` and the number of completions (prompts x choices) it counted."""
    limit = completion_limit(peek, path)
    per = default_max if limit is None else limit
    completions = prompt_count(peek) * choices(peek)
    return len(body) // 4, per * completions, completions


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
    a JSON object. The fields are spliced in before the closing brace, not re-encoded: a
    duplicate key resolves to the last one both in msgspec and in llama-server's parser, so
    what the relay reserved on and what the upstream reads agree.
    """
    fields = PATH_LIMITS.get(path, _OPENAI)
    present = [f for f in fields if getattr(peek, f) is not None]
    return splice_fields(
        body, [(f, limit) for f in present or [_OWN_LIMIT.get(path, "max_tokens")]]
    )


_WS = b" \t\r\n"


def splice_fields(body: bytes, fields: list[tuple[str, int]]) -> bytes:
    """`body` (a JSON object) with `"name":value` members appended before its closing brace;
    one copy of the body, never a decode."""
    end = len(body)
    while end and body[end - 1] in _WS:
        end -= 1
    end -= 1  # the closing brace
    if end < 1 or body[end] != 0x7D:
        raise _invalid("cannot apply the token limit")
    last = end
    while last and body[last - 1] in _WS:
        last -= 1
    if not last:
        raise _invalid("cannot apply the token limit")
    sep = b"" if body[last - 1] == 0x7B else b","  # `{}`: no member before
    members = b",".join(b'"%s":%d' % (name.encode(), value) for name, value in fields)
    view = memoryview(body)
    return b"".join((view[:last], sep, members, view[end:]))

"""Admission decisions on one request, without sockets: who may send a body, what it asks for.

- `head_check`: decided as soon as the head is in, before one body byte is read or a
  `100 Continue` is sent: a caller without a valid key never makes the relay buffer its body.
- `peek_body`: the few JSON fields the relay reads. On the LLM endpoints (the slot paths) the
  body is read as JSON whatever its Content-Type says, as llama-server parses any body as
  JSON; one that is not a JSON object is refused there (400 `invalid_json`). Nesting too deep
  for the decoder is invalid JSON too, not a relay error.
- `completion_limit` / `with_limit`: the most tokens the upstream may generate is the largest
  of every limit field it may read (llama-server reads `n_predict` before `max_tokens`); a
  request with no limit, or a negative one, is unbounded. When a token budget applies, an
  unbounded request is capped by writing the cap into every limit field of the forwarded
  body, so the reservation is what the upstream honours.
"""

from __future__ import annotations

import msgspec

from relay import access
from relay import headers as hdr
from relay.errors import RelayError
from relay.paths import bounded

# Paths that occupy one of llama-server's slots (others, like /health, never wait for one).
SLOT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions",
                        "/completions", "/completion", "/v1/embeddings", "/embeddings",
                        "/embedding", "/infill", "/v1/responses"})
# The completion limits an OpenAI-compatible upstream may read (llama-server: n_predict first).
LIMIT_FIELDS = ("n_predict", "max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_ECHO = 256  # characters of client text quoted in an error message


class Peek(msgspec.Struct):
    """The few request fields the relay reads; everything else is skipped by the decoder."""

    model: str | None = None
    stream: bool | None = None
    n_predict: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None


_peek = msgspec.json.Decoder(Peek)


def head_check(auth, method: bytes, path: str, headers,
               peer_host: str | None) -> tuple[str | None, RelayError | None]:
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
    return RelayError("invalid_json", bounded(f"request body is not valid JSON: {reason}",
                                              MAX_ECHO))


def peek_body(method: bytes, headers, body: bytes, llm: bool) -> Peek:
    """The peeked fields; `llm`: the path is an LLM endpoint (strict: a JSON object needed)."""
    if method != b"POST":
        return Peek()
    if not llm:
        if not body:
            return Peek()
        ctype = (hdr.get(headers, b"content-type") or b"application/json").lower()
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
        raise RelayError("bad_request", bounded(f"invalid request field: {text}",
                                                MAX_ECHO)) from None
    except msgspec.DecodeError as exc:
        raise _invalid(str(exc)) from None
    except RecursionError:
        raise _invalid("nested too deeply") from None


def completion_limit(peek: Peek) -> int | None:
    """The most completion tokens the upstream may generate, None when unbounded."""
    asked = [v for v in (peek.n_predict, peek.max_tokens, peek.max_completion_tokens,
                         peek.max_output_tokens) if v is not None]
    if not asked or min(asked) < 0:
        return None
    return max(asked)


def estimate_tokens(body: bytes, peek: Peek, default_max: int) -> tuple[int, int]:
    """(prompt, completion) estimate for the budget pre-flight: chars/4 and the limit."""
    limit = completion_limit(peek)
    return len(body) // 4, default_max if limit is None else limit


# The limit field each API names when a request gives none (llama-server's native endpoints
# read n_predict, OpenAI's Responses API max_output_tokens, its chat/completions max_tokens).
_OWN_LIMIT = {"/completion": "n_predict", "/infill": "n_predict",
              "/v1/responses": "max_output_tokens"}


def with_limit(body: bytes, limit: int, path: str) -> bytes:
    """The body with `limit` in every limit field it has, or in the one field its API reads
    when it has none, so the upstream cannot generate more.

    Only the fields the request already carries (or its API's own) are written: a hosted API
    refuses a field it does not know (OpenAI answers 400 to `n_predict`). Only called for a
    body `peek_body` accepted as a JSON object; decoding it whole (rather than splicing bytes)
    keeps what the upstream reads and what the relay enforces the same even for duplicate
    keys (the last one wins for both).
    """
    try:
        doc = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        raise _invalid("cannot apply the token limit") from None
    present = [name for name in LIMIT_FIELDS if name in doc]
    for name in present or [_OWN_LIMIT.get(path, "max_tokens")]:
        doc[name] = limit
    return msgspec.json.encode(doc)

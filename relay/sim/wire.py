"""What every simulator response is made of: the head, chunked framing, fixed events, errors.

Also what the Anthropic Messages and OpenAI Responses builders share: named SSE events,
llama-server's 32-character ids, the prompt's text length, and `PiecedFrames`; and the names
the modules above pass each other: `Route` (what a request asks for), `Kind` (what a
generation's body is made of), `Shape` (whose chat chunks), `Finish` (why it ended),
`ToolCall` and `Timings`.

Pure byte builders in llama-server's wire shape (see tests/support/captures/llama-server/):
its header set and order, HTTP chunk framing, the fixed SSE events (``[DONE]``, the error
event), and its error JSON (key order code, message, type).
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterable
from enum import StrEnum
from http import HTTPStatus
from typing import NamedTuple, TypedDict

import msgspec

_enc = msgspec.json.Encoder()
jdump = _enc.encode

# A JSON object as msgspec decodes a request body: any JSON under its keys, so every value is
# checked before use.
Json = dict[str, object]

JSON_CT = b"application/json; charset=utf-8"
SSE_CT = b"text/event-stream"
OCTET_CT = b"application/octet-stream"
METRICS_CT = b"text/plain; version=0.0.4"
KEEP_ALIVE = b"Keep-Alive: timeout=5, max=100"
TERMINATOR = b"0\r\n\r\n"
DONE_EVENT = b"data: [DONE]\n\n"

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "unavailable_error",
    501: "not_supported_error",
    503: "unavailable_error",
}
ERROR_MESSAGES = {
    400: "Invalid request",
    401: "Invalid API Key",
    403: "Forbidden",
    404: "File Not Found",
    429: "Too many requests, try again later",
    500: "Internal server error (simulated)",
    503: "Loading model",
}


class Route(StrEnum):
    """What a request asks for, as conn.py's table names its method and path."""

    HEALTH = "health"
    MODELS = "models"
    PROPS = "props"
    SLOTS = "slots"
    METRICS = "metrics"
    CHAT = "chat"
    TEXT = "text"
    NATIVE = "native"
    MESSAGES = "messages"
    COUNT_TOKENS = "count_tokens"
    RESPONSES = "responses"
    INPUT_TOKENS = "input_tokens"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    EMBEDDINGS = "embeddings"


class Kind(StrEnum):
    """What a generation's body is made of: its route's events (each generation route has the
    kind of its name), or the binary blobs the ``body_kind`` knob asks for."""

    CHAT = "chat"
    TEXT = "text"
    NATIVE = "native"
    MESSAGES = "messages"
    RESPONSES = "responses"
    OCTET = "octet"


class Shape(StrEnum):
    """Whose chat chunks a stream is made of: llama-server's, vLLM's or OpenAI's (shapes.py)."""

    LLAMA = "llama"
    VLLM = "vllm"
    OPENAI = "openai"


class Finish(StrEnum):
    """Why a generation ended, as ``finish_reason`` writes it: the model stopped (on its own or
    on a stop word), or the token limit cut it."""

    STOP = "stop"
    LENGTH = "length"


class ToolCall(NamedTuple):
    """The tool call a Messages or Responses generation makes: the tool's name, and its
    arguments' text in the pieces that stream one event each."""

    name: str
    pieces: list[str]


class Timings(TypedDict):
    """llama-server's ``timings`` object, in its key order (completion.timings builds it)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


def reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


def head(
    status: int,
    ctype: bytes,
    *,
    length: int | None = None,
    sse: bool = False,
    close: bool = False,
    extra: tuple[bytes, ...] = (),
) -> bytes:
    """Response head in llama-server's header order (chunked when length is None)."""
    lines = [
        b"HTTP/1.1 %d %s" % (status, reason(status)),
        b"Server: llama.cpp",
        b"Access-Control-Allow-Origin: ",
        *extra,
    ]
    if sse:
        lines.append(b"X-Accel-Buffering: no")
    lines.append(b"Content-Type: " + ctype)
    lines.append(
        b"Transfer-Encoding: chunked" if length is None else b"Content-Length: %d" % length
    )
    lines.append(b"Connection: close" if close else KEEP_ALIVE)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def error_obj(code: int, message: str | None = None, type_: str | None = None) -> Json:
    """llama-server error object, key order code, message, type (as for 400/5xx)."""
    return {
        "error": {
            "code": code,
            "message": message or ERROR_MESSAGES.get(code, "simulated error"),
            "type": type_
            or ERROR_TYPES.get(code, "server_error" if code >= 500 else "invalid_request_error"),
        }
    }


def error_body(code: int, message: str | None = None, type_: str | None = None) -> bytes:
    return jdump(error_obj(code, message, type_))


# The head of a chunked event stream on a kept-alive connection.
SSE_HEAD = head(200, SSE_CT, sse=True)
NOT_FOUND_BODY = b'{"error":{"message":"File Not Found","type":"not_found_error","code":404}}'
ERROR_EVENT = b'data: {"error":{"code":500,"message":"simulated","type":"server_error"}}\n\n'


_ALNUM = string.ascii_letters + string.digits


def rand32() -> str:
    """An id's random part as llama-server writes it: 32 letters and digits."""
    return "".join(random.choices(_ALNUM, k=32))


def text_chars(content: object) -> int:
    """Characters of a message's text: a string, or the `text` of its parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(json_len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0


def json_iter(value: object) -> Iterable[object]:
    """A decoded JSON value as `for` walks it: an array's items, an object's keys, a string's
    characters. A number is not iterable: TypeError, as `for` raises."""
    if isinstance(value, str | list | dict | tuple):
        return value
    raise TypeError(f"'{type(value).__name__}' object is not iterable")


def json_len(value: object) -> int:
    """`len` of a decoded JSON value: a string's characters, an array's or an object's items.
    A number has no length: TypeError, as `len` raises."""
    if isinstance(value, str | list | dict):
        return len(value)
    raise TypeError(f"object of type '{type(value).__name__}' has no len()")


def sse(name: bytes, data: bytes) -> bytes:
    """A named SSE event: ``event: NAME`` then ``data: DATA``."""
    return b"event: " + name + b"\ndata: " + data + b"\n\n"


class PiecedFrames:
    """A stream of `text_n` text tokens (None: text only), then a tool call's argument
    pieces; its subclasses build `event(i)` and keep `_cache` and `text_n`. The text tokens'
    chunks repeat every six tokens (the tiny model's cycle), so each is framed once."""

    __slots__ = ()
    _cache: dict[int, bytes]
    text_n: int | None

    def event(self, i: int) -> bytes:
        raise NotImplementedError

    def _is_text(self, i: int) -> bool:
        return self.text_n is None or i < self.text_n

    def chunk(self, i: int) -> bytes:
        if not self._is_text(i):
            return chunk(self.event(i))
        key = -1 if i == 0 else i % 6
        c = self._cache.get(key)
        if c is None:
            c = self._cache[key] = chunk(self.event(i))
        return c

"""Which streaming API a response speaks, recognised by its own events, and what that API
counts as content.

- CHAT: OpenAI chat completions chunks (`"object":"chat.completion.chunk"`), `[DONE]` last;
- TEXT: OpenAI legacy completions (`"object":"text_completion"`), `[DONE]` last;
- NATIVE: llama-server's `/completion` (`{"content":..,"stop":false,..}`), no `[DONE]`;
- MESSAGES: Anthropic Messages (`event: message_start`, `content_block_*`, `message_delta`,
  `message_stop`), no `[DONE]`;
- RESPONSES: OpenAI Responses (`event: response.created`, ..., `response.completed`), no
  `[DONE]`.

The request path gives the first guess (`from_path`: a hold may have to answer before the
upstream said anything); the first event that names its API decides (`recognise`), so a
path prefix, router mode or a route the relay does not know still gets its API's shape.

Content (the events that open the hold, stamp TTFT, count tokens and feed the ITL
histogram) is a non-empty generated string: chat's `delta.content` / `reasoning_content` /
tool `arguments`, legacy and native `text` / `content`, Anthropic's `text_delta.text`,
`thinking_delta.thinking` and `input_json_delta.partial_json` (`MARKERS`); on RESPONSES only
the `delta` string of the `*.delta` events (`output_text`, `reasoning_text`,
`reasoning_summary_text`, `function_call_arguments`, ...): its `.done` events and
`response.completed` repeat the whole text (`RESPONSES_MARKERS`).
"""

from __future__ import annotations

from enum import StrEnum


class Api(StrEnum):
    """A streaming API the relay reads (docs/apis.md)."""

    CHAT = "chat"
    TEXT = "text"
    NATIVE = "native"
    MESSAGES = "messages"
    RESPONSES = "responses"


CHAT, TEXT, NATIVE, MESSAGES, RESPONSES = Api

# A value that starts with a quote and is not the empty string: `"content":"x`.
MARKERS = (
    b'"content":"',
    b'"text":"',
    b'"reasoning_content":"',
    b'"arguments":"',
    b'"thinking":"',
    b'"partial_json":"',
)
RESPONSES_MARKERS = (b'"delta":"',)

_PATHS: dict[str, Api] = {
    "/v1/completions": TEXT,
    "/completions": TEXT,
    "/completion": NATIVE,
    "/infill": NATIVE,
    "/v1/messages": MESSAGES,
    "/messages": MESSAGES,
    "/v1/responses": RESPONSES,
    "/responses": RESPONSES,
}


def from_path(path: str) -> Api:
    """The API a request path names (CHAT for any other: the relay's historical shape)."""
    return _PATHS.get(path, CHAT)


def event_name(ev: bytes) -> bytes:
    """The `event:` field of an event (its first line as servers write it, or a line after an
    `id:` or `retry:` one), else the `"type"` its data names first, else b""."""
    if ev.startswith(b"event:"):
        start = 6
    else:
        start = ev.find(b"\nevent:") + 8
        if start < 8:
            data = ev.find(b"data:")
            i = ev.find(b'"type":"', data, data + 72) if data >= 0 else -1
            if i < 0:
                return b""
            j = ev.find(b'"', i + 8)
            return ev[i + 8 : j] if j > 0 else b""
    nl = ev.find(b"\n", start)
    return ev[start : nl if nl >= 0 else len(ev)].strip()


def recognise(ev: bytes) -> Api | None:
    """The API an event belongs to, when it names one (None: a comment, an error, ...)."""
    name = event_name(ev)
    if name.startswith((b"message_", b"content_block_")):
        return MESSAGES
    if name.startswith(b"response."):
        return RESPONSES
    if b'"object":"chat.completion' in ev:
        return CHAT
    if b'"object":"text_completion"' in ev:
        return TEXT
    if b'"stop":' in ev and b'"content":' in ev and b'"object":' not in ev:
        return NATIVE
    return None

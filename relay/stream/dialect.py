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

import re
from enum import StrEnum

import msgspec


class Api(StrEnum):
    """A streaming API the relay reads (docs/apis.md)."""

    CHAT = "chat"
    TEXT = "text"
    NATIVE = "native"
    MESSAGES = "messages"
    RESPONSES = "responses"


CHAT, TEXT, NATIVE, MESSAGES, RESPONSES = Api

# A value that starts with a quote and is not the empty string: `"content":"x` (and, in a
# stream spelt otherwise, the same name with white space around its colon:
# `sse.carries_content`).
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
    """An event's name as a client reads it (the WHATWG event-stream rules): the value of its
    last `event` field, one space after the colon dropped, whatever its line ends (LF, CRLF,
    CR); else the `"type"` its data names (`data_type`); else b""."""
    if ev.startswith(b"event:"):
        nl = ev.find(10)
        # The usual event: its name, then its data, each line ended by LF (one LF in all).
        if ev.rfind(10) == nl > 6:
            name = ev[7:nl] if ev[6] == 32 else ev[6:nl]
            if 13 not in name:
                return name
    elif ev.find(b"event") < 0:
        return data_type(ev)
    if 13 in ev:
        ev = ev.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    name = b""
    for line in ev.split(b"\n"):
        field, value = field_of(line)
        if field == b"event":
            name = value
    return name or data_type(ev)


def field_of(line: bytes) -> tuple[bytes, bytes]:
    """An event-stream line's field and value as a client reads them (the WHATWG rules): the
    name before its first colon (the whole line without one), the value after it with one
    leading space dropped."""
    field, _, value = line.partition(b":")
    return field, value[1:] if value[:1] == b" " else value


class _Typed(msgspec.Struct):
    type: str = ""


_typed = msgspec.json.Decoder(_Typed)


def data_type(ev: bytes) -> bytes:
    """The `"type"` an event's data names at its top level, in any spelling JSON allows
    (escaped, spaced, over several `data:` lines): read in place when the data starts
    `{"type":"` and the name has no escape, else by a parse of the data. b"" when it names
    none (no `type` can be spelt without the word or a `\\u` escape: then no parse)."""
    if ev.startswith(b"data:"):
        i = 5
    else:
        i = ev.find(b"\ndata:") + 6
        if i < 6:
            return b""
    i += ev[i : i + 1] == b" "
    if ev.startswith(b'{"type":"', i):
        j = ev.find(b'"', i + 9)
        if j > 0 and ev.find(b"\\", i + 9, j) < 0 and ev.find(b"\n", i + 9, j) < 0:
            return ev[i + 9 : j]
    if ev.find(b"type") < 0 and (92 not in ev or ev.find(b"\\u") < 0):
        return b""
    try:
        return _typed.decode(data_of(ev)).type.encode()
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeEncodeError):
        return b""


def data_of(ev: bytes) -> bytes:
    """An event's data as a client reads it: its `data` fields' values (one space after the
    colon dropped) joined with LF; its lines end in LF (the scanner's events do)."""
    values = []
    for line in ev.split(b"\n"):
        field, value = field_of(line)
        if field == b"data":
            values.append(value)
    return b"\n".join(values)


# `\u0041`-`\u007f`: the only escapes that unescape to a letter, digit or `_` of a name
# (the rule `policy.body_fields` applies to request bodies).
_ESCAPED_LETTER = re.compile(rb"\\u00[4-7][0-9a-fA-F]")
# White space around a colon: after a name's closing quote, or after the colon (spaces,
# tabs, line ends: data over several `data:` lines, a CR).
_SPACED = (b'" ', b'": ')
_TABBED = (b'"\t', b'":\t')
_LINED = (b'"\n', b'":\n', b'"\r', b'":\r')


def escapes_a_letter(ev: bytes) -> bool:
    """The event may spell a name with escapes (`"\\u0074ype"`): a search for its quoted
    name that missed is sure only without."""
    return ev.find(b"\\u00") >= 0 and _ESCAPED_LETTER.search(ev) is not None


def spelt_otherwise(ev: bytes) -> bool:
    """The event may spell a name or its colon otherwise than compact and unescaped."""
    i = ev.find(b"data:") + 5
    if i < 5:
        return False
    body = ev[i + 1 :] if ev[i : i + 1] == b" " else ev[i:]
    if 92 in body and escapes_a_letter(body):
        return True
    # (each pair tested only when its white space byte is there: a test of one byte)
    return (
        (32 in body and any(p in body for p in _SPACED))
        or (9 in body and any(p in body for p in _TABBED))
        or ((10 in body or 13 in body) and any(p in body for p in _LINED))
    )


def parsed(ev: bytes) -> object:
    """An event's data parsed, None when it is not JSON."""
    try:
        doc: object = msgspec.json.decode(data_of(ev))
    except msgspec.DecodeError:
        return None
    return doc


def recognise(ev: bytes) -> Api | None:
    """The API an event belongs to, when it names one (None: a comment, an error, ...), as
    its compact spelling says (`recognise_parsed` reads any other)."""
    name = event_name(ev)
    if name.startswith((b"message_", b"content_block_")):
        return MESSAGES
    if name.startswith(b"response."):
        return RESPONSES
    if ev.find(b'"object":"chat.completion') >= 0:
        return CHAT
    if ev.find(b'"object":"text_completion"') >= 0:
        return TEXT
    if ev.find(b'"stop":') >= 0 and ev.find(b'"content":') >= 0 and ev.find(b'"object":') < 0:
        return NATIVE
    return None


def recognise_parsed(ev: bytes) -> Api | None:
    """`recognise` of an event spelt otherwise (`spelt_otherwise`): by its parsed data."""
    doc = parsed(ev)
    if not isinstance(doc, dict):
        return None
    kind = doc.get("object")
    if isinstance(kind, str) and kind.startswith("chat.completion"):
        return CHAT
    if kind == "text_completion":
        return TEXT
    if "stop" in doc and "content" in doc and "object" not in doc:
        return NATIVE
    return None

"""The frames the relay itself ends a stream with, in the stream's own API (`stream.dialect`).

- `stall_frame`: the stall guard cut a stream the client has seen content of. An event the
  upstream left half sent is ended first (`half_event`: so it parses; finished when it is a
  content delta, dropped when it could end the stream or carry figures), and what the frame
  closes is read with it as the client reads it (its `sequence_number` taken, a whole end
  that only lacked its blank line is the stream's own). Then the stream ends as its API ends
  a stream cut short, with the relay's `x_relay_stall {reason, elapsed_s, upstream}`
  extension, so each SDK ends cleanly and can tell:
  - CHAT / TEXT: a `finish_reason: "length"` chunk holding the notice, then `data: [DONE]`;
  - NATIVE (`/completion`): a `"stop":true,"stop_type":"limit"` event, no `[DONE]`;
  - MESSAGES: the notice as a `text_delta` if a text block is open (never inside a tool_use
    or thinking block), `content_block_stop` for an open block, `message_delta` with
    `"stop_reason":"max_tokens"` and the output counted, `message_stop`; before any
    `message_start` went out, Anthropic's `event: error` instead;
  - RESPONSES: `response.incomplete` (`incomplete_details.reason = "max_output_tokens"`) of
    the response the stream created (its id; `output` left out, so an SDK keeps the items it
    accumulated), the output counted in `usage`, the next `sequence_number`; before any
    `response.created` went out, an `error` event (`code: "server_error"`).
  None (nothing) when the stream's own end already went by.
- `error_events`: a failure told inside a stream whose 200 head went out but nothing else
  (heartbeats only): chat's `{"error": ...}` event and `[DONE]`; native's event alone;
  Anthropic's `event: error` (its SDK raises `APIStatusError`); a Responses `error` event.
"""

from __future__ import annotations

import msgspec

from relay.errors import error_event
from relay.stream import dialect as D
from relay.stream.half_event import Fate, close_event
from relay.stream.sse import SseScanner, event_json

DONE_EVENT = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode

# the relay's error types as Anthropic names them (its SDK maps them to its own errors)
_ANTHROPIC_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
    "timeout_error": "timeout_error",
    "overloaded_error": "overloaded_error",
    "api_error": "api_error",
}
_BUSY = ("upstream_busy", "server_busy", "upstream_unavailable", "shutting_down")


def stall_notice(reason: str, elapsed_s: float) -> str:
    return f"\n\n[relay] stall guard: {reason} after {elapsed_s}s"


def _stall_info(reason: str, elapsed_s: float, upstream: str) -> dict[str, object]:
    return {"reason": reason, "elapsed_s": elapsed_s, "upstream": upstream}


def _sse(name: str, doc: dict[str, object]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(doc) + b"\n\n"


def stall_frame(
    scanner: SseScanner | None,
    dialect: str,
    model: str,
    reason: str,
    elapsed_s: float,
    upstream: str,
    created: int,
) -> bytes:
    """The end of the event the upstream left half sent (`half_event`; a blank line when it
    left none), then the API's end of a stream cut short; b"" when the stream's own end
    already went out."""
    lead = b"\n\n"
    if scanner is not None:
        if scanner.done_seen:
            return b""
        dialect = scanner.dialect
        if scanner.pending:
            seq = _next_sequence(scanner) if dialect == D.RESPONSES else None
            closing = close_event(scanner.pending, scanner.dialect, seq)
            lead = closing.tail
            if closing.fate != Fate.BROKEN:
                # The client reads that event as it now ends: the frame follows from it.
                scanner = scanner.after(lead)
                if scanner.done_seen:
                    return lead
    info = _stall_info(reason, elapsed_s, upstream)
    text = stall_notice(reason, elapsed_s)
    if dialect == D.MESSAGES:
        return lead + _messages_end(scanner, text, info)
    if dialect == D.RESPONSES:
        return lead + _responses_end(scanner, text, info)
    if dialect == D.NATIVE:
        doc = {"content": text, "stop": True, "stop_type": "limit", "x_relay_stall": info}
        return lead + b"data: " + _encode(doc) + b"\n\n"
    head = {"id": "relay-stall-guard"}
    if dialect == D.TEXT:
        choice: dict[str, object] = {"index": 0, "text": text, "finish_reason": "length"}
        head["object"] = "text_completion"
    else:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
        head["object"] = "chat.completion.chunk"
    doc = {**head, "created": created, "model": model, "choices": [choice], "x_relay_stall": info}
    return lead + b"data: " + _encode(doc) + b"\n\n" + DONE_EVENT


def _messages_end(scanner: SseScanner | None, text: str, info: dict[str, object]) -> bytes:
    if scanner is None or not scanner.started:
        return anthropic_error("api_error", text.strip(), info)
    out = []
    blocks = scanner.blocks
    if blocks:
        # The block being written: llama-server may leave a text block open under a tool_use
        # one, and the notice never goes into a tool_use block.
        last = max(blocks)
        if blocks[last] == "text":
            delta = {"type": "text_delta", "text": text}
            out.append(
                _sse(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": last, "delta": delta},
                )
            )
        for index in sorted(blocks):
            out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    if not scanner.delta_seen:
        out.append(
            _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                    "usage": {"output_tokens": scanner.content_events},
                    "x_relay_stall": info,
                },
            )
        )
    stop: dict[str, object] = {"type": "message_stop"}
    if scanner.delta_seen:
        # The upstream's stop reason and usage went out: this end alone tells the stall.
        stop["x_relay_stall"] = info
    out.append(_sse("message_stop", stop))
    return b"".join(out)


class _Seq(msgspec.Struct):
    sequence_number: int = -1


class _Created(msgspec.Struct):
    response: dict[str, object] = msgspec.field(default_factory=dict)


def _next_sequence(scanner: SseScanner) -> int | None:
    """The `sequence_number` after the last event's, None when the stream numbers none
    (llama-server's does not)."""
    body = event_json(scanner.last_event) if scanner.last_event else None
    try:
        seq = msgspec.json.decode(body, type=_Seq).sequence_number if body else -1
    except (msgspec.DecodeError, msgspec.ValidationError):
        seq = -1
    return seq + 1 if seq >= 0 else None


def _responses_end(scanner: SseScanner | None, text: str, info: dict[str, object]) -> bytes:
    seq = _next_sequence(scanner) if scanner is not None else None
    body = event_json(scanner.head_event) if scanner is not None and scanner.started else None
    try:
        response = msgspec.json.decode(body, type=_Created).response if body else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        response = None
    if not response or scanner is None:
        return responses_error("server_error", text.strip(), seq, info)
    # The client keeps the items it accumulated.
    response.pop("output", None)
    usage = response.get("usage")
    told = usage.get("input_tokens") if isinstance(usage, dict) else None
    prompt = told if isinstance(told, int) else 0
    out = scanner.content_events
    response.update(
        status="incomplete",
        incomplete_details={"reason": "max_output_tokens"},
        usage={"input_tokens": prompt, "output_tokens": out, "total_tokens": prompt + out},
    )
    doc: dict[str, object] = {"type": "response.incomplete"}
    if seq is not None:
        doc["sequence_number"] = seq
    doc.update(response=response, x_relay_stall=info)
    return _sse("response.incomplete", doc)


def anthropic_error(type_: str, message: str, info: dict[str, object] | None = None) -> bytes:
    error: dict[str, object] = {"type": type_, "message": message}
    doc: dict[str, object] = {"type": "error", "error": error}
    if info is not None:
        doc["x_relay_stall"] = info
    return _sse("error", doc)


def responses_error(
    code: str, message: str, seq: int | None = None, info: dict[str, object] | None = None
) -> bytes:
    doc: dict[str, object] = {"type": "error", "code": code, "message": message, "param": None}
    if seq is not None:
        doc["sequence_number"] = seq
    if info is not None:
        doc["x_relay_stall"] = info
    return _sse("error", doc)


def error_events(dialect: str, message: str, type_: str, code: str | None) -> bytes:
    """The in-band error that ends a stream only comments of went out, in its API's shape."""
    if dialect == D.MESSAGES:
        kind = "overloaded_error" if code in _BUSY else _ANTHROPIC_TYPES.get(type_, "api_error")
        return anthropic_error(kind, message)
    if dialect == D.RESPONSES:
        return responses_error(code or "server_error", message)
    if dialect == D.NATIVE:
        return error_event(message, type_, code)
    return error_event(message, type_, code) + DONE_EVENT

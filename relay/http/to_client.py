"""What the relay writes to the client: response heads (relayed or its own), whole answers.

The upstream's headers cross minus hop-by-hop ones and the relay's own `X-Request-Id`; the
framing headers are the relay's to set for the client's side of the wire.
"""

from __future__ import annotations

from relay.http.fields import (
    HOP_BY_HOP,
    HeaderPairs,
    Headers,
    connection_tokens,
    header_line,
    kept,
    lower_names,
)

_NOT_DOWNSTREAM = HOP_BY_HOP | {b"x-request-id"}
# ... and no Content-Length where the client's framing is the relay's chunking, or where
# the status has no body and forbids one (204, 1xx: RFC 9110 8.6).
_NOT_DOWNSTREAM_NO_LENGTH = _NOT_DOWNSTREAM | {b"content-length"}


def with_cors(headers: HeaderPairs, own: HeaderPairs) -> Headers:
    """The upstream's headers with its own CORS answer (`Access-Control-*`) replaced by the
    relay's (`own`, from `policy.cors`)."""
    return [(k, v) for k, v in headers if not k.lower().startswith(b"access-control-")] + list(own)


def server_timing(relay_ms: float, queue_ms: float, upstream_ms: float, hold_ms: float) -> bytes:
    """The relay's own `Server-Timing` field line (W3C Server Timing; durations in ms, to the
    microsecond) for a response head relayed from an upstream's: `relay`, its own time before
    the request was written upstream, the queue wait excluded; `queue`, the wait for a slot;
    `upstream`, from the request written upstream to the response head read; `hold`, from
    that head read to the read that let it go out (an event stream's first content event).
    A line of its own: an upstream's `Server-Timing` crosses unchanged beside it (a list
    field may be repeated)."""
    return b"Server-Timing: relay;dur=%.3f, queue;dur=%.3f, upstream;dur=%.3f, hold;dur=%.3f" % (
        relay_ms,
        queue_ms,
        upstream_ms,
        hold_ms,
    )


def client_response(
    status: int,
    reason: bytes,
    upstream: HeaderPairs,
    request_id: bytes,
    chunked: bool,
    keep_alive: bool,
) -> bytes:
    """The response head sent to the client: upstream headers minus hop-by-hop ones.

    Content-Length crosses unchanged when the upstream gave one (the body is passed through
    as is); `chunked` adds the relay's own Transfer-Encoding instead, so the head never holds
    both. A 204 or 1xx never carries a Content-Length.
    """
    no_length = chunked or status == 204 or status < 200
    drop = (_NOT_DOWNSTREAM_NO_LENGTH if no_length else _NOT_DOWNSTREAM) | connection_tokens(
        upstream
    )
    lines = [b"HTTP/1.1 %d %s" % (status, reason)]
    lines += map(header_line, kept(upstream, lower_names(upstream), drop))
    if chunked:
        lines.append(b"Transfer-Encoding: chunked")
    lines.append(b"X-Request-Id: " + request_id)
    if not keep_alive:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def relay_response(
    status: int,
    reason: bytes,
    body: bytes,
    request_id: bytes | None,
    keep_alive: bool,
    extra: HeaderPairs = (),
    content_type: bytes = b"application/json",
) -> bytes:
    """A whole response the relay answers itself (errors, metrics, model list)."""
    lines = [
        b"HTTP/1.1 %d %s" % (status, reason),
        b"Content-Type: " + content_type,
        b"Content-Length: %d" % len(body),
    ]
    lines.extend(map(header_line, extra))
    if request_id is not None:
        lines.append(b"X-Request-Id: " + request_id)
    if not keep_alive:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body

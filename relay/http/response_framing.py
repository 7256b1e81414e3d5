"""How a response body is delimited upstream, and how it is carried to the client."""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from relay.http.chunked import LAST_CHUNK, ChunkTracker, frame
from relay.http.fields import Headers, get, has_token
from relay.http.response_head import is_chunked, is_length


class BodyKind(StrEnum):
    """How the upstream delimits its response body."""

    EMPTY = "empty"
    LENGTH = "length"
    CHUNKED = "chunked"
    UNTIL_CLOSE = "close"


class Carriage(StrEnum):
    """How an upstream body is carried to the client.

    - PASS: bytes as they come (chunked to chunked raw, length to length, close to close);
    - DECHUNK: a chunked upstream to an HTTP/1.0 client: payloads, then the close;
    - CHUNK: a close-delimited upstream to an HTTP/1.1 client: the relay frames chunks;
    - REFRAME: the client's head went out before this upstream's (heartbeats,
      `stream.content_hold`): payloads, which the relay frames as chunks itself; a chunked
      upstream goes back to PASS at a chunk boundary.
    """

    PASS = "pass"
    DECHUNK = "dechunk"
    CHUNK = "chunk"
    REFRAME = "reframe"


EMPTY, LENGTH, CHUNKED, UNTIL_CLOSE = BodyKind
PASS, DECHUNK, CHUNK, REFRAME = Carriage


class FramingError(ValueError):
    pass


def upstream_body(method: bytes, status: int, headers: Headers) -> tuple[BodyKind, int]:
    """(kind, content length) of an upstream response body (RFC 9112 section 6.3)."""
    if method == b"HEAD" or status < 200 or status in (204, 304):
        return EMPTY, 0
    te = get(headers, b"transfer-encoding")
    cl = get(headers, b"content-length")
    if te is not None:
        # `chunked` alone: another coding would reach the client dropped or mangled, and a
        # Content-Length beside it makes the framing ambiguous (RFC 9112 6.1, 6.3 item 3).
        # http.response_head refuses such heads first; this stays total on its own.
        if not is_chunked(te):
            raise FramingError(f"unknown Transfer-Encoding {te[:40]!r}")
        if cl is not None:
            raise FramingError("Content-Length and Transfer-Encoding together")
        return CHUNKED, -1
    if cl is not None:
        if not is_length(cl):
            raise FramingError(f"bad Content-Length {cl[:20]!r}")
        n = int(cl)
        return (LENGTH, n) if n else (EMPTY, 0)
    return UNTIL_CLOSE, -1


def carriage(kind: BodyKind, client_http11: bool) -> Carriage:
    if kind == CHUNKED and not client_http11:
        return DECHUNK
    if kind == UNTIL_CLOSE and client_http11:
        return CHUNK
    return PASS


def committed_carriage(kind: BodyKind, client_http11: bool) -> Carriage:
    """The carriage when the client's head is already out: chunks of the relay's own for an
    HTTP/1.1 client, a close-delimited body (payloads) for HTTP/1.0."""
    if client_http11:
        return REFRAME
    return DECHUNK if kind == CHUNKED else PASS


def client_chunked(kind: BodyKind, mode: Carriage) -> bool:
    """Whether the client sees Transfer-Encoding: chunked."""
    return (kind == CHUNKED and mode == PASS) or mode in (CHUNK, REFRAME)


def relay_frames(mode: Carriage) -> bool:
    """Whether the relay frames the client's chunks itself (else bytes go as they are)."""
    return mode is CHUNK or mode is REFRAME


def payload_of(kind: BodyKind, mode: Carriage, pieces: list[bytes]) -> bytes:
    """The body payload in pieces that were to go to the client: the upstream's own chunks
    (a chunked body passed through) are undone; others are payload already."""
    sent = b"".join(pieces)
    if not (kind is CHUNKED and mode is PASS):
        return sent
    _, payloads = ChunkTracker().feed(sent)
    return b"".join(payloads)


def self_delimited(kind: BodyKind, mode: Carriage) -> bool:
    """Whether the client can tell where the body ends without a close (keep-alive possible)."""
    return kind in (EMPTY, LENGTH) or client_chunked(kind, mode)


def closing_bytes(
    kind: BodyKind, mode: Carriage, tracker: ChunkTracker | None, payload: bytes
) -> tuple[bytes, bool]:
    """The bytes that end a body early carrying `payload` (a stall frame), and whether the
    client can still tell where the body ends (keep-alive possible) afterwards."""
    if kind == CHUNKED and mode == PASS and tracker is not None:
        return tracker.close_with(payload), True
    if mode in (CHUNK, REFRAME):
        return frame(payload) + LAST_CHUNK, True
    if kind == LENGTH:
        # A declared length cannot grow: the body is cut.
        return b"", False
    return payload, False


class Plan(NamedTuple):
    """How one upstream response travels: decided once, from its head."""

    kind: BodyKind
    # The declared length (LENGTH).
    remaining: int
    mode: Carriage
    sse: bool
    json: bool
    upstream_keep_alive: bool
    client_keep_alive: bool
    # A 2xx event stream: held until its first content event.
    holdable: bool


def plan(
    method: bytes,
    status: int,
    http_version: bytes,
    headers: Headers,
    client_http11: bool,
    client_keep_alive: bool,
    committed: bool,
) -> Plan:
    """`committed`: the client's head already went out (heartbeats): this body continues it.
    A FramingError is the caller's to handle."""
    kind, remaining = upstream_body(method, status, headers)
    ctype = (get(headers, b"content-type") or b"").lower()
    sse = ctype.startswith(b"text/event-stream")
    if committed:
        mode = committed_carriage(kind, client_http11)
        client_keep_alive = client_keep_alive and client_http11
    else:
        mode = carriage(kind, client_http11)
        client_keep_alive = client_keep_alive and self_delimited(kind, mode)
    return Plan(
        kind,
        remaining,
        mode,
        sse,
        not sse and ctype.find(b"json") >= 0,
        http_version == b"1.1" and not has_token(headers, b"connection", b"close"),
        client_keep_alive,
        sse and 200 <= status < 300,
    )

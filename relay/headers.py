"""Header rules at the relay's two edges: what crosses, what is stripped, what is added."""

from __future__ import annotations

from relay.upstream_headers import CLIENT_CREDENTIALS

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
    b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade",
})
# The caller's credentials: consumed by the relay when it checks keys (or sends its own).
CREDENTIALS = frozenset({b"authorization", b"x-api-key"})
# Never forwarded upstream: the relay sets these itself.
_NOT_UPSTREAM = HOP_BY_HOP | {b"host", b"content-length", b"x-request-id", b"expect"}
_NOT_DOWNSTREAM = HOP_BY_HOP | {b"x-request-id"}
# ... and no Content-Length where the client's framing is the relay's chunking, or where
# the status has no body and forbids one (204, 1xx: RFC 9110 8.6).
_NOT_DOWNSTREAM_NO_LENGTH = _NOT_DOWNSTREAM | {b"content-length"}

Headers = list[tuple[bytes, bytes]]


class HeaderList(list):
    """Headers as received ((name as sent, value) pairs, in order) with their lower-case names
    beside them in `lows` (h11 made them for a request, relay/head.py for a response), so the
    relay's lookups are C scans of `lows`, not a lower() per name per lookup (issue 15)."""

    __slots__ = ("lows",)
    lows: list[bytes]


def header_list(pairs, lows: list[bytes]) -> HeaderList:
    """A HeaderList of `pairs` with `lows` (a plain function: no Python __init__ to run)."""
    out = HeaderList(pairs)
    out.lows = lows
    return out


def request_headers(h11_headers) -> HeaderList:
    """The HeaderList of an h11 request's headers."""
    full = getattr(h11_headers, "_full_items", None)  # (h11 keeps the lower-case names here)
    if full is None:
        full = [(k, k.lower(), v) for k, v in h11_headers.raw_items()]
    return header_list([(raw, v) for raw, _, v in full], [low for _, low, _ in full])


def lower_names(headers: Headers) -> list[bytes]:
    """The headers' lower-case names in order: a HeaderList's own, else made here."""
    return headers.lows if type(headers) is HeaderList else [k.lower() for k, _ in headers]


def values_of(headers: Headers, lows: list[bytes], name: bytes) -> list[bytes]:
    """Every value of the header `name` (lower case); `lows`: `lower_names(headers)`."""
    n = lows.count(name)
    if n <= 1:  # the usual head: none, or one found by index
        return [headers[lows.index(name)][1]] if n else []
    return [v for (_, v), low in zip(headers, lows) if low == name]


def _listed_in_connection(headers: Headers) -> set[bytes]:
    return {t.strip().lower() for value in values_of(headers, lower_names(headers), b"connection")
            for t in value.split(b",") if t.strip()}


def get(headers: Headers, name: bytes) -> bytes | None:
    """First value of a header (name given in lower case)."""
    lows = lower_names(headers)
    return headers[lows.index(name)][1] if name in lows else None


def has_token(headers: Headers, name: bytes, token: bytes) -> bool:
    """Whether a comma-separated header (e.g. Connection) lists `token`."""
    return any(t.strip().lower() == token
               for v in values_of(headers, lower_names(headers), name) for t in v.split(b","))


def upstream_request_headers(client: Headers, host: bytes, body_len: int,
                             request_id: bytes, auth: tuple[bytes, bytes] | None,
                             static: Headers = (), pass_credentials: bool = False) -> Headers:
    """The request headers sent upstream (the body goes with Content-Length).

    The caller's Authorization / x-api-key cross only with `pass_credentials` (the relay
    checks no keys and sends no credential of its own: the upstream checks them).
    `static`: the upstream's configured headers, which replace the client's of those names;
    `auth`: the upstream's own key, with which none of the client's credentials cross.
    """
    drop = _NOT_UPSTREAM | _listed_in_connection(client)
    if not pass_credentials:
        drop = drop | CREDENTIALS
    if auth is not None:
        drop = drop | CLIENT_CREDENTIALS | {auth[0].lower()}
    if static:
        drop = drop | {k.lower() for k, _ in static}
    out = [(b"Host", host)]
    out += [kv for kv, low in zip(client, lower_names(client)) if low not in drop]
    out.extend(static)
    if auth is not None:
        out.append(auth)
    out.append((b"X-Request-Id", request_id))
    out.append((b"Content-Length", b"%d" % body_len))
    return out


def with_cors(headers: Headers, own: Headers) -> Headers:
    """The upstream's headers with its own CORS answer (`Access-Control-*`) replaced by the
    relay's (`own`, from relay/cors.py)."""
    return [(k, v) for k, v in headers
            if not k.lower().startswith(b"access-control-")] + list(own)


def client_response(status: int, reason: bytes, upstream: Headers, request_id: bytes,
                    chunked: bool, keep_alive: bool) -> bytes:
    """The response head sent to the client: upstream headers minus hop-by-hop ones.

    Content-Length crosses unchanged when the upstream gave one (the body is passed through
    as is); `chunked` adds the relay's own Transfer-Encoding instead, so the head never holds
    both. A 204 or 1xx never carries a Content-Length.
    """
    no_length = chunked or status == 204 or status < 200
    drop = (_NOT_DOWNSTREAM_NO_LENGTH if no_length else _NOT_DOWNSTREAM) | _listed_in_connection(
        upstream)
    lines = [b"HTTP/1.1 %d %s" % (status, reason)]
    lines += [k + b": " + v for (k, v), low in zip(upstream, lower_names(upstream))
              if low not in drop]
    if chunked:
        lines.append(b"Transfer-Encoding: chunked")
    lines.append(b"X-Request-Id: " + request_id)
    if not keep_alive:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def relay_response(status: int, reason: bytes, body: bytes, request_id: bytes | None,
                   keep_alive: bool, extra: Headers = (),
                   content_type: bytes = b"application/json") -> bytes:
    """A whole response the relay answers itself (errors, metrics, model list)."""
    lines = [b"HTTP/1.1 %d %s" % (status, reason), b"Content-Type: " + content_type,
             b"Content-Length: %d" % len(body)]
    lines.extend(k + b": " + v for k, v in extra)
    if request_id is not None:
        lines.append(b"X-Request-Id: " + request_id)
    if not keep_alive:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body

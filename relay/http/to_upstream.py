"""The request the relay writes to an upstream: which client headers cross, what it adds.

What an `[[upstream]]` adds to every request it is sent: static headers and its own key.

`headers = { "OpenAI-Organization" = "org-x" }` is for what a provider needs that is not a
secret. Anything that looks like a credential is refused at start: secrets come only from
the environment (`auth_header` + `auth_value_env`), so a config file never holds one.

When an upstream has its own key, none of the client's credentials go to it (the relay's
key is the one the provider bills): `CLIENT_CREDENTIALS` are dropped from what crosses.

Every upstream is asked for an unencoded body (`Accept-Encoding: identity`): the relay reads
what passes (content events, `usage`), which a hosted API would otherwise gzip when the client
says it accepts that (the openai client does), leaving the row without tokens and the hold
before the first content event waiting for an event it cannot see.
"""

from __future__ import annotations

import re

from relay.http.fields import (
    HOP_BY_HOP,
    Header,
    HeaderPairs,
    Headers,
    connection_tokens,
    header_line,
    kept,
    lower_names,
)

# Header names that carry a caller's credential.
CLIENT_CREDENTIALS = frozenset(
    {
        b"authorization",
        b"proxy-authorization",
        b"x-api-key",
        b"api-key",
        b"cookie",
    }
)
# Words in a header name that say it carries a secret (x-goog-api-key, x-auth-token, ...).
_SECRET_WORDS = ("auth", "key", "token", "secret", "passw", "cookie", "credential", "session")
# Set by the relay itself, or hop-by-hop: a static value would break the exchange.
_RELAY_OWNED = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "proxy-connection",
        "x-request-id",
        "accept-encoding",
    }
)
# The caller's credentials: consumed by the relay when it checks keys (or sends its own).
CREDENTIALS = frozenset({b"authorization", b"x-api-key"})
# Never forwarded upstream: the relay sets these itself.
_NOT_UPSTREAM = HOP_BY_HOP | {b"host", b"content-length", b"x-request-id", b"expect"}
IDENTITY = (b"Accept-Encoding", b"identity")
# W3C trace context: the relay's own replaces the client's when OpenTelemetry is on.
TRACE_CONTEXT = frozenset({b"traceparent", b"tracestate"})
# A header name and a header value as the configuration may give them, matched whole with
# fullmatch (`$` would let a final "\n" through).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")


def looks_like_credential(name: str) -> bool:
    """Whether a header name is, or has a word that says it carries, a credential."""
    low = name.lower()
    return low.encode() in CLIENT_CREDENTIALS or any(w in low for w in _SECRET_WORDS)


def check_header_name(name: str) -> None:
    """ValueError unless the relay may send a header of this name from its configuration: an
    RFC 9110 token (no blank, colon, CR, LF or other byte that would end the line or start
    another), and not one the relay sets itself. The message quotes nothing of the name (an
    operator may have put a secret there by mistake): the caller names the key."""
    if _TOKEN.fullmatch(name) is None:
        raise ValueError("not a header name (letters, digits and !#$%&'*+-.^_`|~ only)")
    if name.lower() in _RELAY_OWNED:
        raise ValueError("set by the relay")


def check_header_value(value: str) -> None:
    """ValueError unless `value` stays one header value on the wire: no control character
    but TAB (a CR or LF would start another header line, or end the head), no blanks at its
    ends (a peer strips them). The message quotes nothing of it: it may be a secret."""
    if _VALUE.fullmatch(value) is None or value != value.strip(" \t"):
        raise ValueError("control characters (CR, LF, ...) or blanks at its ends")


def check_static_headers(headers: dict[str, str], auth_header: str | None = None) -> None:
    """Raises ValueError naming the first header that cannot be a static upstream header."""
    for name, value in headers.items():
        try:
            check_header_name(name)
        except ValueError as exc:
            raise ValueError(f"{name!r} is {exc}") from None
        try:
            check_header_value(value)
        except ValueError as exc:
            raise ValueError(f"{name!r}: the value has {exc}") from None
        low = name.lower()
        if looks_like_credential(name) or (auth_header and low == auth_header.lower()):
            raise ValueError(
                f"{name!r} looks like a credential: secrets only through auth_header + "
                "auth_value_env (read from the environment), never in the file"
            )


def fixed_headers(headers: dict[str, str]) -> Headers:
    """The headers an upstream adds to every request besides its key: identity coding, then
    its static ones (`upstream_request_headers` puts the key last)."""
    return [IDENTITY] + [(k.encode(), v.encode()) for k, v in headers.items()]


def upstream_request_headers(
    client: HeaderPairs,
    host: bytes,
    body_len: int,
    request_id: bytes,
    auth: Header | None,
    static: HeaderPairs = (),
    pass_credentials: bool = False,
    trace: HeaderPairs = (),
) -> Headers:
    """The request headers sent upstream (the body goes with Content-Length).

    The caller's Authorization / x-api-key cross only with `pass_credentials` (the relay
    checks no keys and sends no credential of its own: the upstream checks them).
    `static`: the upstream's configured headers, which replace the client's of those names;
    `auth`: the upstream's own key, with which none of the client's credentials cross.
    `trace`: the relay's W3C trace context (OpenTelemetry on), which replaces the client's
    `traceparent` / `tracestate` (off, the client's cross as any header does).
    """
    drop = _NOT_UPSTREAM | connection_tokens(client)
    if not pass_credentials:
        drop = drop | CREDENTIALS
    if auth is not None:
        drop = drop | CLIENT_CREDENTIALS | {auth[0].lower()}
    if static:
        drop = drop | {k.lower() for k, _ in static}
    if trace:
        drop = drop | TRACE_CONTEXT
    out = [(b"Host", host)]
    out += kept(client, lower_names(client), drop)
    out.extend(static)
    if auth is not None:
        out.append(auth)
    out.extend(trace)
    out.append((b"X-Request-Id", request_id))
    out.append((b"Content-Length", b"%d" % body_len))
    return out


def request_bytes(method: bytes, target: bytes, headers: HeaderPairs, body: bytes) -> bytes:
    """The request as written upstream: request line, header lines, blank line, body."""
    lines = [b"%s %s HTTP/1.1" % (method, target)]
    lines += map(header_line, headers)
    lines.append(b"")
    lines.append(b"")
    return b"\r\n".join(lines) + body

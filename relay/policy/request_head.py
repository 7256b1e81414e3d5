"""A request head judged before any byte of its body is read, without sockets.

In this order (each refusal closes the connection): a head over `max_header_bytes` (431),
a folded header line (400), body framing two parsers could read differently (400/501,
`http.request_framing`), a declared body over `max_body_bytes` (413), a caller the request
would be refused for anyway when a body follows (401/403, `admission.head_check`: a key, or
the admin rule of `admin_access` with `[server].host` as the relay's own name), and a
declared body the relay-wide body memory cannot hold now (503). A bodiless request with a bad
key is answered the usual way instead (its row says so).
"""

from __future__ import annotations

from itertools import chain
from typing import Protocol

from relay.config import ServerConfig
from relay.errors import Code, RelayError
from relay.http import fields, request_framing
from relay.http.fields import HeaderPairs
from relay.http.request_path import bounded, route_path
from relay.policy.admission import head_check
from relay.policy.keys import Auth


class BodyBound(Protocol):
    """What `judge` reads of the relay-wide bound on request-body bytes held at once
    (`proxy.body_memory`): the bound, and the bytes held now."""

    @property
    def limit(self) -> int: ...

    @property
    def held(self) -> int: ...


class HeadVerdict:
    """What the head says about its request: the refusal (None: read the body), the HTTP
    version, whether the client wants the connection kept, the routed path, the key."""

    __slots__ = ("http11", "keep_alive", "key_id", "path", "refusal")

    def __init__(
        self,
        refusal: RelayError | None,
        http11: bool = True,
        keep_alive: bool = True,
        path: str = "",
        key_id: str | None = None,
    ) -> None:
        self.refusal = refusal
        self.http11 = http11
        self.keep_alive = keep_alive
        self.path = path
        self.key_id = key_id


def head_size(method: bytes, target: bytes, headers: HeaderPairs) -> int:
    """The head's size as h11 bounds an unfinished one: request line and header lines."""
    return (
        len(method) + len(target) + 4 * len(headers) + sum(map(len, chain.from_iterable(headers)))
    )


def judge(
    server: ServerConfig,
    auth: Auth,
    method: bytes,
    target: bytes,
    http_version: bytes,
    headers: HeaderPairs,
    folded: bool,
    peer_host: str | None,
    bodies: BodyBound,
) -> HeadVerdict:
    """The verdict on one request head. `server`: the `[server]` limits and host; `folded`:
    the raw head held an obs-fold (`request_framing.has_obs_fold`); `bodies`: the relay-wide
    bound on body bytes held."""
    # h11 bounds only a head still incomplete; one that came whole in a read is measured here.
    if head_size(method, target, headers) > server.max_header_bytes:
        return HeadVerdict(RelayError(Code.HEADERS_TOO_LARGE, "request head is too large"))
    if folded:
        return HeadVerdict(
            RelayError(Code.BAD_REQUEST, "obs-fold (a folded header line) in the head")
        )
    http11 = http_version == b"1.1"
    err = request_framing.framing_error(headers, http11)
    if err is not None:
        return HeadVerdict(err, http11)
    keep_alive = http11 and not fields.has_token(headers, b"connection", b"close")
    cl = fields.get(headers, b"content-length")
    declared = int(cl) if cl is not None else 0
    if declared > server.max_body_bytes:
        return HeadVerdict(too_large(server.max_body_bytes), http11, keep_alive)
    has_body = declared > 0 or fields.get(headers, b"transfer-encoding") is not None
    path = route_path(target)
    key_id, err = head_check(auth, method, path, headers, peer_host, server.host)
    # A bodiless request is answered the usual way (its row says so).
    if err is not None and has_body:
        return HeadVerdict(err, http11, keep_alive, path, key_id)
    if declared > bodies.limit - bodies.held:
        return HeadVerdict(busy(bodies.limit), http11, keep_alive, path, key_id)
    return HeadVerdict(None, http11, keep_alive, path, key_id)


def malformed(status_hint: int, why: str) -> RelayError:
    """The answer to a head h11 could not parse (its status hint: 431, 501, else 400)."""
    if status_hint == 431:
        return RelayError(Code.HEADERS_TOO_LARGE, "request head is too large")
    if status_hint == 501:
        return RelayError(Code.NOT_IMPLEMENTED, bounded(why))
    return RelayError(Code.BAD_REQUEST, bounded(f"malformed HTTP request: {why}"))


def too_large(limit: int) -> RelayError:
    """413: a body over `max_body_bytes` (`limit`)."""
    return RelayError(
        Code.REQUEST_TOO_LARGE, f"request body is over {limit} bytes", {"limit_bytes": limit}
    )


def too_many_chunks(limit: int) -> RelayError:
    """413: a chunked body in more than `max_body_chunks` (`limit`) chunks."""
    return RelayError(
        Code.REQUEST_TOO_LARGE,
        f"request body is sent in more than {limit} chunks",
        {"limit_chunks": limit},
    )


def busy(limit: int) -> RelayError:
    """503: the relay-wide body memory (`limit` bytes) cannot hold this body now."""
    return RelayError(
        Code.SERVER_BUSY,
        "the relay holds too many request bodies; retry later",
        {"limit_bytes": limit},
        [(b"Retry-After", b"1")],
    )

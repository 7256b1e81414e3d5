"""Where an upstream lives: scheme, address, Host header, path prefix, and the target sent.

`parse_target` reads an `[[upstream]].url` once at start (`http://host[:port]` or
`https://host[:port]`, optionally with a path prefix such as `/api/v1`). `Target.join`
builds the request-target sent upstream from the client's, per attempt: the prefix is put
in front of the client's path, with the OpenAI base-URL convention that a prefix ending in
`/v1` and a client path starting with `/v1/` do not double the `/v1`
(`https://host/api/v1` + `/v1/chat/completions` -> `/api/v1/chat/completions`).

A prefix scopes what the client can reach on that server, so a client path in which any
server could read a dot segment (`..`, `.`, however encoded: `%2e`, `..%2f`, `%5c`, a
backslash, `%252e` decoded twice, `..;x`; `request_path.dot_segment_in`) is refused rather
than joined: it could climb out of the prefix. An encoded slash that makes no dot segment
passes (`/v1/models/org%2Fname`: decoded or not, it stays under the prefix), and so does
anything in the query.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from relay.http.request_path import dot_segment_in, origin_form, path_part

DEFAULT_PORTS = {"http": 80, "https": 443}


class TargetError(ValueError):
    """A URL that cannot name an upstream, or a client path that cannot be joined."""


class Target:
    """An upstream's address and path prefix: `prefix` is empty or `/a/b` (no trailing
    slash); `host_header` names the host as a Host header does (an IPv6 literal bracketed,
    the port unless it is the scheme's default)."""

    __slots__ = ("host", "host_header", "port", "prefix", "scheme", "v1_prefix")

    def __init__(self, scheme: str, host: str, port: int, prefix: str) -> None:
        self.scheme = scheme
        self.host = host
        self.port = port
        self.prefix = prefix.encode()
        self.v1_prefix = self.prefix.endswith(b"/v1")
        name = f"[{host}]" if ":" in host else host
        default = DEFAULT_PORTS[scheme]
        self.host_header = (name if port == default else f"{name}:{port}").encode()

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    def join(self, target: bytes) -> bytes:
        """The request-target sent upstream for the client's `target` (path and query; an
        absolute-form target is read as its path and query). `/v1` alone, or `/v1?x`, is the
        prefix itself when the prefix ends in `/v1`."""
        if not self.prefix:
            return target
        target = origin_form(target)
        if target[:1] != b"/":
            raise TargetError("a path prefix needs an origin-form request target")
        path = path_part(target)
        if dot_segment_in(path):
            raise TargetError("dot segments (however encoded) are not allowed under a path prefix")
        if self.v1_prefix and (path == b"/v1" or path.startswith(b"/v1/")):
            target = target[3:]
        return self.prefix + target


def parse_target(url: str) -> Target:
    """`http(s)://host[:port][/prefix]` -> Target. Raises TargetError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        raise TargetError("expected http://host[:port][/prefix] or https://host[:port][/prefix]")
    if parts.username is not None or parts.password is not None:
        raise TargetError("credentials in the URL are not allowed (use auth_value_env)")
    try:
        port = parts.port
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    if port is None:
        port = DEFAULT_PORTS[parts.scheme]
    elif port == 0:
        raise TargetError("port 0 is not a port to connect to")
    if parts.query or parts.fragment or url.rstrip().endswith(("?", "#")):
        raise TargetError("a query or fragment is not allowed")
    prefix = parts.path.rstrip("/")
    if prefix:
        if dot_segment_in(prefix.encode()) or "//" in prefix:
            raise TargetError("the path prefix must be plain segments")
        if any(ord(c) <= 0x20 or ord(c) >= 0x7F or c in "%\\" for c in prefix):
            raise TargetError("the path prefix must be printable ASCII without % or spaces")
    return Target(parts.scheme, parts.hostname, port, prefix)

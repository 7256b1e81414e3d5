"""A request read whole, as the dispatcher gets it from the client connection."""

from __future__ import annotations

from relay.http.fields import Headers
from relay.http.request_path import route_path


class Request:
    __slots__ = ("body", "headers", "http11", "keep_alive", "key_id", "method", "path", "target")

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: Headers,
        body: bytes,
        http11: bool,
        keep_alive: bool,
        key_id: str | None = None,
        path: str | None = None,
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.http11 = http11
        self.keep_alive = keep_alive
        # The caller's key, identified on the head (None: auth off).
        self.key_id = key_id
        # The path the upstream routes on, bounded for echoes and rows.
        self.path = path if path is not None else route_path(target)

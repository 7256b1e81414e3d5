"""A request read whole, as the dispatcher gets it from the client connection."""

from __future__ import annotations

from relay.http.request_path import route_path


class Request:
    __slots__ = ("body", "headers", "http11", "keep_alive", "key_id", "method", "path", "target")

    def __init__(
        self,
        method,
        target,
        headers,
        body,
        http11,
        keep_alive,
        key_id: str | None = None,
        path: str | None = None,
    ) -> None:
        self.method: bytes = method
        self.target: bytes = target
        self.headers: list[tuple[bytes, bytes]] = headers
        self.body: bytes = body
        self.http11: bool = http11
        self.keep_alive: bool = keep_alive
        self.key_id = key_id  # the caller's key, identified on the head (None: auth off)
        # the path the upstream routes on, bounded for echoes and rows
        self.path = path if path is not None else route_path(target)

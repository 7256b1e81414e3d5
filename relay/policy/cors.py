"""CORS for browser clients (`[server].cors_origins`, off when empty).

The relay answers preflights itself, before any key is checked (a browser sends no
credentials with them), and every response to an allowed origin - relayed or its own -
carries the relay's `Access-Control-Allow-Origin` (replacing the upstream's) and exposes
`X-Request-Id`.
"""

from __future__ import annotations

from relay.http.fields import HeaderPairs, Headers, get, header_line

ALLOW_METHODS = b"GET, POST, OPTIONS"
ALLOW_HEADERS = b"Authorization, Content-Type, x-api-key, X-Request-Id"
MAX_AGE = b"600"


class Cors:
    def __init__(self, origins: list[str]) -> None:
        self.any = "*" in origins
        self.origins = {o.encode().rstrip(b"/") for o in origins if o != "*"}

    @property
    def enabled(self) -> bool:
        return self.any or bool(self.origins)

    def headers(self, request: HeaderPairs) -> Headers:
        """What a response to this request carries (nothing unless an allowed Origin asks)."""
        if not self.enabled:
            return []
        origin = get(request, b"origin")
        if origin is None:
            return []
        if self.any:
            return [
                (b"Access-Control-Allow-Origin", b"*"),
                (b"Access-Control-Expose-Headers", b"X-Request-Id"),
            ]
        if origin.rstrip(b"/") not in self.origins:
            return [(b"Vary", b"Origin")]
        return [
            (b"Access-Control-Allow-Origin", origin),
            (b"Access-Control-Expose-Headers", b"X-Request-Id"),
            (b"Vary", b"Origin"),
        ]

    def is_preflight(self, method: bytes, request: HeaderPairs) -> bool:
        return (
            self.enabled
            and method == b"OPTIONS"
            and get(request, b"access-control-request-method") is not None
        )

    def preflight(self, request: HeaderPairs, request_id: bytes, keep_alive: bool) -> bytes:
        """The whole answer to a preflight: 204 with the allowed methods and headers when the
        origin is allowed, a bare 204 otherwise (the browser then refuses the call)."""
        lines = [b"HTTP/1.1 204 No Content"]
        own = self.headers(request)
        lines.extend(map(header_line, own))
        # The headers the browser asks for are allowed too: SDKs add their own.
        if any(k == b"Access-Control-Allow-Origin" for k, _ in own):
            asked = get(request, b"access-control-request-headers")
            allow = ALLOW_HEADERS + (b", " + asked if asked and asked.strip() else b"")
            lines += [
                b"Access-Control-Allow-Methods: " + ALLOW_METHODS,
                b"Access-Control-Allow-Headers: " + allow,
                b"Access-Control-Max-Age: " + MAX_AGE,
            ]
        lines.append(b"X-Request-Id: " + request_id)
        if not keep_alive:
            lines.append(b"Connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n"

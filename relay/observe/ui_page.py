"""The operator page: `GET /ui` and its files, packaged with relay (no build step, no CDN;
its chart library, uPlot, is a vendored file served from here too).

The files hold no data: every figure comes from `GET /api/ui/state` (observe.ui_state),
an admin endpoint like the rest of `/api/*`, which the page's script polls once a second,
sending the admin key typed into the page as `Authorization: Bearer` (never in a URL). The
files themselves follow the admin rule's network part (`admin_access.loopback_refusal`): with
API keys but no admin key they are served to loopback peers only, for a Host naming the relay
(the state they would show is loopback-only then too, and for the page's own origin only). A
link from another site to the page is followed: the files hold nothing such a site could read.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from relay.errors import Code, RelayError
from relay.http.fields import Headers
from relay.policy import admin_access as access
from relay.policy.keys import Auth

PAGES = {
    "/ui": ("index.html", b"text/html; charset=utf-8"),
    "/ui/": ("index.html", b"text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", b"text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", b"text/css; charset=utf-8"),
    # uPlot, the chart library, vendored unchanged (static/uPlot.LICENSE.txt: MIT).
    "/ui/uplot.min.js": ("uplot.min.js", b"text/javascript; charset=utf-8"),
    "/ui/uplot.min.css": ("uplot.min.css", b"text/css; charset=utf-8"),
}
STATE_PATH = "/api/ui/state"
# It answers {"admin_key": bool}: whether the page must ask for the admin key.
AUTH_PATH = "/ui/auth"
NO_STORE = [(b"Cache-Control", b"no-store")]
# The page loads only its own files and talks only to its own origin.
PAGE_HEADERS = NO_STORE + [
    (
        b"Content-Security-Policy",
        b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    ),
    (b"X-Content-Type-Options", b"nosniff"),
]
_cache: dict[str, bytes] = {}


class PageRequest(Protocol):
    """What a page's answer reads of the request (`relay.proxy.request`)."""

    @property
    def headers(self) -> Headers: ...

    @property
    def path(self) -> str: ...

    @property
    def method(self) -> bytes: ...


def is_page(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


def page(path: str) -> tuple[bytes, bytes] | None:
    """(body, content type) of a page file, or None (a 404)."""
    found = PAGES.get(path)
    if found is None:
        return None
    name, ctype = found
    body = _cache.get(name)
    if body is None:
        # Imported at the page's first request, not at start-up (it takes some 8 ms).
        from importlib import resources

        body = _cache[name] = resources.files("relay.observe").joinpath("static", name).read_bytes()
    return body, ctype


def answer(
    auth: Auth, peer_host: str | None, req: PageRequest, listen_host: str
) -> tuple[bytes, bytes]:
    """The body and content type answering a request for a page file: no data in them, so no
    key is needed for them when an admin key guards the data; loopback peers naming the
    relay (`listen_host`: `[server].host`) only when keys exist without one. RelayError for
    a refused caller or a file that does not exist."""
    refused = access.loopback_refusal(auth, req.headers, peer_host, listen_host)
    if refused is not None:
        raise RelayError(*refused)
    found: tuple[bytes, bytes] | None
    if req.path == AUTH_PATH:
        found = msgspec.json.encode({"admin_key": auth.admin is not None}), b"application/json"
    else:
        found = page(req.path) if req.method in (b"GET", b"HEAD") else None
    if found is None:
        raise RelayError(Code.NOT_FOUND, f"no such endpoint {req.path}")
    return found

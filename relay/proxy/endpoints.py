"""The endpoints the relay answers itself, never forwarded: the operator page and its files,
`/metrics`, `/api/*` (slot metrics, the page's state), and `GET /v1/models` from the
configuration's names when any upstream lists its models.

Admin routes (the relay's own and the upstream's mutating ones) are judged here too: a refused
caller gets 401/403; an allowed one is marked `admin` on the request's ledger, so no API key
is asked for on top and its credential is not passed on.
"""

from __future__ import annotations

import time

import msgspec

from relay.errors import RelayError
from relay.observe import ui_page, ui_state
from relay.policy import admin_access
from relay.policy.routing import model_list
from relay.proxy.ledger import Ledger

PROMETHEUS_TEXT = b"text/plain; version=0.0.4; charset=utf-8"
JSON = b"application/json"


def answer(app, client, req, rid: bytes, ledger: Ledger):
    """Answer the request if it is one of the relay's own endpoints (True, or in a worker
    process an awaitable that answers it); raise RelayError for a refused admin call; False
    when it goes upstream."""
    cors = ledger.cors
    path = req.path  # normalised and bounded (it is echoed in a 404)
    if ui_page.is_page(path):
        ui_page.answer(app.auth, client, req, rid, app.config.server.host)
        return True
    relay_admin = admin_access.is_relay_admin(path)
    if relay_admin or admin_access.is_upstream_admin(req.method, path):
        refused = admin_access.admin_refusal(  # `[server].host`: a name a Host may give it
            app.auth, req.method, req.headers, client.peer_host, app.config.server.host
        )
        if refused is not None:
            raise RelayError(*refused)
        ledger.admin = True  # an admin call: no API key needed on top
    if relay_admin:
        remote = app.remote_view  # a worker process: the whole relay's figures are its parent's
        if remote is not None:
            return remote(client, req, rid, cors, path)  # (awaited by the dispatcher)
        status, body, ctype, extra = admin_view(app, path, req.target)
        client.respond(status, body, rid, req.keep_alive, cors + extra, content_type=ctype)
        return True
    if path in ("/v1/models", "/models") and req.method == b"GET" and app.router.models:
        if app.auth.enabled and app.auth.identify(req.headers) is None:
            raise RelayError("invalid_api_key", "missing or unknown API key")
        client.respond(200, model_list(app.router.models), rid, req.keep_alive, cors)
        return True
    return False


def admin_view(app, path: str, target: bytes) -> tuple[int, bytes, bytes, list]:
    """One of the relay's own views of `app`'s figures: (status, body, content type, extra
    headers); RelayError `not_found` for another path. `target`: the request's, query kept."""
    now = time.monotonic()
    app.gauged()  # (the live gauges: slots, queue, state)
    registry = app.registry
    registry.rows_dropped = app.store.rows_dropped
    registry.rows_pending = app.store.pending
    registry.rows_spilled = getattr(app.store, "spilled", None)
    if path == "/metrics":
        return 200, registry.prometheus(now), PROMETHEUS_TEXT, []
    if path == "/api/slots/metrics":
        return 200, registry.json(now), JSON, []
    if path == ui_page.STATE_PATH:
        body = msgspec.json.encode(ui_state.state(app, time.time(), now))
        return 200, body, JSON, list(ui_page.NO_STORE)
    raise RelayError("not_found", f"no such endpoint {path}")

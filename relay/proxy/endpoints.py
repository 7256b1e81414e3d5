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


def answer(app, client, req, rid: bytes, ledger: Ledger) -> bool:
    """Answer the request if it is one of the relay's own endpoints (True); raise RelayError
    for a refused admin call; False when it goes upstream."""
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
        _relay_admin(app, client, req, rid, cors, path)
        return True
    if path in ("/v1/models", "/models") and req.method == b"GET" and app.router.models:
        if app.auth.enabled and app.auth.identify(req.headers) is None:
            raise RelayError("invalid_api_key", "missing or unknown API key")
        client.respond(200, model_list(app.router.models), rid, req.keep_alive, cors)
        return True
    return False


def _relay_admin(app, client, req, rid: bytes, cors, path: str) -> None:
    now = time.monotonic()
    for up in app.upstreams.values():
        up.refresh_metrics()
    registry = app.registry
    registry.rows_dropped = app.store.rows_dropped
    registry.rows_pending = app.store.pending
    registry.rows_spilled = getattr(app.store, "spilled", None)
    if path == "/metrics":
        body = registry.prometheus(now)
        client.respond(200, body, rid, req.keep_alive, cors, content_type=PROMETHEUS_TEXT)
    elif path == "/api/slots/metrics":
        client.respond(200, registry.json(now), rid, req.keep_alive, cors)
    elif path == ui_page.STATE_PATH:
        body = msgspec.json.encode(ui_state.state(app, time.time(), now))
        client.respond(200, body, rid, req.keep_alive, cors + ui_page.NO_STORE)
    else:
        raise RelayError("not_found", f"no such endpoint {path}")

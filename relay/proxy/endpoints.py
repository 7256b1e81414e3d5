"""The endpoints the relay answers itself, never forwarded: the health check (`GET`/`HEAD
/health` and `/v1/health`, from the upstreams' health: `readiness`), the operator page and its
files, `/metrics`, `/api/*` (slot metrics, the page's state, the upstreams' readiness), and
`GET /v1/models` from the configuration's names when any upstream lists its models.

The health check asks for no key and leaves no row, no access line and no figure: a load
balancer polling it costs the store nothing, and a key's budget is never touched by it.

Admin routes (the relay's own and the upstream's mutating ones) are judged here too: a refused
caller gets 401/403; an allowed one is marked `admin` on the request's ledger, so no API key
is asked for on top and its credential is not passed on.
"""

from __future__ import annotations

import time
from enum import Enum, auto

import msgspec

from relay.errors import Code, RelayError, reason_phrase
from relay.http.fields import Headers
from relay.http.to_client import relay_response
from relay.observe import ui_page, ui_state
from relay.policy import admin_access
from relay.policy.admission import is_health
from relay.policy.routing import model_list
from relay.proxy import readiness
from relay.proxy.app_view import AppView, ViewAnswer
from relay.proxy.client_writer import JSON, ClientWriter
from relay.proxy.ledger import Ledger
from relay.proxy.request import Request

PROMETHEUS_TEXT = b"text/plain; version=0.0.4; charset=utf-8"
# Each upstream's state, since when and why (admin).
READINESS_PATH = "/api/upstreams"


class Own(Enum):
    """Which of the relay's own endpoints answers a request."""

    HEALTH = auto()
    PAGE = auto()
    VIEW = auto()
    MODELS = auto()


def claim(app: AppView, peer_host: str | None, req: Request, ledger: Ledger) -> Own | None:
    """Which of the relay's own endpoints answers the request; None when it goes upstream.
    An admin call is judged here (RelayError for a refused caller) and marked `admin` on the
    ledger, whether the relay answers it or the upstream does."""
    # Normalised and bounded: it is echoed in a 404.
    path = req.path
    if is_health(req.method, path):
        return Own.HEALTH
    if ui_page.is_page(path):
        return Own.PAGE
    relay_admin = admin_access.is_relay_admin(path)
    if relay_admin or admin_access.is_upstream_admin(req.method, path):
        # `[server].host` is a name a Host may give the relay.
        refused = admin_access.admin_refusal(
            app.auth, req.method, req.headers, peer_host, app.config.server.host
        )
        if refused is not None:
            raise RelayError(*refused)
        # An admin call: no API key is needed on top.
        ledger.admin = True
    if relay_admin:
        return Own.VIEW
    if path in ("/v1/models", "/models") and req.method == b"GET" and app.router.models:
        return Own.MODELS
    return None


async def answer(
    own: Own, app: AppView, out: ClientWriter, peer_host: str | None, req: Request, rid: bytes,
    cors: Headers,
) -> None:  # fmt: skip
    """Answer a request one of the relay's own endpoints claimed (RelayError: refused)."""
    path = req.path
    if own is Own.HEALTH:
        # A worker knows every upstream's health from its parent: no round trip.
        d = app.config.dispatcher
        why = readiness.judge(
            (up.health.probe for up in app.upstreams.values()),
            d.health_interval_s > 0,
            app.draining,
        )
        status, body = readiness.health_answer(why)
        whole = relay_response(
            status, reason_phrase(status), body, rid, req.keep_alive, cors, readiness.JSON_UTF8
        )
        out.send_answer(whole[: len(whole) - len(body)] if req.method == b"HEAD" else whole)
    elif own is Own.PAGE:
        body, ctype = ui_page.answer(app.auth, peer_host, req, app.config.server.host)
        out.answer(200, body, rid, req.keep_alive, ui_page.PAGE_HEADERS, ctype)
    elif own is Own.VIEW:
        # In a worker process the whole relay's figures are its parent's.
        remote = app.remote_view
        view = await remote(path, req.target) if remote is not None else admin_view(app, path)
        out.answer(
            view.status, view.body, rid, req.keep_alive, cors + view.headers, view.content_type
        )
    else:
        if app.auth.enabled and app.auth.identify(req.headers) is None:
            raise RelayError(Code.INVALID_API_KEY, "missing or unknown API key")
        out.answer(200, model_list(app.router.models), rid, req.keep_alive, cors)


def admin_view(app: AppView, path: str) -> ViewAnswer:
    """One of the relay's own views of `app`'s figures; RelayError `not_found` for another
    path."""
    now = time.monotonic()
    # The live gauges: slots, queue, state.
    app.gauged()
    registry = app.registry
    store = app.store
    registry.rows_dropped = store.rows_dropped
    registry.rows_pending = store.pending
    registry.rows_spilled = store.spilled
    if path == "/metrics":
        return ViewAnswer(200, registry.prometheus(now), PROMETHEUS_TEXT, [])
    if path == "/api/slots/metrics":
        return ViewAnswer(200, registry.json(now), JSON, [])
    if path == READINESS_PATH:
        d = app.config.dispatcher
        body = readiness.view(list(app.upstreams.values()), d.health_interval_s > 0, app.draining)
        return ViewAnswer(200, body, JSON, [])
    if path == ui_page.STATE_PATH:
        body = msgspec.json.encode(ui_state.state(app, time.time(), now))
        return ViewAnswer(200, body, JSON, list(ui_page.NO_STORE))
    raise RelayError(Code.NOT_FOUND, f"no such endpoint {path}")

"""Whether the relay can serve, from its upstreams' health, without sockets: what
`GET /health` answers, in llama-server's own shapes, and the operator's view of each
upstream (`/api/upstreams`).

The relay can serve when one upstream can: its state is `ready` or `serving`, or `unknown`
while no probe runs (`health_interval_s = 0`: nothing says it is not there, and requests are
sent to it). With probes, an upstream not probed yet cannot serve: a load balancer asking
in the first moment after the start is told to wait. Otherwise the reason, most hopeful
first: an upstream loads its model (llama-server's own `Loading model`, so a client written
for llama-server waits as it would), none has answered a probe yet, none is reachable. A
relay that drains cannot serve either.

The answer names no upstream, address or error: `/health` is open to anyone, as
llama-server's is. The admin view says which upstream is in which state since when, and why.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import msgspec

from relay.proxy.health import LOADING, READY, SERVING, UNKNOWN
from relay.proxy.upstreams import Upstream


class Why(enum.StrEnum):
    """Why the relay can serve (`OK`), or why it cannot."""

    OK = "ok"
    LOADING = "loading"
    NOT_PROBED = "not_probed"
    DOWN = "down"
    DRAINING = "draining"


# What `GET /health` says for each reason it cannot serve: llama-server's words while a
# model loads, the relay's own otherwise.
MESSAGES = {
    Why.LOADING: "Loading model",
    Why.NOT_PROBED: "no upstream has answered a health probe yet",
    Why.DOWN: "no upstream is reachable",
    Why.DRAINING: "the relay is shutting down",
}

HEALTH_OK = b'{"status":"ok"}'
# llama-server's Content-Type for its JSON answers.
JSON_UTF8 = b"application/json; charset=utf-8"


def judge(probes: Iterable[str], probing: bool, draining: bool) -> Why:
    """Whether the relay can serve, from each upstream's probe state (`Health.probe`);
    `probing`: health probes run."""
    if draining:
        return Why.DRAINING
    seen = set(probes)
    if READY in seen or SERVING in seen or (UNKNOWN in seen and not probing):
        return Why.OK
    if LOADING in seen:
        return Why.LOADING
    if UNKNOWN in seen:
        return Why.NOT_PROBED
    return Why.DOWN


class _Error(msgspec.Struct):
    message: str
    type: str
    code: int


class _Refusal(msgspec.Struct):
    error: _Error


def health_answer(why: Why) -> tuple[int, bytes]:
    """`GET /health`'s status and body: llama-server's `{"status":"ok"}`, or its 503 shape,
    `{"error":{"message":...,"type":"unavailable_error","code":503}}`, saying why."""
    if why is Why.OK:
        return 200, HEALTH_OK
    return 503, msgspec.json.encode(_Refusal(_Error(MESSAGES[why], "unavailable_error", 503)))


class UpstreamReadiness(msgspec.Struct):
    """One upstream in `/api/upstreams`: its URL without credentials or query; its state
    (`serving`: ready, with requests on it) and since when (unix seconds) it has been in it
    (serving apart); its last probe's time, status (null: no answer) and the error it is down
    for; its slots."""

    name: str
    url: str
    state: str
    since: float
    probed_at: float | None
    probe_status: int | None
    error: str | None
    parallel: int
    in_flight: int
    queued: int


class Readiness(msgspec.Struct):
    """The document of `/api/upstreams`: what `/health` says (`ready`, `reason`), whether
    probes run, and each upstream."""

    ready: bool
    reason: Why
    probing: bool
    upstreams: list[UpstreamReadiness]


def public_url(up: Upstream) -> str:
    """The upstream's URL as the relay reaches it: scheme, host, port, path prefix."""
    t = up.target
    return f"{t.scheme}://{t.host_header.decode()}{t.prefix.decode()}"


def view(ups: Sequence[Upstream], probing: bool, draining: bool) -> bytes:
    """The JSON of `/api/upstreams`."""
    rows = [
        UpstreamReadiness(
            up.name,
            public_url(up),
            up.state,
            round(up.health.since, 3),
            None if up.health.probed_at is None else round(up.health.probed_at, 3),
            up.health.probe_status,
            up.health.last_error or None,
            up.cfg.parallel,
            up.slots.in_flight,
            up.slots.queued,
        )
        for up in ups
    ]
    why = judge((up.health.probe for up in ups), probing, draining)
    return msgspec.json.encode(Readiness(why is Why.OK, why, probing, rows))

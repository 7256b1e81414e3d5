"""Admin endpoints: the relay's own (/metrics, /api/*) and llama-server's mutating ones
(POST /props, /slots actions, POST /lora-adapters, model load/unload) are for admins only:
the admin key when one is set, loopback peers when keys exist without one, everyone when
there are no keys."""

import pytest

from relay.policy.admin_access import is_loopback, is_relay_admin, is_upstream_admin
from tests.support import httpc
from tests.support.keys import ADMIN, SECRET, bearer, key, sha
from tests.support.sockets import OWN, fetch_from

ADMIN_UPSTREAM = [
    ("POST", "/props"),
    ("POST", "/slots/0?action=erase"),
    ("POST", "/slots/1?action=save"),
    ("POST", "/slots/0?action=restore"),
    ("GET", "/slots"),
    ("POST", "/lora-adapters"),
    ("POST", "/models/load"),
    ("POST", "/models/unload"),
    ("POST", "/%73lots/0?action=erase"),
    ("POST", "/v1/../props"),
    ("POST", "//props/"),
]


def test_upstream_admin_paths():
    from relay.http.request_path import normalize

    for method, target in ADMIN_UPSTREAM:
        assert is_upstream_admin(method.encode(), normalize(target.encode())), target
    for method, target in [
        ("GET", "/props"),
        ("GET", "/lora-adapters"),
        ("GET", "/models"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/health"),
        ("POST", "/completion"),
        ("GET", "/v1/models"),
    ]:
        assert not is_upstream_admin(method.encode(), normalize(target.encode())), target
    assert is_relay_admin(normalize(b"/%6detrics")) and is_relay_admin("/api/slots/metrics")


@pytest.mark.parametrize(
    "host, loop",
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("192.0.2.2", False),
        ("10.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("fd00::2", False),
        (None, False),
        ("", False),
        ("garbage", False),
    ],
)
def test_is_loopback(host, loop):
    assert is_loopback(host) is loop


@pytest.mark.skipif(OWN is None, reason="no non-loopback address on this machine")
async def test_keys_without_admin_key_admin_is_loopback_only(make_relay, sim):
    app = await make_relay(keys=[key()], host="0.0.0.0")
    seen = len(sim.requests)
    for method, target in [
        ("GET", "/metrics"),
        ("GET", "/api/slots/metrics"),
        ("GET", "/%6detrics"),
    ] + ADMIN_UPSTREAM:
        resp = await fetch_from(OWN, app.port, method, target, bearer())
        assert resp.status == 403, (method, target, resp.status)
        assert resp.json()["error"]["code"] == "forbidden"
    assert len(sim.requests) == seen  # none of them reached the upstream
    # a key holder from elsewhere still gets inference
    resp = await fetch_from(
        OWN, app.port, "POST", "/v1/chat/completions", bearer(), httpc.chat(3, stream=False)
    )
    assert resp.status == 200
    # the loopback peer is the operator: the relay's endpoints and the upstream's admin ones
    assert (await fetch_from("127.0.0.1", app.port, "GET", "/metrics")).status == 200
    assert (await fetch_from("127.0.0.1", app.port, "GET", "/api/slots/metrics")).status == 200
    resp = await fetch_from("127.0.0.1", app.port, "POST", "/slots/0?action=erase")
    assert resp.status != 403 and sim.requests[-1].path.startswith("/slots/0")


async def test_admin_key_guards_upstream_admin_endpoints(make_relay, sim):
    app = await make_relay(keys=[key()], admin_key_sha256=sha(ADMIN))
    seen = len(sim.requests)
    for method, target in ADMIN_UPSTREAM:
        resp = await fetch_from("127.0.0.1", app.port, method, target, bearer(SECRET))
        assert resp.status == 401, (method, target, resp.status)
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert len(sim.requests) == seen
    resp = await fetch_from("127.0.0.1", app.port, "POST", "/props", bearer(ADMIN))
    assert resp.status != 401 and sim.requests[-1].path == "/props"


async def test_no_keys_leaves_everything_open(make_relay, sim):
    app = await make_relay()
    for method, target in [
        ("GET", "/metrics"),
        ("POST", "/props"),
        ("POST", "/slots/0?action=erase"),
    ]:
        resp = await fetch_from("127.0.0.1", app.port, method, target)
        assert resp.status not in (401, 403), target
    assert sim.requests[-1].path.startswith("/slots/0")

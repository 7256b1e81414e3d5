"""Admin endpoints: the relay's own (/metrics, /api/*) and llama-server's mutating ones
(POST /props, /slots actions, POST /lora-adapters, model load/unload) are for admins only:
the admin key when one is set, loopback peers when keys exist without one (for a Host naming
the relay, from no page of another origin), everyone when there are no keys; a mutating one
from a browser page of another origin never (issue 21 item 3). Over sockets and in Chromium:
tests/policy/test_admin_rebinding.py."""

import pytest

from relay.policy.admin_access import (
    NOT_LOOPBACK,
    NOT_OUR_HOST,
    OTHER_ORIGIN,
    admin_refusal,
    beyond_loopback,
    cross_origin,
    is_loopback,
    is_mutating,
    is_relay_admin,
    is_upstream_admin,
    loopback_refusal,
    names_relay,
    open_to_network,
    same_origin,
)
from relay.policy.keys import Auth
from tests.support import httpc
from tests.support.keys import ADMIN, SECRET, bearer, key, sha
from tests.support.need import need_own_address
from tests.support.sockets import fetch_from

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


@pytest.mark.parametrize(
    "host, listen, named",
    [
        # loopback names and addresses, any port or none, any case
        (b"localhost", "127.0.0.1", True),
        (b"localhost:8080", "127.0.0.1", True),
        (b"LocalHost:1", "127.0.0.1", True),
        (b"relay.localhost:8080", "127.0.0.1", True),
        (b"a.b.localhost", "127.0.0.1", True),
        (b"127.0.0.1:8080", "0.0.0.0", True),
        (b"127.9.8.7", "127.0.0.1", True),
        (b"[::1]:8080", "127.0.0.1", True),
        (b"[::1]", "127.0.0.1", True),
        (b"[::ffff:127.0.0.1]:8080", "127.0.0.1", True),
        (b"[::ffff:7f00:1]", "127.0.0.1", True),
        (None, "127.0.0.1", True),  # no Host: HTTP/1.0, never a browser
        # [server].host as configured, unless a wildcard
        (b"relay.internal:8080", "relay.internal", True),
        (b"RELAY.internal", "Relay.Internal", True),
        (b"192.0.2.5:8080", "192.0.2.5", True),
        (b"[fd00::5]:8080", "fd00::5", True),
        (b"192.0.2.5:8080", "127.0.0.1", False),
        (b"0.0.0.0:8080", "0.0.0.0", False),
        (b"[::]:8080", "::", False),
        (b"relay.internal", "0.0.0.0", False),
        # what a DNS-rebinding page's Host looks like
        (b"attacker.example", "127.0.0.1", False),
        (b"attacker.example:8080", "127.0.0.1", False),
        (b"localhost.attacker.example", "127.0.0.1", False),
        (b"127.0.0.1.nip.io:8080", "127.0.0.1", False),
        (b"localhost.", "127.0.0.1", False),
        (b".localhost", "127.0.0.1", False),
        (b"x..localhost", "127.0.0.1", False),
        (b"evil-localhost", "127.0.0.1", False),
        # malformed: never
        (b"", "127.0.0.1", False),
        (b"localhost:", "127.0.0.1", False),
        (b"localhost:abc", "127.0.0.1", False),
        (b"localhost:123456", "127.0.0.1", False),
        (b"user@localhost", "127.0.0.1", False),
        (b"localhost/x", "127.0.0.1", False),
        (b"::1", "127.0.0.1", False),
        (b"[::1%25lo]", "127.0.0.1", False),
        (b"[127.0.0.1]", "127.0.0.1", False),
        (b"127.1", "127.0.0.1", False),
        (b"0x7f.0.0.1", "127.0.0.1", False),
    ],
)
def test_names_relay(host, listen, named):
    assert names_relay(host, listen) is named


@pytest.mark.parametrize(
    "origin, host, same",
    [
        (b"http://127.0.0.1:8080", b"127.0.0.1:8080", True),
        (b"http://LOCALHOST:8080", b"localhost:8080", True),
        (b"http://localhost", b"localhost:80", True),  # a default port, written or not
        (b"http://localhost:80", b"localhost", True),
        (b"https://relay.example", b"relay.example", True),
        (b"https://relay.example", b"relay.example:443", True),
        (b"http://[::1]:8080", b"[::1]:8080", True),
        (b"http://localhost:9000", b"localhost:9000", True),  # an ssh -L forward
        (b"http://localhost:3000", b"localhost:8080", False),  # another app on the box
        (b"http://127.0.0.1:8080", b"localhost:8080", False),
        (b"https://localhost:8080", b"localhost", False),
        (b"https://relay.example", b"relay.example:80", False),
        (b"http://attacker.example", b"127.0.0.1:8080", False),
        (b"null", b"127.0.0.1:8080", False),
        (b"http://127.0.0.1:8080/", b"127.0.0.1:8080", False),
        (b"http://u@127.0.0.1:8080", b"127.0.0.1:8080", False),
        (b"ftp://127.0.0.1:8080", b"127.0.0.1:8080", False),
        (b"", b"127.0.0.1:8080", False),
    ],
)
def test_same_origin(origin, host, same):
    assert same_origin(origin, host) is same


HOST = (b"Host", b"127.0.0.1:8080")


@pytest.mark.parametrize(
    "headers, cross",
    [
        ([HOST], False),  # curl, an SDK
        ([], False),
        ([HOST, (b"Sec-Fetch-Site", b"same-origin")], False),  # the page's own GET
        ([HOST, (b"Sec-Fetch-Site", b"none")], False),  # typed into the address bar
        ([HOST, (b"Origin", b"http://127.0.0.1:8080"), (b"Sec-Fetch-Site", b"same-origin")], False),
        ([HOST, (b"sec-fetch-site", b"Same-Origin")], False),
        ([HOST, (b"Sec-Fetch-Site", b"cross-site")], True),
        ([HOST, (b"Sec-Fetch-Site", b"same-site")], True),
        ([HOST, (b"Sec-Fetch-Site", b"bogus")], True),
        ([HOST, (b"Sec-Fetch-Site", b"same-origin"), (b"Sec-Fetch-Site", b"same-origin")], True),
        ([HOST, (b"Origin", b"http://attacker.example")], True),  # an old browser's POST
        ([HOST, (b"Origin", b"http://127.0.0.1:8080"), (b"Sec-Fetch-Site", b"cross-site")], True),
        (
            [HOST, (b"Origin", b"http://attacker.example"), (b"Sec-Fetch-Site", b"same-origin")],
            True,
        ),
        ([HOST, (b"Origin", b"null")], True),
        (
            [HOST, (b"Origin", b"http://127.0.0.1:8080"), (b"Origin", b"http://127.0.0.1:8080")],
            True,
        ),
        ([(b"Origin", b"http://127.0.0.1:8080")], True),  # an Origin and no Host to match
    ],
)
def test_cross_origin(headers, cross):
    assert cross_origin(headers) is cross


OPEN = Auth([], None)
KEYS = Auth([key()], None)
WITH_ADMIN = Auth([key()], sha(ADMIN))
LO, FAR = "127.0.0.1", "192.0.2.9"
EVIL = (b"Origin", b"http://attacker.example")
CROSS = (b"Sec-Fetch-Site", b"cross-site")
ADMIN_AUTH = (b"Authorization", f"Bearer {ADMIN}".encode())
FORBIDDEN_OTHER = ("forbidden", OTHER_ORIGIN)


@pytest.mark.parametrize(
    "auth, method, headers, peer, refusal",
    [
        # a mutating request from another origin's page: 403 in every mode, whatever it carries
        (OPEN, b"POST", [HOST, EVIL], LO, FORBIDDEN_OTHER),
        (OPEN, b"DELETE", [HOST, CROSS], FAR, FORBIDDEN_OTHER),
        (KEYS, b"POST", [HOST, EVIL, CROSS], LO, FORBIDDEN_OTHER),
        (WITH_ADMIN, b"POST", [HOST, EVIL, ADMIN_AUTH], LO, FORBIDDEN_OTHER),
        (WITH_ADMIN, b"PUT", [HOST, CROSS], LO, FORBIDDEN_OTHER),
        # ... but not a read where keys or no keys say so
        (OPEN, b"GET", [HOST, EVIL, CROSS], FAR, None),
        (WITH_ADMIN, b"GET", [HOST, EVIL, CROSS, ADMIN_AUTH], FAR, None),
        (WITH_ADMIN, b"GET", [HOST, EVIL, CROSS], LO, ("invalid_api_key", "admin key required")),
        # the same request from no page, or the relay's own
        (OPEN, b"POST", [HOST], FAR, None),
        (OPEN, b"POST", [(b"Host", b"relay.lan:8080"), (b"Origin", b"http://relay.lan:8080")], FAR, None),
        (WITH_ADMIN, b"POST", [HOST, ADMIN_AUTH], FAR, None),
        (WITH_ADMIN, b"POST", [HOST, ADMIN_AUTH, (b"Origin", b"http://127.0.0.1:8080")], LO, None),
        # keys without an admin key: a loopback peer, a Host naming the relay, no other origin
        (KEYS, b"GET", [HOST], LO, None),
        (KEYS, b"POST", [HOST, (b"Origin", b"http://127.0.0.1:8080")], LO, None),
        (KEYS, b"GET", [HOST, (b"Sec-Fetch-Site", b"same-origin")], LO, None),
        (KEYS, b"GET", [HOST], FAR, ("forbidden", NOT_LOOPBACK)),
        (KEYS, b"GET", [(b"Host", b"attacker.example:8080")], LO, ("forbidden", NOT_OUR_HOST)),
        (KEYS, b"POST", [(b"Host", b"attacker.example:8080")], LO, ("forbidden", NOT_OUR_HOST)),
        (KEYS, b"GET", [(b"Host", b"localhost"), (b"Host", b"localhost")], LO, ("forbidden", NOT_OUR_HOST)),
        (KEYS, b"GET", [HOST, EVIL], LO, FORBIDDEN_OTHER),  # a cross-origin read
        (KEYS, b"GET", [HOST, CROSS], LO, FORBIDDEN_OTHER),
        (KEYS, b"GET", [HOST, (b"Origin", b"http://localhost:3000")], LO, FORBIDDEN_OTHER),
    ],
)  # fmt: skip
def test_admin_refusal(auth, method, headers, peer, refusal):
    assert admin_refusal(auth, method, headers, peer, "127.0.0.1") == refusal


def test_loopback_refusal_is_the_network_part_only():
    """The page files: a loopback peer naming the relay, from any page (they hold no data)."""
    assert loopback_refusal(KEYS, [HOST, EVIL, CROSS], LO, "127.0.0.1") is None
    assert loopback_refusal(KEYS, [HOST], FAR, "127.0.0.1") == ("forbidden", NOT_LOOPBACK)
    rebound = [(b"Host", b"attacker.example")]
    assert loopback_refusal(KEYS, rebound, LO, "127.0.0.1") == ("forbidden", NOT_OUR_HOST)
    assert loopback_refusal(OPEN, rebound, FAR, "127.0.0.1") is None
    assert loopback_refusal(WITH_ADMIN, rebound, FAR, "127.0.0.1") is None


def test_mutating_methods():
    assert [m for m in (b"GET", b"HEAD", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS",
                        b"FOO") if is_mutating(m)] == [
        b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS", b"FOO"
    ]  # fmt: skip


async def test_keys_without_admin_key_admin_is_loopback_only(make_relay, sim):
    own = need_own_address()
    app = await make_relay(keys=[key()], host="0.0.0.0")
    seen = len(sim.requests)
    for method, target in [
        ("GET", "/metrics"),
        ("GET", "/api/slots/metrics"),
        ("GET", "/%6detrics"),
    ] + ADMIN_UPSTREAM:
        resp = await fetch_from(own, app.port, method, target, bearer())
        assert resp.status == 403, (method, target, resp.status)
        assert resp.json()["error"]["code"] == "forbidden"
    assert len(sim.requests) == seen  # none of them reached the upstream
    # a key holder from elsewhere still gets inference
    resp = await fetch_from(
        own, app.port, "POST", "/v1/chat/completions", bearer(), httpc.chat(3, stream=False)
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


@pytest.mark.parametrize(
    "host, beyond",
    [
        ("127.0.0.1", False),
        ("127.1.2.3", False),
        ("::1", False),
        ("[::1]", False),
        ("localhost", False),
        ("LocalHost", False),
        ("0.0.0.0", True),
        ("", True),
        ("::", True),
        ("192.0.2.7", True),
        ("relay.example", True),
    ],
)
def test_beyond_loopback(host, beyond):
    assert beyond_loopback(host) is beyond


def test_open_to_network_only_without_any_key():
    from relay.config import KeyConfig

    k = [KeyConfig(id="k", sha256="ab" * 32)]
    assert open_to_network(Auth([], None), "0.0.0.0")
    assert not open_to_network(Auth([], None), "127.0.0.1")
    assert not open_to_network(Auth(k, None), "0.0.0.0")
    assert not open_to_network(Auth([], "cd" * 32), "0.0.0.0")

"""The operator page's server side (issue 13 item 4) without a browser: the recent-requests
ring, the trend sampler, budgets, and the endpoints' access rules."""

from __future__ import annotations

import msgspec
import pytest

from relay.observe import ui_page as ui
from relay.observe.metrics import Registry, UpstreamMetrics
from relay.observe.record import Record
from relay.observe.ui_state import Recent, Trend, budgets, tokens_per_s
from tests.support import httpc
from tests.support.keys import ADMIN, SECRET, bearer, key, sha
from tests.support.sockets import OWN, fetch_from

CHAT = "/v1/chat/completions"


def test_recent_is_a_bounded_ring_newest_first():
    r = Recent(size=3)
    for i in range(5):
        r.add(
            Record(
                ts=float(i),
                request_id=f"r{i}",
                path=CHAT,
                key_id="k",
                model="m",
                upstream_served="u",
                status=200,
                ok=True,
                outcome="done",
                ttft_ms=100.0,
                e2e_ms=1100.0,
                completion_tokens=11,
            )
        )
    rows = r.rows()
    assert [x["request_id"] for x in rows] == ["r4", "r3", "r2"]
    assert rows[0] == {
        "ts": 4.0,
        "request_id": "r4",
        "key": "k",
        "model": "m",
        "upstream": "u",
        "status": 200,
        "ttft_ms": 100.0,
        "tokens_per_s": 10.0,
        "tokens": 11,
        "outcome": "done",
        "ok": True,
    }
    r.add(
        Record(
            ts=9.0,
            request_id="bad",
            path=CHAT,
            upstream_requested="u",
            status=502,
            outcome="error",
            error_code="upstream_unavailable",
        )
    )
    assert r.rows()[0]["outcome"] == "upstream_unavailable"
    assert r.rows()[0]["upstream"] == "u" and r.rows()[0]["tokens_per_s"] is None


def test_tokens_per_s():
    assert tokens_per_s(11, 100.0, 1100.0) == 10.0
    assert tokens_per_s(1, 100.0, 1100.0) is None
    assert tokens_per_s(5, None, 1100.0) is None
    assert tokens_per_s(5, 100.0, 100.0) is None


def test_trend_one_point_per_step():
    reg = Registry()
    m = UpstreamMetrics("u", 1)
    reg.add(m)
    m.observe_ttft(0.2, 100.0)
    t = Trend(step_s=5.0, points=3)
    for s in range(21):  # called every second for 20 s
        t.sample(1000.0 + s, 100.0 + s, reg)
    assert [p[0] for p in t.of("u")] == [1010.0, 1015.0, 1020.0]  # 5 points taken, 3 kept
    assert t.of("u")[-1][1:] == [0.0, 200.0]  # the TTFT mean of the last 60 s, in ms
    assert t.of("nope") == []


def test_budgets_against_limits():
    keys = [key("a", requests_per_day=10, tokens_per_month=1000), key("b", secret="x")]
    usage = {
        "a": {"daily": {"requests": 3, "tokens": 40}, "monthly": {"requests": 5, "tokens": 90}}
    }
    assert budgets(keys, lambda k: usage.get(k, {})) == [
        {
            "key": "a",
            "windows": [
                {
                    "window": "daily",
                    "requests": 3,
                    "requests_limit": 10,
                    "tokens": 40,
                    "tokens_limit": 0,
                    "reserved_tokens": 0,
                },
                {
                    "window": "monthly",
                    "requests": 5,
                    "requests_limit": 0,
                    "tokens": 90,
                    "tokens_limit": 1000,
                    "reserved_tokens": 0,
                },
            ],
        },
        {"key": "b", "windows": []},
    ]


def test_page_files_are_packaged():
    for path in ("/ui", "/ui/", "/ui/app.js", "/ui/app.css"):
        body, ctype = ui.page(path)
        assert body and ctype.startswith(b"text/")
    assert ui.page("/ui/../ui_page.py") is None and ui.page("/ui/nope") is None
    html = ui.page("/ui")[0].decode()
    assert "http://" not in html and "https://" not in html  # nothing from a CDN


async def test_endpoints_with_an_admin_key(make_relay):
    app = await make_relay(keys=[key()], admin_key_sha256=sha(ADMIN))
    resp = await httpc.fetch(app.port, "GET", "/ui")  # the files hold no data
    assert resp.status == 200 and resp.header("content-type").startswith("text/html")
    assert "default-src 'self'" in resp.header("content-security-policy")
    auth = await httpc.fetch(app.port, "GET", "/ui/auth")
    assert auth.status == 200 and auth.json() == {"admin_key": True}
    for headers in ({}, bearer(SECRET)):  # no key, or an API key: refused
        resp = await httpc.fetch(app.port, "GET", "/api/ui/state", headers=headers)
        assert resp.status == 401
    resp = await httpc.fetch(app.port, "GET", "/api/ui/state", headers=bearer(ADMIN))
    assert resp.status == 200 and resp.header("cache-control") == "no-store"
    doc = msgspec.json.decode(resp.body)
    assert [u["name"] for u in doc["upstreams"]] == ["llm"]
    assert [r["status"] for r in doc["recent"]] == [401, 401]  # the two refused calls
    assert (await httpc.fetch(app.port, "GET", "/ui/nope")).status == 404
    resp = await httpc.fetch(app.port, "POST", "/ui", b"{}", headers=bearer(SECRET))
    assert resp.status == 404


async def test_no_keys_page_open(make_relay, sim):
    app = await make_relay()
    assert (await httpc.fetch(app.port, "GET", "/ui/auth")).json() == {"admin_key": False}
    resp = await httpc.fetch(app.port, "GET", "/api/ui/state")
    assert resp.status == 200
    assert all(r.path != "/ui" for r in sim.requests)  # answered by the relay, not forwarded


@pytest.mark.skipif(OWN is None, reason="no non-loopback address on this machine")
async def test_keys_without_admin_key_page_is_loopback_only(make_relay):
    app = await make_relay(keys=[key()], host="0.0.0.0")
    for target in ("/ui", "/ui/app.js", "/api/ui/state"):
        resp = await fetch_from(OWN, app.port, "GET", target, bearer())
        assert resp.status == 403, target
        resp = await fetch_from("127.0.0.1", app.port, "GET", target, bearer())
        assert resp.status == 200, target

"""The operator page's server side (issue 13 item 4) without a browser: the recent-requests
ring, the trend sampler, budgets, and the endpoints' access rules."""

from __future__ import annotations

import msgspec

from relay.observe import ui_page as ui
from relay.observe.record import Record
from relay.observe.ui_state import (
    FIGURES,
    KEEP_MAX,
    Recent,
    Trend,
    budgets,
    generating,
    percentile,
    state,
    tokens_per_s,
)
from relay.stream.itl import Gaps
from tests.support import httpc
from tests.support.keys import ADMIN, SECRET, bearer, key, sha
from tests.support.need import need_own_address
from tests.support.sockets import fetch_from

CHAT = "/v1/chat/completions"


def test_recent_is_a_bounded_ring_newest_first():
    r = Recent(size=3)
    for i in range(5):
        r.add(
            Record(
                ts=float(i),
                request_id=f"r{i}",
                path=CHAT,
                method="POST",
                stream=True,
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
        "method": "POST",
        "path": CHAT,
        "status": 200,
        "ttft_ms": 100.0,
        "e2e_ms": 1100.0,
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


def rec(path=CHAT, method="POST", ts=1000.0, **kw) -> Record:
    fields = dict(upstream_served="u", model="m", status=200, ok=True, outcome="done") | kw
    fields.setdefault("request_id", path)
    return Record(ts=ts, path=path, method=method, **fields)


def test_generating_is_admission_rule():
    assert generating(rec(CHAT)) and generating(rec("/v1/embeddings"))
    assert generating(rec("/some/new/route"))  # any POST but a known cheap route
    for method, path in (
        ("GET", "/health"),
        ("GET", "/v1/models"),
        ("GET", "/props"),
        ("POST", "/tokenize"),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", CHAT),
    ):
        assert not generating(rec(path, method)), (method, path)
    assert generating(rec(CHAT, method=""))  # refused before its head was read: kept


def test_recent_keeps_requests_that_generate_nothing_apart():
    r = Recent(size=3, other_size=2)
    r.add(rec(CHAT, request_id="c1"))
    for i in range(3):
        r.add(rec("/health", "GET", request_id=f"h{i}"))
    r.add(rec("/tokenize", request_id="t"))
    r.add(rec(CHAT, request_id="c2", stream=False, e2e_ms=250.0, completion_tokens=4))
    r.add(rec("/x" * 200, request_id="long"))  # a long path, bounded for the page
    assert [x["request_id"] for x in r.rows()] == ["long", "c2", "c1"]  # the health checks
    assert [x["request_id"] for x in r.rows(other=True)] == ["t", "h2"]  # cannot push them out
    c2 = r.rows()[1]
    assert (c2["ttft_ms"], c2["e2e_ms"], c2["tokens_per_s"]) == (None, 250.0, None)
    assert len(r.rows()[0]["path"]) == 121


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.01


def itl_hist(*gaps: float) -> str:
    g = Gaps()
    for x in gaps:
        g.add(x)
    return g.encode()


def test_trend_point_figures():
    t = Trend(step_s=5.0, points=3)
    t.sample(1000.0, 0.0, None)  # the first point: nothing settled yet
    for i, ttft in enumerate((100.0, 200.0, 300.0, 400.0)):
        t.add(
            rec(
                ts=1001.0,
                ttft_ms=ttft,
                tpot_ms=10.0 * (i + 1),
                e2e_ms=1000.0 + i,
                total_ms=1000.0 + i,
                itl_hist=itl_hist(0.01, 0.01, 0.5 if i == 3 else 0.01),
            ),
            True,
        )
    t.add(rec(ok=False, status=502, outcome="error", ttft_ms=1.0), True)  # in the error rate only
    t.add(rec("/health", "GET", model=None, e2e_ms=2.0), False)  # its own series
    t.sample(1005.0, 0.0, None)
    doc = t.doc()
    assert doc["times"] == [1000.0, 1005.0] and doc["window_s"] == 15.0
    gen, other = doc["series"]
    assert (gen["upstream"], gen["model"], gen["generating"]) == ("u", "m", True)
    assert (other["model"], other["generating"]) == (None, False)
    point = {f: gen[f][-1] for f in FIGURES}
    itl_p99 = point.pop("itl_p99")
    assert point == {
        "req_s": 0.8,  # four completed over 5 s
        "err_pct": 20.0,
        "ttft_p50": 250.0,
        "ttft_p99": 397.0,
        "tpot": 25.0,
        "e2e_p50": 1001.5,
        "tok_s": 0.0,  # no tokens counted
    }
    assert 490 < itl_p99 < 510  # the one long gap of twelve, pooled (buckets within 2%)
    assert [gen[f][0] for f in FIGURES] == [0.0, None, None, None, None, None, None, 0.0]
    assert other["req_s"] == [0.0, 0.2] and other["ttft_p50"] == [None, None]


def test_trend_spreads_tokens_over_the_decode_span():
    t = Trend(step_s=5.0, points=10)
    t.add(rec(ts=99.0), True)  # the series exists before the points
    for wall in (100.0, 105.0, 110.0):
        t.sample(wall, 0.0, None)
    # decoding from 102 to 113 (ttft 1 s, 12 s in all): 110 tokens, 10 a second
    t.add(
        rec(
            ts=101.0, ttft_ms=1000.0, total_ms=12000.0, completion_tokens=110, tokens_source="exact"
        ),
        True,
    )
    t.add(  # a reservation charged is no count
        rec(ts=101.0, total_ms=12000.0, completion_tokens=500, tokens_source="reserved"), True
    )
    t.sample(115.0, 0.0, None)
    [s] = t.doc()["series"]
    assert t.doc()["times"] == [100.0, 105.0, 110.0, 115.0]
    assert s["tok_s"] == [0.0, 6.0, 10.0, 6.0]  # 30 tokens in (100, 105], 50, then 30


def test_trend_is_bounded():
    t = Trend(step_s=1.0, points=4, series_max=2)
    for m in ("a", "b", "c"):
        t.add(rec(model=m), True)
    assert sorted(k[1] for k in t.series) == ["a", "b"] and t.untracked == 1
    for _ in range(KEEP_MAX * 3):
        t.add(rec(model="a", ttft_ms=5.0), True)
    assert len(t.series[("u", "a", True)].step.kept) == KEEP_MAX  # a sample, the count exact
    t.sample(1.0, 0.0, None)
    assert t.doc()["series"][0]["req_s"] == [KEEP_MAX * 3 + 1.0]
    for wall in range(2, 10):
        t.sample(float(wall), 0.0, None)
        assert all(len(c) == len(t.times) <= 4 for s in t.series.values() for c in s.cols)
    assert t.series == {}  # nothing settled over a whole window: dropped


def test_trend_document_is_encoded_again_only_when_it_changes():
    t = Trend(step_s=5.0, points=4)

    def same() -> bool:
        return msgspec.json.decode(t.encoded()) == t.doc()

    first = t.encoded()
    assert same() and t.encoded() is first  # (a poll a second: built once)
    t.add(rec(ts=96.0), True)  # a new series
    assert same() and t.encoded() is not first
    for wall in (100.0, 105.0):
        t.sample(wall, 0.0, None)
        assert same()
    kept = t.encoded()
    t.add(rec(ts=106.0), True)  # the open step only: the document is unchanged
    assert t.encoded() is kept
    t.add(rec(ts=101.0, total_ms=6000.0, completion_tokens=60, tokens_source="exact"), True)
    assert same() and t.doc()["series"][0]["tok_s"][-1] == 8.0  # tokens spread into (100, 105]
    t.add(rec(model="other"), False)
    assert same() and len(t.doc()["series"]) == 2


def test_trend_one_point_per_step():
    t = Trend(step_s=5.0, points=3)
    for s in range(21):  # called every second for 20 s
        t.sample(1000.0 + s, 100.0 + s, None)
    assert list(t.times) == [1010.0, 1015.0, 1020.0]  # 5 points taken, 3 kept


async def test_state_leaves_requests_that_generate_nothing_apart(make_relay):
    app = await make_relay()
    m = app.upstreams["llm"].metrics
    for r in (
        rec(CHAT, upstream_served="llm", request_id="chat", ttft_ms=50.0, e2e_ms=90.0),
        rec("/health", "GET", upstream_served="llm", model=None, request_id="health"),
        rec("/v1/models", "GET", upstream_served="llm", model=None, request_id="models"),
    ):
        gen = generating(r)
        app.ui_recent.add(r)
        app.ui_trend.add(r, gen)
        if gen:
            m.request_done(True, None)
        else:
            m.other_request_done()
    app.ui_trend.next_at = 0.0
    app.ui_trend.sample(1010.0, 0.0, None)
    doc = msgspec.json.decode(msgspec.json.encode(state(app, 1010.0, 0.0)))
    assert [r["request_id"] for r in doc["recent"]] == ["chat"]
    assert [r["request_id"] for r in doc["recent_other"]] == ["models", "health"]
    [u] = doc["upstreams"]
    assert (u["requests_total"], u["other_requests_total"]) == (1, 2)
    assert [(s["model"], s["generating"], s["req_s"][-1]) for s in doc["trend"]["series"]] == [
        ("m", True, 0.2),
        (None, False, 0.4),
    ]
    assert doc["trend"]["series"][0]["ttft_p50"][-1] == 50.0


def test_budgets_against_limits():
    keys = [key("a", requests_per_day=10, tokens_per_month=1000), key("b", secret="x")]
    usage = {
        "a": {"daily": {"requests": 3, "tokens": 40}, "monthly": {"requests": 5, "tokens": 90}}
    }
    live = {"a": (2, 5)}
    assert budgets(keys, lambda k: usage.get(k, {}), live) == [
        {
            "key": "a",
            "in_flight": 2,
            "queued": 5,
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
        {"key": "b", "in_flight": 0, "queued": 0, "windows": []},
    ]


def test_page_files_are_packaged():
    for path in (
        "/ui",
        "/ui/",
        "/ui/app.js",
        "/ui/app.css",
        "/ui/uplot.min.js",
        "/ui/uplot.min.css",
    ):
        body, ctype = ui.page(path)
        assert body and ctype.startswith(b"text/")
    lib = ui.page("/ui/uplot.min.js")[0]
    assert lib.startswith(b"/*! uPlot v1.6.32") and b"Permission is hereby granted" in lib
    assert b"MIT License" in ui.page("/ui/uplot.min.css")[0]
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
    assert doc["recent"] == []  # the two refused calls: the relay's own, apart
    assert [r["status"] for r in doc["recent_other"]] == [401, 401]
    assert (await httpc.fetch(app.port, "GET", "/ui/nope")).status == 404
    resp = await httpc.fetch(app.port, "POST", "/ui", b"{}", headers=bearer(SECRET))
    assert resp.status == 404


async def test_no_keys_page_open(make_relay, sim):
    app = await make_relay()
    assert (await httpc.fetch(app.port, "GET", "/ui/auth")).json() == {"admin_key": False}
    resp = await httpc.fetch(app.port, "GET", "/api/ui/state")
    assert resp.status == 200
    assert all(r.path != "/ui" for r in sim.requests)  # answered by the relay, not forwarded


async def test_keys_without_admin_key_page_is_loopback_only(make_relay):
    own = need_own_address()
    app = await make_relay(keys=[key()], host="0.0.0.0")
    for target in ("/ui", "/ui/app.js", "/api/ui/state"):
        resp = await fetch_from(own, app.port, "GET", target, bearer())
        assert resp.status == 403, target
        resp = await fetch_from("127.0.0.1", app.port, "GET", target, bearer())
        assert resp.status == 200, target

"""API keys and per-key budgets over real sockets: 401s, admin key, pre-flight 429s, windows,
settlement on every exit path (budget usage == what the rows say), restart from the rows."""

from __future__ import annotations

import asyncio
import json
import math
import time
import types
from datetime import UTC, datetime

import pytest

import relay.proxy.dispatch
import relay.proxy.settle
from relay.config import UpstreamConfig
from relay.policy.budget import BudgetExceeded, Budgets, window_bounds
from tests.support import httpc
from tests.support.helpers import contents, rows_of, wait_for
from tests.support.keys import ADMIN, OTHER_SECRET, SECRET, bearer, key, sha

CHAT = "/v1/chat/completions"
BIG = 10**9


def body_len(body: dict) -> int:
    """Bytes of the request body exactly as tests.support.httpc sends it."""
    return len(json.dumps(body).encode())


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc(*args) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


def usage_from_rows(rows: list[dict], key_id: str) -> dict:
    """What the rows say a key used: served requests, and prompt + completion tokens."""
    mine = [r for r in rows if r["key_id"] == key_id]
    return {
        "requests": sum(r["upstream_served"] is not None for r in mine),
        "tokens": sum((r["prompt_tokens"] or 0) + (r["completion_tokens"] or 0) for r in mine),
        "reserved_requests": 0,
        "reserved_tokens": 0,
    }


def budget_error(limit: str, used: int, requested: int, limit_value: int, resets_at: float) -> dict:
    """The 429 body: `used` (used and reserved in the window already), `requested` (what
    this request would reserve: 1 request, or its token estimate), in figures and in words."""
    return {
        "error": {
            "message": f"{limit} budget exceeded: {used} used + {requested} requested"
            f" > {limit_value}",
            "type": "rate_limit_error",
            "code": "budget_exceeded",
            "param": None,
            "details": {
                "limit": limit,
                "used": used,
                "requested": requested,
                "limit_value": limit_value,
                "resets_at": iso(resets_at),
            },
        }
    }


class Clock:
    """A settable wall clock for relay.proxy.dispatch and relay.proxy.settle (perf_counter / monotonic
    stay real)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def install(self, monkeypatch) -> Clock:
        fake = types.SimpleNamespace(
            time=lambda: self.t, perf_counter=time.perf_counter, monotonic=time.monotonic
        )
        monkeypatch.setattr(relay.proxy.dispatch, "time", fake)
        monkeypatch.setattr(relay.proxy.settle, "time", fake)
        return self


# ---- keys -------------------------------------------------------------------------------------
INVALID_KEY = {
    "error": {
        "message": "missing or unknown API key",
        "type": "authentication_error",
        "code": "invalid_api_key",
        "param": None,
        "details": {},
    }
}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer sk-wrong"},
        {"x-api-key": "sk-wrong"},
        {"Authorization": "Bearer"},  # no secret
        {"Authorization": "Bearer    "},  # blank secret
        {"Authorization": f"Basic {SECRET}"},  # wrong scheme
        {"Authorization": SECRET},  # no scheme
        {"Authorization": f"Token {SECRET}"},
        {"x-api-key": ""},
        {"Authorization": f"Bearer {SECRET}x"},  # one character more
        {"Authorization": f"Bearer {SECRET[:-1]}"},  # one character less
        {"Authorization": f"Bearer {ADMIN}"},  # the admin key is no API key
    ],
    ids=[
        "none",
        "wrong-bearer",
        "wrong-x-api-key",
        "bearer-no-secret",
        "bearer-blank",
        "basic",
        "no-scheme",
        "token-scheme",
        "empty-x-api-key",
        "longer",
        "shorter",
        "admin",
    ],
)
async def test_401_without_a_valid_key(make_relay, sim, headers):
    app = await make_relay(keys=[key()], admin_key_sha256=sha(ADMIN))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3), headers=headers)
    assert resp.status == 401
    assert resp.header("content-type") == "application/json"
    assert resp.json() == INVALID_KEY
    assert sim.requests == [] and sim.connections_opened == 0
    [row] = await rows_of(app, 1)
    assert (row["status"], row["ok"], row["error_code"], row["key_id"], row["upstream_served"]) == (
        401,
        0,
        "invalid_api_key",
        None,
        None,
    )


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {SECRET}"},
        {"Authorization": f"bearer {SECRET}"},
        {"Authorization": f"Bearer   {SECRET}  "},
        {"x-api-key": SECRET},
        {"X-API-Key": f" {SECRET} "},
    ],
    ids=["bearer", "bearer-lowercase", "bearer-spaces", "x-api-key", "x-api-key-spaces"],
)
async def test_valid_key_is_served_and_its_id_goes_on_the_row(make_relay, sim, headers):
    app = await make_relay(keys=[key("beta", OTHER_SECRET), key("alpha", SECRET)])
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(4), headers=headers)
    assert resp.status == 200 and resp.complete
    assert "".join(c for c in contents(resp) if c) == httpc.sim_text(4)
    [row] = await rows_of(app, 1)
    assert (row["key_id"], row["status"], row["ok"]) == ("alpha", 200, 1)


async def test_each_key_is_told_apart_and_no_secret_leaks(make_relay, sim):
    app = await make_relay(
        keys=[key("alpha", SECRET), key("beta", OTHER_SECRET)], admin_key_sha256=sha(ADMIN)
    )
    a = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer(SECRET))
    b = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(2), headers={"x-api-key": OTHER_SECRET}
    )
    bad = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer(SECRET + "z"))
    m = await httpc.fetch(app.port, "GET", "/metrics", headers=bearer(ADMIN))
    assert (a.status, b.status, bad.status, m.status) == (200, 200, 401, 200)
    rows = await rows_of(app, 3)  # the admin read writes no row
    assert [r["key_id"] for r in rows] == ["alpha", "beta", None]
    everything = json.dumps(rows) + json.dumps(app.log.lines)
    for secret in (SECRET, OTHER_SECRET, ADMIN, SECRET + "z"):
        assert secret not in everything
        for req in sim.requests:  # nor does the caller's secret reach the upstream
            assert secret.encode() not in b"".join(k + b":" + v for k, v in req.headers)
            assert secret.encode() not in req.body
    assert [r.get("key_id") for r in app.log.of("access")] == ["alpha", "beta", None]


async def test_no_keys_means_auth_off(make_relay, sim):
    app = await make_relay()
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2))
    assert resp.status == 200
    [row] = await rows_of(app, 1)
    assert row["key_id"] is None and row["ok"] == 1


async def test_model_list_needs_a_key_when_auth_is_on(make_relay, sim):
    app = await make_relay(
        upstreams=[UpstreamConfig(name="llm", url=sim.url, models=["tiny"])], keys=[key()]
    )
    ok = await httpc.fetch(app.port, "GET", "/v1/models", headers=bearer())
    assert ok.status == 200 and ok.json()["data"][0]["id"] == "tiny"
    resp = await httpc.fetch(app.port, "GET", "/v1/models")
    assert resp.status == 401 and resp.json() == INVALID_KEY


@pytest.mark.parametrize("path", ["/metrics", "/api/slots/metrics"])
async def test_admin_key_guards_metrics(make_relay, sim, path):
    app = await make_relay(keys=[key()], admin_key_sha256=sha(ADMIN))
    for headers in (
        {},
        bearer(SECRET),
        bearer("nope"),
        {"x-api-key": SECRET},
        {"Authorization": f"Basic {ADMIN}"},
    ):
        resp = await httpc.fetch(app.port, "GET", path, headers=headers)
        assert resp.status == 401, headers
        assert resp.json()["error"]["code"] == "invalid_api_key"
    for headers in (bearer(ADMIN), {"x-api-key": ADMIN}):
        resp = await httpc.fetch(app.port, "GET", path, headers=headers)
        assert resp.status == 200, headers
        if path == "/api/slots/metrics":
            assert resp.json()["llm"]["name"] == "llm"
        else:
            assert resp.header("content-type").startswith("text/plain")
            assert ADMIN not in resp.body.decode()
    assert sim.connections_opened == 0


@pytest.mark.parametrize("path", ["/metrics", "/api/slots/metrics"])
async def test_admin_endpoints_open_without_admin_key(make_relay, sim, path):
    app = await make_relay(keys=[key()])
    resp = await httpc.fetch(app.port, "GET", path)
    assert resp.status == 200


# ---- pre-flight reservation ---------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [300, None])
async def test_reservation_is_one_request_and_body_over_4_plus_max_tokens(
    make_relay, sim, max_tokens
):
    app = await make_relay(
        keys=[
            key(requests_per_day=5, tokens_per_day=BIG, requests_per_month=50, tokens_per_month=BIG)
        ]
    )
    body = httpc.chat(max_tokens, first_token_delay_ms=400)
    body["sim"]["tokens"] = 2
    task = asyncio.create_task(httpc.fetch(app.port, "POST", CHAT, body, headers=bearer()))
    await wait_for(lambda: sim.requests)
    want = body_len(body) // 4 + (max_tokens if max_tokens is not None else 1024)
    held = {"requests": 0, "tokens": 0, "reserved_requests": 1, "reserved_tokens": want}
    assert app.budgets.usage("alpha", time.time()) == {"daily": held, "monthly": held}
    resp = await task
    assert resp.status == 200
    rows = await rows_of(app, 1)
    # settled: the reservation is replaced by the exact usage the upstream reported
    assert rows[0]["tokens_source"] == "exact"
    assert (rows[0]["prompt_tokens"], rows[0]["completion_tokens"]) == (2, 2)
    done = {"requests": 1, "tokens": 4, "reserved_requests": 0, "reserved_tokens": 0}
    assert app.budgets.usage("alpha", time.time()) == {"daily": done, "monthly": done}


async def test_over_budget_is_rejected_before_any_upstream_contact(make_relay, sim):
    app = await make_relay(keys=[key(tokens_per_day=100)])
    body = httpc.chat(200)
    resp = await httpc.fetch(app.port, "POST", CHAT, body, headers=bearer())
    assert resp.status == 429
    assert sim.requests == [] and sim.connections_opened == 0
    midnight = window_bounds("daily", time.time())[1]
    # Nothing used yet: the request's own estimate is what does not fit.
    requested = body_len(body) // 4 + 200
    assert resp.json() == budget_error("daily_tokens", 0, requested, 100, midnight)
    retry = int(resp.header("retry-after"))
    assert 1 <= retry <= math.ceil(midnight - time.time()) + 1
    [row] = await rows_of(app, 1)
    assert (
        row["status"],
        row["ok"],
        row["error_code"],
        row["key_id"],
        row["upstream_served"],
        row["prompt_tokens"],
        row["completion_tokens"],
    ) == (429, 0, "budget_exceeded", "alpha", None, None, None)
    assert app.budgets.usage("alpha", time.time())["daily"] == usage_from_rows([row], "alpha")


async def test_exactly_k_of_n_concurrent_requests_are_admitted(make_relay, sim):
    app = await make_relay(keys=[key(requests_per_month=3)])
    body = httpc.chat(5, interval_ms=20)  # admitted ones stay in flight while others arrive
    resps = await asyncio.gather(
        *(httpc.fetch(app.port, "POST", CHAT, body, headers=bearer()) for _ in range(12))
    )
    assert sorted(r.status for r in resps) == [200] * 3 + [429] * 9
    assert len(sim.requests) == 3
    for r in resps:
        if r.status == 429:
            assert r.json()["error"]["details"]["limit"] == "monthly_requests"
            assert r.json()["error"]["details"]["limit_value"] == 3
            assert r.json()["error"]["details"]["used"] == 3
            assert r.json()["error"]["details"]["requested"] == 1
    rows = await rows_of(app, 12)
    assert app.budgets.usage("alpha", time.time())["monthly"] == usage_from_rows(rows, "alpha")
    assert usage_from_rows(rows, "alpha")["requests"] == 3


async def test_token_budget_second_request_no_longer_fits(make_relay, sim):
    app = await make_relay(keys=[key(tokens_per_day=800)])
    first = httpc.chat(400)
    assert body_len(first) // 4 + 400 <= 800  # it fits on its own
    r1 = await httpc.fetch(app.port, "POST", CHAT, first, headers=bearer())
    assert r1.status == 200 and len([c for c in contents(r1) if c]) == 400
    [row] = await rows_of(app, 1)
    used = row["prompt_tokens"] + row["completion_tokens"]
    assert (row["completion_tokens"], row["tokens_source"]) == (400, "exact")
    assert used + body_len(first) // 4 + 400 > 800
    r2 = await httpc.fetch(app.port, "POST", CHAT, first, headers=bearer())
    assert r2.status == 429
    assert r2.json() == budget_error(
        "daily_tokens",
        used,
        body_len(first) // 4 + 400,
        800,
        window_bounds("daily", time.time())[1],
    )
    small = httpc.chat(10)  # a smaller ask still fits in what is left
    assert used + body_len(small) // 4 + 10 <= 800
    r3 = await httpc.fetch(app.port, "POST", CHAT, small, headers=bearer())
    assert r3.status == 200
    assert len(sim.requests) == 2
    rows = await rows_of(app, 3)
    assert [r["status"] for r in rows] == [200, 429, 200]
    assert app.budgets.usage("alpha", time.time())["daily"] == usage_from_rows(rows, "alpha")


async def test_token_reservations_of_requests_in_flight_count(make_relay, sim):
    body = httpc.chat(400, first_token_delay_ms=300)
    body["sim"]["tokens"] = 3
    est = body_len(body) // 4 + 400
    app = await make_relay(keys=[key(tokens_per_day=2 * est + est // 2)])
    resps = await asyncio.gather(
        *(httpc.fetch(app.port, "POST", CHAT, body, headers=bearer()) for _ in range(5))
    )
    assert sorted(r.status for r in resps) == [200, 200, 429, 429, 429]
    assert len(sim.requests) == 2
    for r in resps:
        if r.status == 429:
            d = r.json()["error"]["details"]
            assert (d["limit"], d["limit_value"]) == ("daily_tokens", 2 * est + est // 2)
            assert d["used"] == 2 * est  # the two reservations in flight
            assert d["requested"] == est  # and this one's, which would go over
    rows = await rows_of(app, 5)
    assert app.budgets.usage("alpha", time.time())["daily"] == usage_from_rows(rows, "alpha")
    assert usage_from_rows(rows, "alpha")["tokens"] == 2 * (2 + 3)


async def test_429_details_and_retry_after_exact_daily(make_relay, sim, monkeypatch):
    midnight = utc(2031, 3, 15)
    clock = Clock(midnight - 100.25).install(monkeypatch)
    app = await make_relay(keys=[key(requests_per_day=1)])
    assert (
        await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer())
    ).status == 200
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer())
    assert resp.status == 429
    assert resp.header("retry-after") == "101"
    assert resp.header("content-type") == "application/json"
    assert resp.json() == budget_error("daily_requests", 1, 1, 1, midnight)
    assert resp.json()["error"]["details"]["resets_at"] == "2031-03-15T00:00:00Z"
    # across UTC midnight the daily window starts again
    clock.t = midnight + 0.5
    assert (
        await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer())
    ).status == 200
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer())
    assert resp.status == 429 and resp.header("retry-after") == "86400"
    assert resp.json()["error"]["details"]["resets_at"] == "2031-03-16T00:00:00Z"
    assert len(sim.requests) == 2
    rows = await rows_of(app, 4)
    assert [r["ts"] for r in rows] == [midnight - 100.25] * 2 + [midnight + 0.5] * 2
    assert app.budgets.usage("alpha", midnight + 1)["daily"] == usage_from_rows(rows[2:], "alpha")


async def test_monthly_window_resets_at_month_end_and_not_at_midnight(make_relay, sim, monkeypatch):
    jan31 = utc(2031, 1, 31)
    clock = Clock(jan31 - 5).install(monkeypatch)  # Jan 30, 23:59:55
    app = await make_relay(keys=[key(requests_per_day=2, requests_per_month=3)])

    async def status():
        return (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer())).status

    assert [await status(), await status()] == [200, 200]
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer())
    assert resp.json() == budget_error("daily_requests", 2, 1, 2, jan31)
    assert resp.header("retry-after") == "5"
    clock.t = jan31 + 10  # a new day, the same month: one request left this month
    assert await status() == 200
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer())
    feb1 = utc(2031, 2, 1)
    assert resp.json() == budget_error("monthly_requests", 3, 1, 3, feb1)
    assert resp.header("retry-after") == str(math.ceil(feb1 - clock.t))
    clock.t = feb1 - 0.5
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer())
    assert resp.status == 429 and resp.header("retry-after") == "1"
    clock.t = feb1  # the first instant of February
    assert [await status(), await status()] == [200, 200]
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer())
    assert resp.json() == budget_error("daily_requests", 2, 1, 2, utc(2031, 2, 2))
    assert len(sim.requests) == 5
    rows = await rows_of(app, 9)
    feb_rows = [r for r in rows if r["ts"] >= feb1]
    assert app.budgets.usage("alpha", feb1 + 1) == {
        "daily": usage_from_rows(feb_rows, "alpha"),
        "monthly": usage_from_rows(feb_rows, "alpha"),
    }


def test_budget_windows_at_month_and_year_edges():
    b = Budgets([key(requests_per_month=1, tokens_per_month=100)])
    for start, end in [
        ((2031, 12, 1), (2032, 1, 1)),
        ((2032, 2, 1), (2032, 3, 1)),
        ((2031, 2, 1), (2031, 3, 1)),
    ]:
        assert window_bounds("monthly", utc(*end) - 0.001) == (utc(*start), utc(*end))
        assert window_bounds("monthly", utc(*end))[0] == utc(*end)
    dec31 = utc(2031, 12, 31, 23, 59, 59)
    res = b.reserve("alpha", 60, dec31)
    with pytest.raises(BudgetExceeded) as exc:
        b.reserve("alpha", 1, dec31)
    assert exc.value.details() == {
        "limit": "monthly_requests",
        "used": 1,
        "requested": 1,
        "limit_value": 1,
        "resets_at": "2032-01-01T00:00:00Z",
    }
    assert exc.value.retry_after == 1
    b.spend(res, 1, 30, dec31 + 0.5)
    b.spend(res, 1, 30, dec31 + 0.5)  # a second settle does nothing
    assert b.usage("alpha", dec31 + 0.5)["monthly"] == {
        "requests": 1,
        "tokens": 30,
        "reserved_requests": 0,
        "reserved_tokens": 0,
    }
    jan1 = utc(2032, 1, 1)
    res = b.reserve("alpha", 100, jan1)  # a new month: the whole budget again
    with pytest.raises(BudgetExceeded) as exc:
        b.reserve("alpha", 1, jan1 + 1)
    assert exc.value.details()["resets_at"] == "2032-02-01T00:00:00Z"
    b.spend(res, 1, 70, jan1 + 2)
    assert b.usage("alpha", jan1 + 2)["monthly"]["tokens"] == 70


async def test_request_spanning_midnight_counts_in_the_window_its_row_is_in(
    make_relay, sim, monkeypatch
):
    midnight = utc(2031, 3, 15)
    clock = Clock(midnight - 1).install(monkeypatch)
    app = await make_relay(keys=[key(requests_per_day=1)])
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    first = asyncio.create_task(
        httpc.exchange(
            reader, writer, "POST", CHAT, httpc.chat(3, first_token_delay_ms=300), headers=bearer()
        )
    )
    await wait_for(lambda: sim.requests)
    clock.t = midnight + 1  # the stream ends on the new day
    assert (await first).status == 200
    writer.close()
    rows = await rows_of(app, 1)
    assert rows[0]["ts"] == midnight - 1
    assert app.budgets.usage("alpha", midnight + 2)["daily"] == usage_from_rows(
        [r for r in rows if r["ts"] >= midnight], "alpha"
    )
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers=bearer())
    assert resp.status == 200


# ---- settlement on every exit path: budget usage == the row --------------------------------
LIMITS = dict(
    requests_per_day=1000, tokens_per_day=BIG, requests_per_month=1000, tokens_per_month=BIG
)


def assert_budget_is_the_rows(app, rows, now=None):
    now = time.time() if now is None else now
    want = usage_from_rows(rows, "alpha")
    assert app.budgets.usage("alpha", now) == {"daily": want, "monthly": want}


async def test_settle_finished_stream_exact(make_relay, sim):
    app = await make_relay(keys=[key(**LIMITS)])
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(7), headers=bearer())
    assert resp.status == 200 and resp.complete
    # the client's stream is exactly what the simulator sent
    assert contents(resp) == [None, "Hello", " from", " a", " tiny", " llama", ".", " Hello"]
    assert "".join(contents(resp)[1:]) == httpc.sim_text(7)
    assert sim.requests[-1].tokens_sent == 7
    [row] = await rows_of(app, 1)
    assert (
        row["ok"],
        row["upstream_served"],
        row["tokens_source"],
        row["prompt_tokens"],
        row["completion_tokens"],
    ) == (1, "llm", "exact", sim.prompt_tokens_total, sim.requests[-1].completion_tokens)
    assert row["completion_tokens"] == 7
    assert_budget_is_the_rows(app, [row])


async def test_settle_non_streamed_exact(make_relay, sim):
    app = await make_relay(keys=[key(**LIMITS)])
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(6, stream=False), headers=bearer())
    assert resp.status == 200
    usage = resp.json()["usage"]
    [row] = await rows_of(app, 1)
    assert (row["tokens_source"], row["prompt_tokens"], row["completion_tokens"]) == (
        "exact",
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert row["completion_tokens"] == 6
    assert_budget_is_the_rows(app, [row])


async def test_settle_upstream_drop_mid_stream_partial(make_relay, sim):
    app = await make_relay(keys=[key(**LIMITS)])
    body = httpc.chat(20, drop_after=3)
    resp = await httpc.fetch(app.port, "POST", CHAT, body, headers=bearer())
    assert resp.status == 200 and not resp.complete
    assert contents(resp) == [None, "Hello", " from", " a"]
    [row] = await rows_of(app, 1)
    assert (
        row["ok"],
        row["error_code"],
        row["tokens_source"],
        row["completion_tokens"],
        row["prompt_tokens"],
    ) == (0, "upstream_dropped", "approx", sim.requests[-1].tokens_sent, body_len(body) // 4)
    assert row["completion_tokens"] == 3
    assert_budget_is_the_rows(app, [row])


async def test_settle_stall_partial(make_relay, sim):
    app = await make_relay(keys=[key(**LIMITS)], stream_idle_timeout_s=0.2)
    body = httpc.chat(20, stall_after=3)
    resp = await httpc.fetch(app.port, "POST", CHAT, body, headers=bearer())
    assert resp.status == 200 and resp.complete
    [row] = await rows_of(app, 1)
    assert (
        row["ok"],
        row["error_code"],
        row["tokens_source"],
        row["completion_tokens"],
        row["prompt_tokens"],
    ) == (0, "stream_stall_idle", "approx", 3, body_len(body) // 4)
    assert_budget_is_the_rows(app, [row])


async def test_settle_client_disconnect_partial(make_relay, sim):
    app = await make_relay(keys=[key(**LIMITS)])
    body = httpc.chat(1000, interval_ms=5)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("POST", CHAT, body, bearer()))
    await reader.readuntil(b'"content":" tiny"')  # three tokens in
    writer.transport.abort()
    await asyncio.wait_for(sim.requests[-1].closed.wait(), 2)
    [row] = await rows_of(app, 1)
    sent = sim.requests[-1].tokens_sent
    assert row["client_closed"] == 1 and row["ok"] == 0 and row["error_code"] == "client_closed"
    assert row["tokens_source"] == "approx" and row["prompt_tokens"] == body_len(body) // 4
    assert 3 <= row["completion_tokens"] <= sent < 1000  # what went out: not 0, not the ask
    assert_budget_is_the_rows(app, [row])


async def test_settle_shutdown_partial(make_relay, sim, tmp_path):
    db = str(tmp_path / "relay.db")
    app = await make_relay(keys=[key(**LIMITS)], store=db)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(
        httpc.build_request("POST", CHAT, httpc.chat(chatty=True, interval_ms=5), bearer())
    )
    resp = await httpc.read_head(reader)
    reading = asyncio.create_task(httpc.read_body(reader, resp))
    await wait_for(lambda: sim.requests and sim.requests[-1].tokens_sent >= 3)
    await app.stop(drain_timeout_s=0.1)
    await asyncio.wait_for(reading, 5)
    writer.close()
    assert resp.status == 200 and not resp.complete
    [row] = app.store.query("SELECT * FROM request")
    assert (row["error_code"], row["ok"], row["tokens_source"]) == ("shutdown", 0, "approx")
    assert 2 <= row["completion_tokens"] <= sim.requests[-1].tokens_sent
    assert_budget_is_the_rows(app, [row])


async def test_settle_shutdown_while_waiting_for_the_head(make_relay, sim, tmp_path):
    db = str(tmp_path / "relay.db")
    app = await make_relay(keys=[key(**LIMITS)], store=db)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("POST", CHAT, httpc.chat(3, head_delay_ms=8000), bearer()))
    await wait_for(lambda: sim.requests)
    await app.stop(drain_timeout_s=0.1)
    resp = await asyncio.wait_for(httpc.read_head(reader), 2)
    await asyncio.wait_for(httpc.read_body(reader, resp), 2)
    writer.close()
    assert resp.status == 503 and resp.json()["error"]["code"] == "shutting_down"
    # settled once, as a shutdown, nothing used
    [row] = app.store.query("SELECT * FROM request")
    assert (
        row["status"],
        row["error_code"],
        row["ok"],
        row["upstream_served"],
        row["completion_tokens"],
    ) == (503, "shutdown", 0, None, None)
    assert_budget_is_the_rows(app, [row])
    # and the upstream connection is closed with the relay, not left to run
    await asyncio.wait_for(sim.requests[0].closed.wait(), 1.0)
    assert sim.open_connections == 0


async def test_settle_upstream_error_status_passthrough(make_relay, sim):
    app = await make_relay(keys=[key(**LIMITS)])
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(5, status=500), headers=bearer())
    assert resp.status == 500
    [row] = await rows_of(app, 1)
    assert (row["status"], row["ok"], row["upstream_served"], row["error_code"]) == (
        500,
        0,
        "llm",
        "upstream_500",
    )
    assert row["prompt_tokens"] is None and row["completion_tokens"] is None  # unknown: NULL
    assert row["tokens_source"] is None
    assert_budget_is_the_rows(app, [row])
    assert app.budgets.usage("alpha", time.time())["daily"]["requests"] == 1


async def test_settle_upstream_unreachable(make_relay, sim):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    app = await make_relay(url=dead, keys=[key(**LIMITS)])
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(5), headers=bearer())
    assert resp.status == 502
    [row] = await rows_of(app, 1)
    assert (row["upstream_served"], row["prompt_tokens"], row["completion_tokens"]) == (
        None,
        None,
        None,
    )
    assert_budget_is_the_rows(app, [row])


async def test_settle_client_gone_while_waiting_for_head(make_relay, sim):
    app = await make_relay(keys=[key(**LIMITS)])
    _reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("POST", CHAT, httpc.chat(3, head_delay_ms=5000), bearer()))
    await wait_for(lambda: sim.requests)
    writer.transport.abort()
    [row] = await rows_of(app, 1)
    assert row["client_closed"] == 1 and row["completion_tokens"] is None
    assert_budget_is_the_rows(app, [row])


async def test_settle_many_mixed_paths_at_once(make_relay, sim):
    app = await make_relay(keys=[key(**LIMITS)], stream_idle_timeout_s=0.2)
    bodies = [
        httpc.chat(5),
        httpc.chat(9, stream=False),
        httpc.chat(20, drop_after=2),
        httpc.chat(20, stall_after=4),
        httpc.chat(3, status=503),
        httpc.chat(8),
    ] * 3
    resps = await asyncio.gather(
        *(httpc.fetch(app.port, "POST", CHAT, b, headers=bearer()) for b in bodies)
    )
    assert [r.status for r in resps] == [200, 200, 200, 200, 503, 200] * 3
    rows = await rows_of(app, len(bodies))
    assert_budget_is_the_rows(app, rows)
    assert usage_from_rows(rows, "alpha")["tokens"] == 3 * (
        (2 + 5)
        + (2 + 9)
        + (body_len(bodies[2]) // 4 + 2)
        + (body_len(bodies[3]) // 4 + 4)
        + 0
        + (2 + 8)
    )


# ---- restart -------------------------------------------------------------------------------------
async def test_budget_survives_a_restart(make_relay, sim, tmp_path):
    db = str(tmp_path / "relay.db")
    limits = dict(
        requests_per_day=3, tokens_per_day=BIG, requests_per_month=30, tokens_per_month=BIG
    )
    app = await make_relay(keys=[key(**limits), key("beta", OTHER_SECRET, **limits)], store=db)
    assert (
        await httpc.fetch(app.port, "POST", CHAT, httpc.chat(7), headers=bearer())
    ).status == 200
    assert (
        await httpc.fetch(app.port, "POST", CHAT, httpc.chat(20, drop_after=4), headers=bearer())
    ).status == 200
    assert (
        await httpc.fetch(app.port, "POST", CHAT, httpc.chat(5), headers=bearer(OTHER_SECRET))
    ).status == 200
    await rows_of(app, 3)
    before = {k: app.budgets.usage(k, time.time()) for k in ("alpha", "beta")}
    assert before["alpha"]["daily"]["requests"] == 2
    await app.stop()

    again = await make_relay(keys=[key(**limits), key("beta", OTHER_SECRET, **limits)], store=db)
    assert {k: again.budgets.usage(k, time.time()) for k in ("alpha", "beta")} == before
    n = len(sim.requests)
    assert (
        await httpc.fetch(again.port, "POST", CHAT, httpc.chat(2), headers=bearer())
    ).status == 200
    resp = await httpc.fetch(again.port, "POST", CHAT, httpc.chat(2), headers=bearer())
    assert resp.status == 429  # the limit still bites after the restart
    assert resp.json() == budget_error(
        "daily_requests", 3, 1, 3, window_bounds("daily", time.time())[1]
    )
    assert len(sim.requests) == n + 1
    rows = await rows_of(again, 2)
    assert len(rows) == 5
    assert_budget_is_the_rows(again, rows)


# ---- the acceptance test -------------------------------------------------------------------------
async def test_acceptance_100_simultaneous_against_10_per_day(make_relay, sim):
    app = await make_relay(keys=[key(requests_per_day=10)])
    gate = asyncio.Event()

    async def one():
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
        await gate.wait()  # every connection is open before any request goes out
        try:
            return await httpc.exchange(
                reader, writer, "POST", CHAT, httpc.chat(5, interval_ms=10), headers=bearer()
            )
        finally:
            writer.close()

    tasks = [asyncio.create_task(one()) for _ in range(100)]
    await wait_for(lambda: len(app.clients) == 100)
    gate.set()
    resps = await asyncio.gather(*tasks)
    statuses = [r.status for r in resps]
    assert statuses.count(200) == 10 and statuses.count(429) == 90
    for r in resps:
        if r.status == 200:
            assert r.complete and "".join(c for c in contents(r) if c) == httpc.sim_text(5)
        else:
            assert r.json()["error"]["code"] == "budget_exceeded"
            assert r.json()["error"]["details"]["limit"] == "daily_requests"
    assert len(sim.requests) == 10
    rows = await rows_of(app, 100)
    assert len(rows) == 100
    assert sum(r["ok"] for r in rows) == 10
    assert (
        sorted((r["status"], r["error_code"]) for r in rows)
        == [(200, None)] * 10 + [(429, "budget_exceeded")] * 90
    )
    assert all(r["key_id"] == "alpha" for r in rows)
    assert app.budgets.usage("alpha", time.time())["daily"] == usage_from_rows(rows, "alpha")
    assert usage_from_rows(rows, "alpha")["requests"] == 10

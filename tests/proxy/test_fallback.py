"""Fallback over real sockets: every retryable cause before the first content event moves to
the next candidate; 4xx pass through; nothing is swapped after content; rows and metrics name
the upstream that served; when every candidate fails the client gets the last failure."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import pytest

from relay.config import KeyConfig, UpstreamConfig
from relay.sim import wire as W
from relay.sim.server import SimDefaults, Simulator
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import closed_port, contents, rows_of, slots_metrics, wait_for

CHAT = "/v1/chat/completions"

# What the knob-blind fallback upstream always answers: distinctive bytes with exact usage.
CANNED_EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}],'
    b'"model":"canned"}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"served"}}],"model":"canned"}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":" by"}}],"model":"canned"}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":" fallback"}}],"model":"canned"}\n\n',
    b'data: {"choices":[{"index":0,"finish_reason":"stop","delta":{}}],"model":"canned",'
    b'"usage":{"completion_tokens":3,"prompt_tokens":11,"total_tokens":14}}\n\n',
    b"data: [DONE]\n\n",
]
CANNED_BODY = b"".join(CANNED_EVENTS)
CANNED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
)


async def _canned_script(up: Scripted, index: int, reader, writer) -> None:
    while await up.read_request(reader) is not None:
        writer.write(CANNED_HEAD + b"".join(W.chunk(e) for e in CANNED_EVENTS) + b"0\r\n\r\n")
        await writer.drain()


@pytest.fixture
async def canned():
    up = await Scripted(_canned_script).start()
    yield up
    await up.stop()


@pytest.fixture
async def sim_c():
    s = Simulator(defaults=SimDefaults(model="models/c.gguf"))
    await s.start()
    yield s
    await s.stop()


def dead_url() -> str:
    """An address where nothing listens: connect is refused."""
    return f"http://127.0.0.1:{closed_port()}"


def chain(*urls: str, parallel: int = 4) -> list[UpstreamConfig]:
    """Upstreams a, b, c, ... where a falls back to the others in order."""
    names = "abcdefgh"[: len(urls)]
    return [
        UpstreamConfig(
            name=n, url=u, parallel=parallel, fallback=list(names[1:]) if n == "a" else []
        )
        for n, u in zip(names, urls)
    ]


def models_seen(resp) -> set:
    return {e["model"] for e in resp.data_events() if isinstance(e, dict) and "model" in e}


def sent_body(body: dict) -> bytes:
    return json.dumps(body).encode()


# ---- every retryable cause, primary = simulator, fallback = canned upstream ---------------------
CAUSES = [
    # id, primary is reachable, sim knobs, relay fields, the fallback log's reason
    ("connect_refused", False, {}, {}, "upstream_unavailable"),
    (
        "no_head_in_time",
        True,
        {"head_delay_ms": 3000},
        {"direct_read_timeout_s": 0.2},
        "upstream_timeout",
    ),
    ("status_429", True, {"status": 429}, {}, "upstream_unavailable"),
    ("status_500", True, {"status": 500}, {}, "upstream_unavailable"),
    ("status_503", True, {"status": 503}, {}, "upstream_unavailable"),
    ("drop_before_content", True, {"drop_after": 0}, {}, "upstream_unavailable"),
    (
        "stall_before_content",
        True,
        {"stall_after": 0},
        {"stream_idle_timeout_s": 0.2},
        "upstream_unavailable",
    ),
    ("error_event_first", True, {"error_event": True}, {}, "upstream_unavailable"),
]


@pytest.mark.parametrize(
    ("reachable", "knobs", "fields", "reason"), [c[1:] for c in CAUSES], ids=[c[0] for c in CAUSES]
)
async def test_retryable_failure_moves_to_the_next_candidate(
    make_relay, sim, canned, reachable, knobs, fields, reason
):
    primary = sim.url if reachable else dead_url()
    app = await make_relay(upstreams=chain(primary, canned.url), **fields)
    body = httpc.chat(8, **knobs)
    t0 = time.monotonic()
    resp = await httpc.fetch(app.port, "POST", CHAT, body)
    # the client's bytes are the fallback's, whole and unchanged
    assert resp.status == 200 and resp.complete
    assert resp.body == CANNED_BODY
    assert resp.header("content-type") == "text/event-stream"
    assert canned.bodies == [sent_body(body)]
    # the primary was asked (unless unreachable) and its connection is let go
    assert len(sim.requests) == (1 if reachable else 0)
    if reachable:
        await asyncio.wait_for(sim.requests[0].closed.wait(), 2)
        if "head_delay_ms" in knobs:
            assert sim.requests[0].peer_closed_at - t0 < 1.0  # not held to the head delay
    [row] = await rows_of(app, 1)
    assert (
        row["upstream_requested"],
        row["upstream_served"],
        row["fallback_attempts"],
        row["status"],
        row["ok"],
        row["error_code"],
    ) == ("a", "b", 1, 200, 1, None)
    assert (row["prompt_tokens"], row["completion_tokens"], row["tokens_source"]) == (
        11,
        3,
        "exact",
    )
    assert row["bytes_out"] >= len(CANNED_BODY)
    [fb] = app.log.of("fallback")
    assert (fb["upstream"], fb["next"], fb["reason"]) == ("a", "b", reason)
    m = await slots_metrics(app)
    assert m["b"]["tokens_total"] == 3 and m["a"]["tokens_total"] == 0  # the served one
    assert m["b"]["requests_total"] == 1
    assert m["a"]["in_flight"] == 0 and m["b"]["in_flight"] == 0  # both slots released


# ---- two and three real simulators ------------------------------------------------------------
async def test_loading_primary_503_falls_back_to_a_simulator(make_relay, sim, sim_b):
    sim.loading = True  # llama-server answers 503 while its model loads
    app = await make_relay(upstreams=chain(sim.url, sim_b.url))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(6))
    assert resp.status == 200 and resp.complete
    assert models_seen(resp) == {"models/b.gguf"}
    assert "".join(c for c in contents(resp) if c) == httpc.sim_text(6)
    assert [r.status for r in sim.requests] == [503]
    assert len(sim_b.requests) == 1 and sim_b.requests[0].tokens_sent == 6
    [row] = await rows_of(app, 1)
    assert (row["upstream_served"], row["fallback_attempts"], row["completion_tokens"]) == (
        "b",
        1,
        6,
    )
    m = await slots_metrics(app)
    assert m["b"]["tokens_total"] == sim_b.tokens_sent_total == 6
    assert m["a"]["tokens_total"] == 0


async def test_slow_head_primary_falls_back_to_a_simulator(make_relay, sim_b):
    slow = Simulator(defaults=SimDefaults(head_delay_ms=5000))
    await slow.start()
    try:
        app = await make_relay(upstreams=chain(slow.url, sim_b.url), direct_read_timeout_s=0.2)
        resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(4, stream=False))
        assert resp.status == 200
        assert resp.json()["model"] == "models/b.gguf"
        assert resp.json()["usage"]["completion_tokens"] == 4
        await asyncio.wait_for(slow.requests[0].closed.wait(), 2)
        [row] = await rows_of(app, 1)
        assert (
            row["upstream_served"],
            row["fallback_attempts"],
            row["tokens_source"],
            row["completion_tokens"],
        ) == ("b", 1, "exact", 4)
        m = await slots_metrics(app)
        assert (m["a"]["tokens_total"], m["b"]["tokens_total"]) == (0, 4)
    finally:
        await slow.stop()


async def test_three_candidates_in_order(make_relay, sim, sim_b, sim_c):
    sim_b.loading = True
    app = await make_relay(upstreams=chain(dead_url(), sim_b.url, sim_c.url))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(5))
    assert resp.status == 200 and resp.complete
    assert models_seen(resp) == {"models/c.gguf"}
    assert "".join(c for c in contents(resp) if c) == httpc.sim_text(5)
    assert sim.requests == []
    assert [r.status for r in sim_b.requests] == [503] and len(sim_c.requests) == 1
    [row] = await rows_of(app, 1)
    assert (
        row["upstream_requested"],
        row["upstream_served"],
        row["fallback_attempts"],
        row["ok"],
        row["completion_tokens"],
        row["tokens_source"],
    ) == ("a", "c", 2, 1, 5, "exact")
    assert [(f["upstream"], f["next"]) for f in app.log.of("fallback")] == [("a", "b"), ("b", "c")]
    m = await slots_metrics(app)
    assert (m["a"]["tokens_total"], m["b"]["tokens_total"], m["c"]["tokens_total"]) == (
        0,
        0,
        sim_c.tokens_sent_total,
    )


async def test_fallback_reserves_and_settles_the_budget_once(make_relay, sim, sim_b):
    secret = "sk-fallback-budget"
    app = await make_relay(
        upstreams=chain(dead_url(), sim_b.url),
        keys=[
            KeyConfig(
                id="k", sha256=hashlib.sha256(secret.encode()).hexdigest(), requests_per_day=1
            )
        ],
    )
    auth = {"Authorization": f"Bearer {secret}"}
    assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3), headers=auth)).status == 200
    assert app.budgets.usage("k", time.time())["daily"] == {
        "requests": 1,
        "tokens": 2 + 3,
        "reserved_requests": 0,
        "reserved_tokens": 0,
    }
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3), headers=auth)
    assert resp.status == 429
    assert len(sim_b.requests) == 1
    rows = await rows_of(app, 2)
    assert [(r["upstream_served"], r["fallback_attempts"], r["status"]) for r in rows] == [
        ("b", 1, 200),
        (None, 0, 429),
    ]


# ---- no fallback --------------------------------------------------------------------------------
@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_other_4xx_pass_through_verbatim_without_fallback(make_relay, sim, canned, status):
    body = httpc.chat(5, status=status)
    direct = await httpc.fetch(sim.port, "POST", CHAT, body)
    assert direct.status == status
    app = await make_relay(upstreams=chain(sim.url, canned.url))
    resp = await httpc.fetch(app.port, "POST", CHAT, body)
    assert (resp.status, resp.body) == (direct.status, direct.body)
    assert resp.header("content-type") == direct.header("content-type")
    assert resp.body == W.error_body(status)
    assert canned.connections == 0 and canned.bodies == []
    assert len(sim.requests) == 2
    [row] = await rows_of(app, 1)
    assert (
        row["upstream_served"],
        row["fallback_attempts"],
        row["status"],
        row["ok"],
        row["error_code"],
    ) == ("a", 0, status, 0, f"upstream_{status}")
    assert app.log.of("fallback") == []


async def test_404_path_passes_through_verbatim_without_fallback(make_relay, sim, canned):
    direct = await httpc.fetch(sim.port, "POST", "/v1/nowhere", httpc.chat(2))
    app = await make_relay(upstreams=chain(sim.url, canned.url))
    resp = await httpc.fetch(app.port, "POST", "/v1/nowhere", httpc.chat(2))
    assert (resp.status, resp.body) == (404, direct.body) == (404, W.NOT_FOUND_BODY)
    assert canned.connections == 0


async def test_no_swap_after_first_content_drop(make_relay, sim, sim_b):
    app = await make_relay(upstreams=chain(sim.url, sim_b.url))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(20, drop_after=3))
    assert resp.status == 200 and not resp.complete  # a truncated stream, not a swapped one
    assert contents(resp) == [None, "Hello", " from", " a"]
    assert models_seen(resp) == {"models/tiny.gguf"}
    assert b"[DONE]" not in resp.body
    assert sim_b.requests == [] and sim_b.connections_opened == 0
    [row] = await rows_of(app, 1)
    assert (
        row["upstream_served"],
        row["fallback_attempts"],
        row["ok"],
        row["error_code"],
        row["completion_tokens"],
        row["tokens_source"],
    ) == ("a", 0, 0, "upstream_dropped", 3, "approx")
    assert app.log.of("fallback") == []
    m = await slots_metrics(app)
    assert (m["a"]["tokens_total"], m["b"]["tokens_total"]) == (3, 0)


async def test_no_swap_after_first_content_stall(make_relay, sim, sim_b):
    app = await make_relay(upstreams=chain(sim.url, sim_b.url), stream_idle_timeout_s=0.2)
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(20, stall_after=1))
    assert resp.status == 200 and resp.complete
    assert contents(resp)[:2] == [None, "Hello"]
    events = resp.data_events()
    assert events[-1] == "[DONE]" and events[-2]["id"] == "relay-stall-guard"
    assert sim_b.requests == [] and sim_b.connections_opened == 0
    [row] = await rows_of(app, 1)
    assert (row["upstream_served"], row["fallback_attempts"], row["error_code"]) == (
        "a",
        0,
        "stream_stall_idle",
    )


async def test_slow_first_token_is_waited_for_not_swapped(make_relay, sim, sim_b):
    app = await make_relay(upstreams=chain(sim.url, sim_b.url))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3, first_token_delay_ms=300))
    assert resp.status == 200 and resp.complete
    assert models_seen(resp) == {"models/tiny.gguf"}
    assert sim_b.requests == []


# ---- every candidate fails: the last failure --------------------------------------------------
async def test_all_unreachable_gives_502_naming_the_last(make_relay):
    app = await make_relay(upstreams=chain(dead_url(), dead_url()))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
    assert resp.status == 502
    err = resp.json()["error"]
    assert err["code"] == "upstream_unavailable" and err["details"]["upstream"] == "b"
    [row] = await rows_of(app, 1)
    assert (
        row["upstream_requested"],
        row["upstream_served"],
        row["fallback_attempts"],
        row["status"],
        row["ok"],
        row["error_code"],
    ) == ("a", None, 1, 502, 0, "upstream_unavailable")
    assert (row["prompt_tokens"], row["completion_tokens"], row["tokens_source"]) == (
        None,
        None,
        None,
    )


async def test_all_slow_gives_504_naming_the_last(make_relay, sim, sim_b):
    app = await make_relay(upstreams=chain(sim.url, sim_b.url), direct_read_timeout_s=0.2)
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3, head_delay_ms=3000))
    assert resp.status == 504
    err = resp.json()["error"]
    assert err["code"] == "upstream_timeout" and err["details"] == {"upstream": "b"}
    assert len(sim.requests) == 1 and len(sim_b.requests) == 1
    [row] = await rows_of(app, 1)
    assert (row["upstream_served"], row["fallback_attempts"], row["status"]) == (None, 1, 504)


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_all_failing_status_gives_the_last_upstreams_own_response(
    make_relay, sim, sim_b, status
):
    app = await make_relay(upstreams=chain(sim.url, sim_b.url))
    body = httpc.chat(3, status=status)
    resp = await httpc.fetch(app.port, "POST", CHAT, body)
    assert (resp.status, resp.body) == (status, W.error_body(status))
    assert [r.status for r in sim.requests] == [status]
    assert [r.status for r in sim_b.requests] == [status]
    [row] = await rows_of(app, 1)
    assert (row["upstream_served"], row["fallback_attempts"], row["status"], row["ok"]) == (
        "b",
        1,
        status,
        0,
    )


async def test_unreachable_then_429_gives_the_429(make_relay, sim):
    app = await make_relay(upstreams=chain(dead_url(), sim.url))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3, status=429))
    assert (resp.status, resp.body) == (429, W.error_body(429))
    [row] = await rows_of(app, 1)
    assert (row["upstream_served"], row["fallback_attempts"], row["status"]) == ("b", 1, 429)


async def test_all_dropping_before_content_gives_502(make_relay, sim, sim_b):
    app = await make_relay(upstreams=chain(sim.url, sim_b.url))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(5, drop_after=0))
    assert resp.status == 502
    err = resp.json()["error"]
    assert err["code"] == "upstream_unavailable"
    assert err["details"] == {"upstream": "b", "error": "upstream_dropped"}
    assert len(sim.requests) == 1 and len(sim_b.requests) == 1
    [row] = await rows_of(app, 1)
    assert (row["upstream_served"], row["fallback_attempts"], row["status"], row["ok"]) == (
        None,
        1,
        502,
        0,
    )
    assert row["completion_tokens"] is None


async def test_all_error_events_give_the_last_upstreams_event(make_relay, sim, sim_b):
    app = await make_relay(upstreams=chain(sim.url, sim_b.url))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(5, error_event=True))
    assert resp.status == 200 and resp.complete
    assert resp.body == W.ERROR_EVENT
    assert len(sim.requests) == 1 and len(sim_b.requests) == 1
    [row] = await rows_of(app, 1)
    assert (row["upstream_served"], row["fallback_attempts"]) == ("b", 1)
    assert row["completion_tokens"] == 0  # nothing generated: known zero, not unknown


async def test_all_stalling_before_content_ends_with_the_stall_frame(make_relay, sim, sim_b):
    app = await make_relay(upstreams=chain(sim.url, sim_b.url), stream_idle_timeout_s=0.2)
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(5, stall_after=0))
    assert resp.status == 200 and resp.complete
    events = resp.data_events()
    assert events[-1] == "[DONE]" and events[-2]["x_relay_stall"]["upstream"] == "b"
    assert models_seen(resp) >= {"models/b.gguf"}
    assert len(sim.requests) == 1 and len(sim_b.requests) == 1
    [row] = await rows_of(app, 1)
    assert (row["upstream_served"], row["fallback_attempts"], row["error_code"]) == (
        "b",
        1,
        "stream_stall_idle",
    )


@pytest.mark.parametrize(
    ("first", "second", "status", "code"),
    [
        ("slow", "dead", 502, "upstream_unavailable"),
        ("dead", "slow", 504, "upstream_timeout"),
        ("500", "dead", 502, "upstream_unavailable"),
    ],
    ids=["timeout-then-refused", "refused-then-timeout", "500-then-refused"],
)
async def test_mixed_failures_give_the_last_one(make_relay, first, second, status, code):
    sims = []

    async def upstream(kind: str) -> str:
        if kind == "dead":
            return dead_url()
        s = Simulator(defaults=SimDefaults(head_delay_ms=3000 if kind == "slow" else 0))
        if kind == "500":
            s.loading = True  # 503 "Loading model"
        await s.start()
        sims.append(s)
        return s.url

    try:
        app = await make_relay(
            upstreams=chain(await upstream(first), await upstream(second)),
            direct_read_timeout_s=0.2,
        )
        resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
        assert resp.status == status
        err = resp.json()["error"]
        assert err["code"] == code and err["details"]["upstream"] == "b"
        [row] = await rows_of(app, 1)
        assert (
            row["upstream_served"],
            row["fallback_attempts"],
            row["status"],
            row["error_code"],
        ) == (None, 1, status, code)
    finally:
        for s in sims:
            await s.stop()


async def test_failed_attempts_are_counted_on_the_upstream_that_failed(make_relay, sim, canned):
    app = await make_relay(upstreams=chain(sim.url, canned.url))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3, status=500))
    assert resp.status == 200 and resp.body == CANNED_BODY
    metrics = json.loads((await httpc.fetch(app.port, "GET", "/api/slots/metrics")).body)
    a, b = metrics["a"], metrics["b"]
    assert (a["requests_total"], a["requests_failed"], a["failures_by_code"]) == (
        1,
        1,
        {"upstream_unavailable": 1},
    )
    assert (b["requests_total"], b["requests_failed"], b["tokens_total"]) == (1, 0, 3)


async def test_when_every_candidate_fails_the_last_one_carries_the_failure(make_relay):
    app = await make_relay(upstreams=chain(dead_url(), dead_url()))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
    assert resp.status == 502 and resp.json()["error"]["details"]["upstream"] == "b"
    metrics = json.loads((await httpc.fetch(app.port, "GET", "/api/slots/metrics")).body)
    assert [(metrics[n]["requests_total"], metrics[n]["requests_failed"]) for n in "ab"] == [
        (1, 1),
        (1, 1),
    ]


async def test_a_reload_removing_the_fallback_does_not_strand_a_request_falling_back(
    make_relay, sim, sim_b
):
    """SIGHUP removes b while a request queues on a: the request still falls back to the b it
    was routed among (its upstreams are taken at its start), no 500."""
    from relay.config import Config

    ups = [
        UpstreamConfig(name="a", url=sim.url, parallel=1, queue=4, fallback=["b"]),
        UpstreamConfig(name="b", url=sim_b.url, parallel=4),
    ]
    app = await make_relay(upstreams=ups, pool_timeout_s=0.5)
    holding = asyncio.create_task(
        httpc.fetch(
            app.port,
            "POST",
            CHAT,
            httpc.chat(2, first_token_delay_ms=1500),
            {"X-Request-Id": "holding"},
        )
    )
    await wait_for(lambda: len(sim.requests) == 1)
    falling = asyncio.create_task(
        httpc.fetch(app.port, "POST", CHAT, httpc.chat(3), {"X-Request-Id": "falling"})
    )
    await wait_for(lambda: app.upstreams["a"].slots.queued == 1)
    old = app.config
    summary = app.reload(
        Config(
            server=old.server,
            dispatcher=old.dispatcher,
            upstream=[UpstreamConfig(name="a", url=sim.url, parallel=1, queue=4)],
            key=[],
            store=old.store,
        )
    )
    assert summary["removed"] == ["b"]
    first, second = await asyncio.wait_for(asyncio.gather(holding, falling), 10)
    assert (first.status, second.status) == (200, 200)
    assert models_seen(second) == {"models/b.gguf"}
    assert "".join(c for c in contents(second) if c) == httpc.sim_text(3)
    assert not app.log.of("internal_error")
    by_id = {r["request_id"]: r for r in await rows_of(app, 2)}
    assert (
        by_id["falling"]["upstream_served"],
        by_id["falling"]["fallback_attempts"],
        by_id["falling"]["status"],
        by_id["falling"]["completion_tokens"],
    ) == ("b", 1, 200, 3)
    assert (by_id["holding"]["upstream_served"], by_id["holding"]["status"]) == ("a", 200)

"""A key's limits that act now (issue 33 item 1) over real sockets, one relay in this process in
front of the simulator: `max_concurrent` counts requests in flight and queued, the per-minute
limits a sliding minute of admissions. A request beyond one is refused with 429 before any
slot or upstream (the simulator sees nothing), its body says which limit, the figures and when
to retry, as the budget's 429 does (docs/budgets.md), and its row carries the code and charges
nothing: the figures of the next refusal and of the day's budget are unchanged by it. Tokens
are reserved as the budgets reserve them (body bytes / 4 + the completion limit) and settled
to what the row charges."""

from __future__ import annotations

import asyncio
import json
import math
import time
from datetime import UTC, datetime

from tests.support import httpc
from tests.support.helpers import error_of, rows, wait_for
from tests.support.keys import key

CHAT = "/v1/chat/completions"
SECRET = "sk-limits-0123456789-secret"
WAIT_S = 60.0
# Streams that hold their slot until the test hangs up on them.
ENDLESS = {"tokens": 600, "interval_ms": 50}


def auth(rid: str) -> dict:
    return {"Authorization": f"Bearer {SECRET}", "X-Request-Id": rid}


def chat(max_tokens: int, stream: bool = False, **sim) -> dict:
    body = {
        "model": "tiny",
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Hi there"}],
    }
    if sim:
        body["sim"] = sim
    return body


def reservation(body: dict) -> int:
    """What docs/budgets.md says a request reserves: its body's bytes / 4 and its completion
    limit (one prompt, one choice)."""
    return len(json.dumps(body).encode()) // 4 + body["max_tokens"]


async def post(port: int, body: dict, rid: str):
    return await httpc.fetch(port, "POST", CHAT, body, auth(rid), timeout=WAIT_S)


class Holders:
    """Streamed requests that hold what they took (a slot, or a place in the queue) until the
    test hangs up on them."""

    def __init__(self) -> None:
        self.writers: dict[str, asyncio.StreamWriter] = {}

    async def hold(self, port: int, rid: str, body: dict | None = None) -> None:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = body or chat(ENDLESS["tokens"], stream=True, **ENDLESS)
        writer.write(httpc.build_request("POST", CHAT, body, auth(rid)))
        self.writers[rid] = writer

    def hang_up(self, *rids: str) -> None:
        """Those named, or all."""
        for rid in rids or list(self.writers):
            self.writers.pop(rid).close()


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def refused(resp, code: str, limit: str) -> dict:
    """The 429's details, its shape and code checked."""
    assert resp.status == 429, (resp.status, resp.body[:300])
    err = error_of(resp)
    assert (err["type"], err["code"]) == ("rate_limit_error", code)
    details = err["details"]
    assert list(details) == ["limit", "used", "requested", "limit_value", "resets_at"]
    assert details["limit"] == limit
    assert f"{limit} limit exceeded: " in err["message"]
    return details


async def row_of(app, rid: str) -> dict:
    await wait_for(lambda: rows(app, "WHERE request_id = ?", (rid,)), WAIT_S)
    (row,) = rows(app, "WHERE request_id = ?", (rid,))
    return row


def uncharged(row: dict, code: str) -> None:
    """A refusal's row: the code, no upstream, no slot, no tokens."""
    assert (
        row["status"],
        row["error_code"],
        row["upstream_served"],
        row["queue_ms"],
        row["prompt_tokens"],
        row["completion_tokens"],
    ) == (429, code, None, None, None, None), row


def chats(sim) -> int:
    return len([r for r in sim.requests if r.path == CHAT])


async def daily(port: int) -> dict:
    """The key's daily window as the operator page shows it."""
    doc = (await httpc.fetch(port, "GET", "/api/ui/state")).json()
    (k,) = doc["budgets"]
    (window,) = k["windows"]
    return window


# ---- requests at once ---------------------------------------------------------------------
async def test_max_concurrent_counts_the_queued_and_refuses_before_any_slot(make_relay, sim):
    app = await make_relay(
        keys=[key("team", SECRET, max_concurrent=2, requests_per_day=100)],
        parallel=1,
        pool_timeout_s=60,
    )
    holders = Holders()
    try:
        # One in the upstream's only slot, one waiting for it: two at once.
        await holders.hold(app.port, "held")
        await wait_for(lambda: chats(sim) == 1, WAIT_S)
        await holders.hold(app.port, "queued")
        await wait_for(lambda: app.board.waiting_by_key() == {"team": 1}, WAIT_S)
        before = await daily(app.port)
        t0 = time.time()
        resp = await post(app.port, chat(5), "third")
        t1 = time.time()
        details = refused(resp, "concurrency_exceeded", "concurrent_requests")
        assert (details["used"], details["requested"], details["limit_value"]) == (2, 1, 2)
        # No settlement time can be known: a retry in a second.
        assert resp.header("retry-after") == "1"
        assert iso(t0 + 1) <= details["resets_at"] <= iso(t1 + 1)
        # Refused before any slot or upstream: the simulator saw the one held, the queue
        # holds the one waiting.
        assert chats(sim) == 1 and app.board.waiting_by_key() == {"team": 1}
        uncharged(await row_of(app, "third"), "concurrency_exceeded")
        # Charged nothing: the next refusal says the same, and the day's budget too.
        again = refused(
            await post(app.port, chat(5), "fourth"), "concurrency_exceeded", "concurrent_requests"
        )
        assert again["used"] == 2
        assert await daily(app.port) == before
        # The one waiting goes away while queued: room for one more, which queues.
        holders.hang_up("queued")
        await row_of(app, "queued")
        await holders.hold(app.port, "queued2")
        await wait_for(lambda: app.board.waiting_by_key() == {"team": 1}, WAIT_S)
        # The one in the slot settles: the one waiting takes it, and there is room again.
        holders.hang_up("held")
        await row_of(app, "held")
        await wait_for(lambda: chats(sim) == 2, WAIT_S)
        holders.hang_up()
        await row_of(app, "queued2")
        resp = await post(app.port, chat(5), "fifth")
        assert resp.status == 200
    finally:
        holders.hang_up()
    # The three served are charged; the two refused and the one that left the queue not.
    assert (await daily(app.port))["requests"] == 3


# ---- requests per minute ------------------------------------------------------------------
async def test_requests_per_minute_refuses_until_the_first_leaves_the_window(make_relay, sim):
    app = await make_relay(keys=[key("team", SECRET, requests_per_minute=3)])
    t_first = time.time()
    for i in range(3):
        assert (await post(app.port, chat(5), f"ok{i}")).status == 200
        if i == 0:
            t_first_done = time.time()
    t0 = time.time()
    resp = await post(app.port, chat(5), "over")
    t1 = time.time()
    details = refused(resp, "rate_limit_exceeded", "minute_requests")
    assert (details["used"], details["requested"], details["limit_value"]) == (3, 1, 3)
    # Room when the first of the three leaves the minute: 60 s after it was admitted.
    assert iso(t_first + 60) <= details["resets_at"] <= iso(t_first_done + 60)
    retry = int(resp.header("retry-after"))
    assert math.ceil(t_first + 60 - t1) <= retry <= math.ceil(t_first_done + 60 - t0)
    assert chats(sim) == 3
    uncharged(await row_of(app, "over"), "rate_limit_exceeded")
    # The refusal took no place in the window.
    again = refused(
        await post(app.port, chat(5), "over2"), "rate_limit_exceeded", "minute_requests"
    )
    assert again["used"] == 3 and chats(sim) == 3


# ---- tokens per minute --------------------------------------------------------------------
async def test_tokens_per_minute_reserve_then_settle_to_what_the_rows_charge(make_relay, sim):
    limit = 1000
    app = await make_relay(keys=[key("team", SECRET, tokens_per_minute=limit)], pool_timeout_s=60)
    holders = Holders()
    held = chat(500, stream=True, **ENDLESS)
    t_held = time.time()
    await holders.hold(app.port, "held", held)
    try:
        await wait_for(lambda: chats(sim) == 1, WAIT_S)
        t_held_in = time.time()
        # The one in flight holds its whole reservation: a second as large does not fit.
        second = chat(500, tokens=300)
        resp = await post(app.port, second, "second-early")
        details = refused(resp, "rate_limit_exceeded", "minute_tokens")
        assert details == {
            "limit": "minute_tokens",
            "used": reservation(held),
            "requested": reservation(second),
            "limit_value": limit,
            "resets_at": details["resets_at"],
        }
        uncharged(await row_of(app, "second-early"), "rate_limit_exceeded")
        assert chats(sim) == 1
        # Cut short, it is charged what it used: the window holds that, no more.
        holders.hang_up()
        held_row = await row_of(app, "held")
    finally:
        holders.hang_up()
    resp = await post(app.port, second, "second")
    assert resp.status == 200
    second_row = await row_of(app, "second")
    charged = [r["prompt_tokens"] + r["completion_tokens"] for r in (held_row, second_row)]
    assert charged[0] < reservation(held) and charged[1] < reservation(second)
    # A request that fits the limit but not what the window holds now.
    used = sum(charged)
    third = chat(limit - used)
    t0 = time.time()
    resp = await post(app.port, third, "third")
    t1 = time.time()
    details = refused(resp, "rate_limit_exceeded", "minute_tokens")
    assert (details["used"], details["requested"]) == (used, reservation(third))
    assert reservation(third) <= limit
    # Room once the first admitted leaves the window (what is left and the request fit).
    assert iso(t_held + 60) <= details["resets_at"] <= iso(t_held_in + 60)
    retry = int(resp.header("retry-after"))
    assert math.ceil(t_held + 60 - t1) <= retry <= math.ceil(t_held_in + 60 - t0)
    uncharged(await row_of(app, "third"), "rate_limit_exceeded")
    again = refused(
        await post(app.port, third, "third-again"), "rate_limit_exceeded", "minute_tokens"
    )
    assert again["used"] == used
    assert chats(sim) == 2

"""Request rows over real sockets: exactly one row per request on every exit path, the columns
asserted; shutdown flushes; `relay report` on real rows; the 500-request acceptance run."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sqlite3
import time

from relay.config import UpstreamConfig
from relay.report import summary as report
from tests.support import httpc
from tests.support.helpers import LOOP_EARLY_MS, one_row, rid_header, rows, wait_for
from tests.support.sockets import slow_client

CHAT = "/v1/chat/completions"
PROMPT_TOKENS = 2  # the simulator's prompt_n for httpc.chat's "Hi there" (8 chars / 4)


def sim_request(sim, rid: str):
    [req] = [r for r in sim.requests if (b"x-request-id", rid.encode()) in r.headers]
    return req


def check(row: dict, **expected) -> None:
    assert {k: row[k] for k in expected} == expected


# ---- each exit path ---------------------------------------------------------------------------
async def test_row_of_a_finished_stream(make_relay, sim):
    app = await make_relay()
    t0 = time.time()
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(7), headers=rid_header("fin-1"))
    assert resp.status == 200 and resp.complete
    row = await one_row(app, "fin-1")
    check(
        row,
        key_id=None,
        path=CHAT,
        model="tiny",
        stream=1,
        upstream_requested="llm",
        upstream_served="llm",
        fallback_attempts=0,
        status=200,
        ok=1,
        error_code=None,
        prompt_tokens=PROMPT_TOKENS,
        completion_tokens=7,
        tokens_source="exact",
        bytes_out=len(resp.raw_body),
        client_closed=0,
    )
    assert t0 <= row["ts"] <= time.time()
    assert 0 <= row["queue_ms"] < row["ttft_ms"] <= row["total_ms"]
    assert sim_request(sim, "fin-1").completion_tokens == 7


async def test_row_of_a_non_streamed_answer(make_relay, sim):
    app = await make_relay()
    resp = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(5, stream=False), headers=rid_header("plain-1")
    )
    assert resp.status == 200
    row = await one_row(app, "plain-1")
    check(
        row,
        stream=0,
        status=200,
        ok=1,
        error_code=None,
        ttft_ms=None,
        prompt_tokens=PROMPT_TOKENS,
        completion_tokens=5,
        tokens_source="exact",
        bytes_out=len(resp.body),
        client_closed=0,
        upstream_served="llm",
    )
    assert row["total_ms"] > 0


async def test_row_of_an_upstream_error_status(make_relay, sim):
    app = await make_relay()
    resp = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(5, status=500), headers=rid_header("err-1")
    )
    assert resp.status == 500
    row = await one_row(app, "err-1")
    check(
        row,
        stream=1,
        status=500,
        ok=0,
        error_code="upstream_500",
        ttft_ms=None,
        completion_tokens=None,
        tokens_source=None,
        bytes_out=len(resp.body),
        client_closed=0,
        upstream_requested="llm",
        upstream_served="llm",
    )


async def test_row_of_an_upstream_drop_mid_stream(make_relay, sim):
    app = await make_relay()
    resp = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(20, drop_after=3), headers=rid_header("drop-1")
    )
    assert resp.status == 200 and not resp.complete
    row = await one_row(app, "drop-1")
    check(
        row,
        stream=1,
        status=200,
        ok=0,
        error_code="upstream_dropped",
        completion_tokens=3,
        tokens_source="approx",
        bytes_out=len(resp.raw_body),
        client_closed=0,
        upstream_served="llm",
    )
    assert row["ttft_ms"] is not None
    assert sim_request(sim, "drop-1").tokens_sent == 3


async def test_row_of_a_client_gone_mid_stream(make_relay, sim):
    app = await make_relay()
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(
        httpc.build_request("POST", CHAT, httpc.chat(20, stall_after=5), rid_header("gone-1"))
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    got = await asyncio.wait_for(reader.readuntil(b'"content":" llama"'), 5)  # token 5 of 5
    got += await asyncio.wait_for(reader.readuntil(b"\n\n\r\n"), 5)  # the rest of its chunk
    assert head.startswith(b"HTTP/1.1 200 ")
    writer.transport.abort()
    row = await one_row(app, "gone-1")
    check(
        row,
        stream=1,
        status=200,
        ok=0,
        error_code="client_closed",
        client_closed=1,
        completion_tokens=5,
        tokens_source="approx",
        bytes_out=len(got),
        upstream_served="llm",
    )
    assert sim_request(sim, "gone-1").tokens_sent == 5


async def test_row_of_a_client_gone_before_draining(make_relay, sim):
    app = await make_relay(parallel=1)
    sock, conn, head = await slow_client(app, httpc.chat(250))
    assert head.status == 200
    await wait_for(lambda: conn.exchange is None)  # relay read everything upstream sent
    assert conn.transport.get_write_buffer_size() > 0  # the client has most of it still owed
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()  # reset: the rest of the response never reaches the client
    await wait_for(lambda: app.upstreams["llm"].slots.in_flight == 0)
    [row] = rows(app)
    check(row, status=200, ok=0, client_closed=1, error_code="client_closed")


async def test_row_of_a_client_too_slow_to_drain(make_relay, sim):
    app = await make_relay(parallel=1, write_timeout_s=0.3)
    sock, _conn, _head = await slow_client(app, httpc.chat(250))
    await wait_for(lambda: app.upstreams["llm"].slots.in_flight == 0)  # write timeout
    sock.close()
    [row] = rows(app)
    check(row, status=200, ok=0, client_closed=1, error_code="client_write_timeout")


async def test_row_of_an_in_stream_error_event(make_relay, sim):
    app = await make_relay()
    resp = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(3, error_event=True), headers=rid_header("evt-1")
    )
    assert resp.status == 200 and resp.body.startswith(b'data: {"error"')  # passed through
    row = await one_row(app, "evt-1")
    check(
        row,
        status=200,
        ok=0,
        error_code="upstream_error_event",
        client_closed=0,
        completion_tokens=0,
        ttft_ms=None,
        bytes_out=len(resp.raw_body),
    )


async def test_row_of_a_stall(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(20, stall_after=3), headers=rid_header("stall-1")
    )
    assert resp.status == 200 and resp.complete and b"relay-stall-guard" in resp.body
    row = await one_row(app, "stall-1")
    check(
        row,
        stream=1,
        status=200,
        ok=0,
        error_code="stream_stall_idle",
        completion_tokens=3,
        tokens_source="approx",
        bytes_out=len(resp.raw_body),
        client_closed=0,
        upstream_served="llm",
    )
    assert row["total_ms"] >= 200 - LOOP_EARLY_MS


async def test_rows_of_requests_the_relay_refused(make_relay, sim):
    app = await make_relay(
        upstreams=[UpstreamConfig(name="llm", url=sim.url, models=["tiny"], parallel=1, queue=0)],
        header_timeout_s=0.2,
        max_body_bytes=2048,
        max_header_bytes=1024,
    )
    bad = b"{not json"
    r400 = await httpc.fetch(
        app.port,
        "POST",
        CHAT,
        bad,
        headers={"X-Request-Id": "r400", "Content-Type": "application/json"},
    )
    r404 = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(3, model="nope"), headers=rid_header("r404")
    )
    r413 = await httpc.fetch(
        app.port, "POST", CHAT, {"model": "tiny", "pad": "x" * 4000}, headers=rid_header("r413")
    )
    r431 = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(3), headers={"X-Request-Id": "r431", "X-Pad": "y" * 2000}
    )
    # 408: a head that never ends
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: relay.test\r\n")
    r408 = await asyncio.wait_for(httpc.read_head(reader), 5)
    await asyncio.wait_for(httpc.read_body(reader, r408), 5)
    writer.close()
    # 503: the one slot is taken and nothing may wait
    hold_r, hold_w = await asyncio.open_connection("127.0.0.1", app.port)
    hold_w.write(
        httpc.build_request("POST", CHAT, httpc.chat(9, stall_after=1), rid_header("holder"))
    )
    assert (await asyncio.wait_for(httpc.read_head(hold_r), 5)).status == 200
    r503 = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3), headers=rid_header("r503"))
    hold_w.transport.abort()

    statuses = [r.status for r in (r400, r404, r408, r413, r431, r503)]
    assert statuses == [400, 404, 408, 413, 431, 503]
    assert r503.header("retry-after") == "5"
    await one_row(app, "holder")
    got = rows(app)
    assert len(got) == 7
    refused = [r for r in got if r["request_id"] != "holder"]
    assert sorted((r["status"], r["error_code"]) for r in refused) == [
        (400, "invalid_json"),
        (404, "model_not_found"),
        (408, "request_timeout"),
        (413, "request_too_large"),
        (431, "headers_too_large"),
        (503, "upstream_busy"),
    ]
    for r in refused:
        check(
            r,
            ok=0,
            client_closed=0,
            upstream_served=None,
            ttft_ms=None,
            completion_tokens=None,
            tokens_source=None,
        )
    by_id = {r["request_id"]: r for r in refused}
    # The body of the relay's own answer is what the client got (a 408 has no request id:
    # its row is the one left).
    answers = {"r400": r400, "r404": r404, "r413": r413, "r431": r431, "r503": r503}
    (r408_id,) = set(by_id) - set(answers)
    for rid, resp in {**answers, r408_id: r408}.items():
        assert resp.body and by_id[rid]["bytes_out"] == len(resp.raw_body), rid
    check(by_id["r400"], path=CHAT, upstream_requested=None)
    check(by_id["r404"], path=CHAT, model="nope", upstream_requested=None)
    check(by_id["r413"], path=CHAT, status=413)
    check(by_id["r503"], path=CHAT, model="tiny", upstream_requested="llm", stream=1)
    assert [r.json.get("max_tokens") for r in sim.requests] == [9]  # only the holder got there


async def test_shutdown_flushes_every_row(make_relay, sim, tmp_path):
    path = str(tmp_path / "r.db")
    app = await make_relay(store=path, parallel=1)
    for n in (2, 3, 4):
        assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(n))).status == 200
    # one stream still running and one request still queued behind it when the relay stops
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(
        httpc.build_request(
            "POST", CHAT, httpc.chat(chatty=True, interval_ms=10), rid_header("running")
        )
    )
    assert (await asyncio.wait_for(httpc.read_head(reader), 5)).status == 200
    queued = asyncio.create_task(
        httpc.fetch(app.port, "POST", CHAT, httpc.chat(3), headers=rid_header("queued"))
    )
    await wait_for(lambda: app.upstreams["llm"].slots.queued == 1)
    await app.stop(drain_timeout_s=0.2)
    late = await asyncio.wait_for(queued, 5)
    writer.close()
    # queued when the drain began: refused at once (issue 10), no stream started for it
    assert late.status == 503 and late.json()["error"]["code"] == "shutting_down"
    conn = sqlite3.connect(path)
    try:
        got = conn.execute(
            "SELECT request_id, ok, error_code FROM request ORDER BY rowid"
        ).fetchall()
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()
    assert len(got) == 5
    by_id = {rid: (ok, code) for rid, ok, code in got}
    assert by_id.pop("running") == (0, "shutdown")
    assert by_id.pop("queued") == (0, "shutting_down")
    assert list(by_id.values()) == [(1, None)] * 3


# ---- relay report on rows real requests produced ------------------------------------------------
async def test_report_on_rows_of_real_requests(make_relay, sim, tmp_path, capsys):
    path = str(tmp_path / "r.db")
    app = await make_relay(
        store=path,
        stream_idle_timeout_s=0.2,
        stream_total_timeout_s=0,
        upstreams=[UpstreamConfig(name="llm", url=sim.url, models=["tiny"], parallel=8)],
    )
    for n in (3, 5, 7):
        assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(n))).status == 200
    assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(4, stream=False))).status == 200
    await httpc.fetch(app.port, "POST", CHAT, httpc.chat(9, drop_after=2))
    await httpc.fetch(app.port, "POST", CHAT, httpc.chat(9, stall_after=2))
    assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3, model="nope"))).status == 404
    await app.stop(drain_timeout_s=0.5)
    capsys.readouterr()
    assert report.main(["--db", path, "--json", "--since", "all"]) == 0
    out = json.loads(capsys.readouterr().out)
    groups = {(g["model"], g["upstream"]): g for g in out["groups"]}
    assert sorted(groups, key=str) == [("nope", None), ("tiny", "llm")]
    tiny = groups[("tiny", "llm")]
    assert (tiny["requests"], tiny["ok"], tiny["failed"]) == (6, 4, 2)
    assert tiny["failures"] == {"stream_stall_idle": 1, "upstream_dropped": 1}
    assert tiny["completion_tokens"] == 3 + 5 + 7 + 4 + 2 + 2
    assert (tiny["tokens_exact"], tiny["tokens_approx"]) == (4, 2)
    assert tiny["ttft_p50_ms"] is not None and tiny["tok_s_p50"] > 0
    nope = groups[("nope", None)]
    assert (nope["requests"], nope["failed"], nope["failures"]) == (1, 1, {"model_not_found": 1})
    total = out["total"]
    assert (total["requests"], total["ok"], total["failed"]) == (7, 4, 3)


# ---- acceptance: 500 mixed requests -------------------------------------------------------------
KINDS = ("stream", "stream", "stream", "usage", "plain", "plain", "gone", "stall", "drop", "stream")


async def _one(port: int, i: int, kind: str, rng: random.Random) -> dict:
    rid = f"acc-{i:04d}"
    headers = rid_header(rid)
    n = rng.randint(1, 40)
    if kind == "stream":
        resp = await httpc.fetch(
            port, "POST", CHAT, httpc.chat(n, interval_ms=rng.choice([0, 1])), headers=headers
        )
        assert resp.status == 200 and resp.complete
    elif kind == "usage":
        body = {**httpc.chat(n), "stream_options": {"include_usage": True}}
        resp = await httpc.fetch(port, "POST", CHAT, body, headers=headers)
        assert resp.status == 200 and resp.complete
    elif kind == "plain":
        resp = await httpc.fetch(port, "POST", CHAT, httpc.chat(n, stream=False), headers=headers)
        assert resp.status == 200
    elif kind == "gone":
        k = rng.randint(1, 4)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            httpc.build_request("POST", CHAT, httpc.chat(chatty=True, interval_ms=3), headers)
        )
        for _ in range(k + 1):  # the role event, then k tokens
            await asyncio.wait_for(reader.readuntil(b'"content":'), 10)
        writer.transport.abort()
        return {"rid": rid, "kind": kind, "read": k}
    elif kind == "stall":
        k = rng.randint(0, 5)
        resp = await httpc.fetch(
            port, "POST", CHAT, httpc.chat(n + 6, stall_after=k), headers=headers
        )
        assert resp.status == 200 and resp.complete and b"relay-stall-guard" in resp.body
        return {"rid": rid, "kind": kind, "read": k}
    else:  # drop
        k = rng.randint(1, 5)
        resp = await httpc.fetch(
            port, "POST", CHAT, httpc.chat(n + 6, drop_after=k), headers=headers
        )
        assert resp.status == 200 and not resp.complete
        return {"rid": rid, "kind": kind, "read": k}
    return {"rid": rid, "kind": kind, "read": n}


async def test_acceptance_500_mixed_requests(make_relay, sim):
    app = await make_relay(parallel=64, stream_idle_timeout_s=0.3, stream_total_timeout_s=0)
    rng = random.Random(20240531)
    total, batch = 500, 64
    done: list[dict] = []
    for start in range(0, total, batch):
        idx = range(start, min(start + batch, total))
        done += await asyncio.wait_for(
            asyncio.gather(*(_one(app.port, i, KINDS[i % len(KINDS)], rng) for i in idx)), 30
        )
    up = app.upstreams["llm"]
    await wait_for(lambda: up.slots.in_flight == 0 and up.slots.queued == 0, timeout=10)

    got = rows(app)
    assert len(got) == total
    by_id = {r["request_id"]: r for r in got}
    assert len(by_id) == total
    kinds = {d["rid"]: d for d in done}
    assert set(by_id) == set(kinds)
    sim_by_id = {}
    for req in sim.requests:
        rid = dict(req.headers)[b"x-request-id"].decode()
        assert rid not in sim_by_id
        sim_by_id[rid] = req
    assert set(sim_by_id) == set(by_id)  # every request reached the simulator once

    exact = [r for r in got if r["tokens_source"] == "exact"]
    exact_ids = {r["request_id"] for r in exact}
    finished = ("stream", "usage", "plain")
    assert exact_ids == {rid for rid, d in kinds.items() if d["kind"] in finished}
    assert sum(r["completion_tokens"] for r in exact) == sum(
        sim_by_id[rid].completion_tokens for rid in exact_ids
    )
    assert sum(r["completion_tokens"] for r in exact) == sum(
        sim_by_id[rid].tokens_sent for rid in exact_ids
    )
    for rid, d in kinds.items():
        row, sreq = by_id[rid], sim_by_id[rid]
        if d["kind"] in ("stream", "usage", "plain"):
            assert (row["ok"], row["completion_tokens"], row["error_code"]) == (1, d["read"], None)
        elif d["kind"] == "gone":
            assert (row["ok"], row["client_closed"], row["error_code"]) == (0, 1, "client_closed")
            assert d["read"] <= row["completion_tokens"] <= sreq.tokens_sent
            assert row["tokens_source"] == "approx"
        elif d["kind"] == "stall":
            assert (row["ok"], row["error_code"], row["completion_tokens"]) == (
                0,
                "stream_stall_idle",
                d["read"],
            )
        else:
            assert (row["ok"], row["error_code"], row["completion_tokens"]) == (
                0,
                "upstream_dropped",
                d["read"],
            )
        if d["kind"] != "gone":
            assert row["client_closed"] == 0

    snap = (await httpc.fetch(app.port, "GET", "/api/slots/metrics")).json()["llm"]
    assert snap["requests_total"] == total
    assert snap["requests_failed"] == sum(1 for r in got if not r["ok"])
    assert snap["tokens_total"] == sum(r["completion_tokens"] or 0 for r in got)
    assert snap["stall_trips"]["idle"] == sum(1 for d in done if d["kind"] == "stall")

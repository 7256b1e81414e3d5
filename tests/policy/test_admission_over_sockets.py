"""Admission over real sockets (issue 10): ambiguous framing refused and closed, the key checked
on the head before any body byte, the relay-wide body memory bound, deep JSON, token limits the
upstream really honours, slot paths matched as the upstream routes them, bounded echoes."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from relay.config import UpstreamConfig
from tests.support import httpc
from tests.support.helpers import rows_of, wait_for
from tests.support.keys import bearer, key

CHAT = "/v1/chat/completions"
HEAD_TIMEOUT = 3.0


async def read_all(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send `data`, then read until the relay closes (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def responses(raw: bytes) -> list[tuple[int, bytes, bytes]]:
    """(status, head, body) of every Content-Length-framed response in `raw`."""
    out = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, raw[:200]
        lines = head.split(b"\r\n")
        fields = {
            k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])
        }
        assert not (b"content-length" in fields and b"transfer-encoding" in fields)
        n = int(fields[b"content-length"])
        out.append((int(lines[0].split(b" ")[1]), head, rest[:n]))
        raw = rest[n:]
    return out


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


SMUGGLED = httpc.build_request("POST", CHAT, httpc.chat(2, stream=False))
BODY = json.dumps(httpc.chat(2, stream=False)).encode()


def head(*lines: bytes, http: bytes = b"1.1") -> bytes:
    return (
        b"\r\n".join(
            [
                b"POST " + CHAT.encode() + b" HTTP/" + http,
                b"Host: relay.test",
                b"Content-Type: application/json",
                *lines,
            ]
        )
        + b"\r\n\r\n"
    )


@pytest.mark.parametrize(
    "data,status,code",
    [
        # CL + TE: read as chunked, the bytes after the body were a second request
        (
            head(b"Content-Length: %d" % len(chunked(BODY)), b"Transfer-Encoding: chunked")
            + chunked(BODY)
            + SMUGGLED,
            400,
            "bad_request",
        ),
        (
            head(b"Transfer-Encoding: chunked", b"Content-Length: 4") + chunked(BODY) + SMUGGLED,
            400,
            "bad_request",
        ),
        # obs-folded TE (h11 joins the lines and reads chunked)
        (head(b"Transfer-Encoding:", b" chunked") + chunked(BODY) + SMUGGLED, 400, "bad_request"),
        (
            head(b"Content-Length: %d" % len(chunked(BODY)), b"Transfer-Encoding:", b"\tchunked")
            + chunked(BODY)
            + SMUGGLED,
            400,
            "bad_request",
        ),
        (
            head(b"X-Note: a", b" b", b"Content-Length: %d" % len(BODY)) + BODY + SMUGGLED,
            400,
            "bad_request",
        ),
        # HTTP/1.0 has no transfer codings
        (
            head(b"Transfer-Encoding: chunked", http=b"1.0") + chunked(BODY) + SMUGGLED,
            400,
            "bad_request",
        ),
        # codings the relay cannot decode
        (
            head(b"Transfer-Encoding: gzip, chunked") + chunked(BODY) + SMUGGLED,
            501,
            "not_implemented",
        ),
        (
            head(b"Transfer-Encoding: chunked, identity") + chunked(BODY) + SMUGGLED,
            501,
            "not_implemented",
        ),
        (
            head(b"Content-Length: 5", b"Content-Length: 6") + b"12345" + SMUGGLED,
            400,
            "bad_request",
        ),
    ],
)
async def test_ambiguous_framing_is_refused_and_the_connection_closed(
    make_relay, sim, data, status, code
):
    app = await make_relay()
    got = responses(await read_all(app.port, data))
    assert [s for s, _, _ in got] == [status]  # one answer, then the relay closed
    _st, rhead, body = got[0]
    assert b"Connection: close" in rhead
    assert json.loads(body)["error"]["code"] == code
    assert sim.requests == []  # nothing of it reached the upstream


async def test_well_framed_chunked_request_still_served_with_pipelining(make_relay, sim):
    app = await make_relay()
    data = head(b"Transfer-Encoding: chunked") + chunked(BODY) + SMUGGLED
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    try:
        writer.write(data)
        for _ in range(2):
            resp = await asyncio.wait_for(httpc.read_head(reader), 5)
            await asyncio.wait_for(httpc.read_body(reader, resp), 5)
            assert resp.status == 200
    finally:
        writer.close()
    assert len(sim.requests) == 2


async def test_json_nested_5000_deep_is_invalid_json_not_a_relay_error(make_relay, sim):
    app = await make_relay()
    body = b'{"model":"tiny","messages":' + b"[" * 5000 + b"]" * 5000 + b"}"
    resp = await httpc.fetch(app.port, "POST", CHAT, body)
    assert resp.status == 400
    assert resp.json()["error"]["code"] == "invalid_json"
    assert "nested too deeply" in resp.json()["error"]["message"]
    assert app.log.of("internal_error") == [] and sim.requests == []


# ---- the key is checked on the head -------------------------------------------------------
async def open_with_head(port: int, size: int, headers: list[str]) -> tuple:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [
        f"POST {CHAT} HTTP/1.1",
        "Host: relay.test",
        "Content-Type: application/json",
        f"Content-Length: {size}",
        *headers,
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    return reader, writer


@pytest.mark.parametrize("expect", [False, True])
async def test_401_comes_before_the_body_is_sent_and_no_100_continue(make_relay, sim, expect):
    app = await make_relay(keys=[key()])
    size = 7 * 1024 * 1024
    reader, writer = await open_with_head(
        app.port, size, ["Expect: 100-continue"] if expect else []
    )
    try:
        resp = await asyncio.wait_for(httpc.read_head(reader), HEAD_TIMEOUT)  # no body sent
        assert resp.status == 401 and resp.header("connection") == "close"
        await asyncio.wait_for(httpc.read_body(reader, resp), HEAD_TIMEOUT)
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert await asyncio.wait_for(reader.read(), HEAD_TIMEOUT) == b""  # then closed
    finally:
        writer.close()
    assert app.bodies.held == 0 and sim.requests == []
    row = (await rows_of(app, 1))[0]
    assert (row["status"], row["error_code"], row["path"]) == (401, "invalid_api_key", CHAT)


async def test_an_authenticated_expect_100_continue_gets_its_100(make_relay, sim):
    app = await make_relay(keys=[key()])
    auth = f"Authorization: {bearer()['Authorization']}"
    reader, writer = await open_with_head(app.port, len(BODY), ["Expect: 100-continue", auth])
    try:
        line = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        assert line.startswith(b"HTTP/1.1 100 ")
        writer.write(BODY)
        resp = await asyncio.wait_for(httpc.read_head(reader), HEAD_TIMEOUT)
        await asyncio.wait_for(httpc.read_body(reader, resp), HEAD_TIMEOUT)
        assert resp.status == 200
    finally:
        writer.close()


async def test_bodies_held_relay_wide_are_bounded_503_and_given_back(make_relay, sim):
    app = await make_relay(max_buffered_body_bytes=64 * 1024)
    pad = "x" * (48 * 1024)
    big = json.dumps({**httpc.chat(2, stream=False), "pad": pad}).encode()
    ra, wa = await open_with_head(app.port, len(big), [])
    try:
        wa.write(big[: 40 * 1024])  # A holds 40 KiB, body not complete
        await wait_for(lambda: app.bodies.held == 40 * 1024)
        # B declares more than is left: refused on its head, before its body is read
        rb, wb = await open_with_head(app.port, 32 * 1024, [])
        resp = await asyncio.wait_for(httpc.read_head(rb), HEAD_TIMEOUT)
        await asyncio.wait_for(httpc.read_body(rb, resp), HEAD_TIMEOUT)
        wb.close()
        assert resp.status == 503 and resp.header("retry-after") == "1"
        assert resp.json()["error"]["code"] == "server_busy"
        # C sends chunked (no size known up front): refused once its bytes reach the bound
        rc, wc = await asyncio.open_connection("127.0.0.1", app.port)
        wc.write(
            head(b"Transfer-Encoding: chunked")
            + b"%x\r\n" % (30 * 1024)
            + b"y" * (30 * 1024)
            + b"\r\n"
        )
        resp = await asyncio.wait_for(httpc.read_head(rc), HEAD_TIMEOUT)
        wc.close()
        assert resp.status == 503
        assert app.bodies.held == 40 * 1024
        wa.write(big[40 * 1024 :])  # A completes and is served
        resp = await asyncio.wait_for(httpc.read_head(ra), HEAD_TIMEOUT)
        await asyncio.wait_for(httpc.read_body(ra, resp), HEAD_TIMEOUT)
        assert resp.status == 200
    finally:
        wa.close()
    await wait_for(lambda: app.bodies.held == 0)
    # a client leaving mid-body gives its bytes back too
    _rd, wd = await open_with_head(app.port, len(big), [])
    wd.write(big[:20000])
    await wait_for(lambda: app.bodies.held == 20000)
    wd.close()
    await wait_for(lambda: app.bodies.held == 0)


# ---- token limits the upstream honours ------------------------------------------------------
def gen(n: int) -> dict:
    """A streamed chat the simulator would answer with n tokens unless a limit stops it."""
    body = httpc.chat(None, stream=True)
    body["sim"] = {"tokens": n}
    return body


async def charged(app, n: int) -> int:
    await rows_of(app, n)
    return app.budgets.usage("alpha", time.time())["daily"]["tokens"]


async def test_unbounded_max_tokens_is_capped_in_what_the_upstream_reads(make_relay, sim):
    app = await make_relay(keys=[key(tokens_per_day=3000)])
    statuses = []
    for _ in range(4):  # -1: llama-server generates without end; the sim stands for 5000
        body = {**gen(5000), "max_tokens": -1}
        resp = await httpc.fetch(app.port, "POST", CHAT, body, headers=bearer())
        statuses.append(resp.status)
    assert statuses == [200, 200, 429, 429]
    cap = app.config.budget.default_max_tokens
    assert [r.completion_tokens for r in sim.requests] == [cap, cap]
    assert all(r.json["max_tokens"] == cap and "n_predict" not in r.json for r in sim.requests)
    assert await charged(app, 4) <= 3000


async def test_the_largest_limit_field_is_reserved(make_relay, sim):
    app = await make_relay(keys=[key(tokens_per_day=4000)])
    statuses = []
    for _ in range(2):  # llama-server reads n_predict before max_tokens
        body = {**gen(5000), "max_tokens": 1, "n_predict": 3000}
        resp = await httpc.fetch(app.port, "POST", CHAT, body, headers=bearer())
        statuses.append(resp.status)
    assert statuses == [200, 429]
    assert [r.completion_tokens for r in sim.requests] == [3000]
    assert await charged(app, 2) <= 4000


async def test_the_body_is_peeked_whatever_the_content_type(make_relay, sim):
    app = await make_relay(keys=[key(tokens_per_day=2000)])
    hdrs = {**bearer(), "Content-Type": "text/plain"}
    body = {**gen(5000), "max_tokens": 3000}
    resp = await httpc.fetch(app.port, "POST", CHAT, body, headers=hdrs)
    assert resp.status == 429 and resp.json()["error"]["code"] == "budget_exceeded"
    for bad in (b"hello", b"[1, 2]", b"", b'"text"'):
        resp = await httpc.fetch(app.port, "POST", CHAT, bad, headers=hdrs)
        assert (resp.status, resp.json()["error"]["code"]) == (400, "invalid_json"), bad
    assert sim.requests == []
    assert await charged(app, 5) == 0


# ---- paths as the upstream routes them ----------------------------------------------------
async def test_percent_encoded_slot_path_takes_a_slot(make_relay, sim):
    app = await make_relay(parallel=1, queue=0, pool_timeout_s=0.0)
    body = httpc.chat(2, first_token_delay_ms=300)
    results = await asyncio.gather(
        *(httpc.fetch(app.port, "POST", "/v1/chat/%63ompletions", body) for _ in range(4))
    )
    assert sorted(r.status for r in results) == [200, 503, 503, 503]
    rows = await rows_of(app, 4)
    assert {r["path"] for r in rows} == {CHAT}


# ---- echoes of client text are bounded ----------------------------------------------------
async def test_a_huge_model_name_is_bounded_in_answer_row_and_log(make_relay, sim):
    app = await make_relay(upstreams=[UpstreamConfig(name="llm", url=sim.url, models=["tiny"])])
    body = {**httpc.chat(2, stream=False), "model": "m" * (4 * 1024 * 1024)}
    resp = await httpc.fetch(app.port, "POST", CHAT, body)
    assert resp.status == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert len(resp.body) < 2048
    row = (await rows_of(app, 1))[0]
    assert len(row["model"]) < 300
    line = app.log.of("access")[0]
    assert len(json.dumps(line)) < 2048


async def test_a_long_path_is_bounded_in_the_row_and_the_error(make_relay, sim):
    app = await make_relay()
    resp = await httpc.fetch(app.port, "GET", "/v1/" + "a" * 12000)
    assert resp.status == 404  # the simulator's own 404, passed through
    resp = await httpc.fetch(app.port, "GET", "/api/" + "b" * 12000)
    assert resp.status == 404 and resp.json()["error"]["code"] == "not_found"
    assert len(resp.body) < 2600
    rows = await rows_of(app, 2)
    assert [len(r["path"]) < 2100 for r in rows] == [True, True]
    assert rows[1]["path"].startswith("/api/bbb")


async def test_body_bytes_are_given_back_when_the_client_leaves_mid_request(make_relay, sim):
    """Whichever way the client leaves, the relay-wide bound gets back exactly the bytes its
    body took: halfway through sending the body, while at the upstream, while queued for a
    slot."""
    app = await make_relay(parallel=1, queue=4)
    bodies, slots = app.bodies, app.upstreams["llm"].slots

    def request(marker: str) -> tuple[bytes, int]:
        body = httpc.chat(2, first_token_delay_ms=5000)  # in flight until the client leaves
        body["messages"][0]["content"] = marker  # (tells the requests apart at the upstream)
        return httpc.build_request("POST", CHAT, body), len(json.dumps(body).encode())

    async def send(data: bytes):
        _reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
        writer.write(data)
        return writer

    def at_upstream(marker: str) -> bool:
        return any(r.json["messages"][0]["content"] == marker for r in sim.requests)

    # 1. gone with half of its body sent: nothing dispatched yet
    data, size = request("half")
    writer = await send(data[: len(data) - size // 2])
    await wait_for(lambda: bodies.held == size - size // 2)
    writer.transport.abort()
    await wait_for(lambda: bodies.held == 0)
    # 2. gone while the upstream works on it
    data, first = request("served")
    served = await send(data)
    await wait_for(lambda: at_upstream("served"))
    assert bodies.held == first and slots.in_flight == 1
    # 3. gone while queued for the slot the second one holds
    data, size = request("queued")
    writer = await send(data)
    await wait_for(lambda: slots.queued == 1)
    assert bodies.held == first + size
    writer.transport.abort()
    await wait_for(lambda: bodies.held == first)  # its own bytes back, the served one's kept
    assert slots.queued == 0 and not at_upstream("queued")
    served.transport.abort()
    await wait_for(lambda: bodies.held == 0)
    await wait_for(lambda: slots.in_flight == 0)
    assert [r.json["messages"][0]["content"] for r in sim.requests] == ["served"]


# ---- limits the upstream honours, per path (issue 10 item 7) ------------------------------
async def test_a_limit_field_the_path_ignores_is_no_limit(make_relay, sim):
    # llama-server ignores max_output_tokens on chat/completions (it generates to the context
    # size): the request is unbounded, so it is capped in the field the path reads
    app = await make_relay(keys=[key(tokens_per_day=3000)])
    statuses = []
    for _ in range(4):
        body = {**gen(5000), "max_output_tokens": 5}
        resp = await httpc.fetch(app.port, "POST", CHAT, body, headers=bearer())
        statuses.append(resp.status)
    cap = app.config.budget.default_max_tokens
    assert statuses == [200, 200, 429, 429]
    assert [r.completion_tokens for r in sim.requests] == [cap, cap]
    assert all(
        r.json["max_tokens"] == cap and r.json["max_output_tokens"] == 5 for r in sim.requests
    )
    assert await charged(app, 4) <= 3000
    # the native /completion knows no max_completion_tokens
    app = await make_relay(keys=[key(tokens_per_day=3000)])
    sim.requests.clear()
    body = {"prompt": "Hi", "max_completion_tokens": 5, "stream": True, "sim": {"tokens": 5000}}
    resp = await httpc.fetch(app.port, "POST", "/completion", body, headers=bearer())
    assert resp.status == 200
    assert sim.requests[0].json["n_predict"] == cap and sim.requests[0].completion_tokens == cap
    assert await charged(app, 1) <= 3000


# ---- every generating route takes a slot and a reservation (issue 10 item 8) ---------------
def slow_sse(hold_s: float, events: int = 3):
    """An upstream answering every request with a stream of `events` content events."""

    async def script(upstream, index, reader, writer):
        while await upstream.read_request(reader) is not None:
            await asyncio.sleep(hold_s)
            out = b"".join(
                b'data: {"type":"content_block_delta","delta":{"text":"x%d"}}\n\n' % i
                for i in range(events)
            )
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(out), out)
            )
            await writer.drain()

    return script


@pytest.mark.parametrize(
    "path,field",
    [
        ("/v1/messages", "max_tokens"),
        ("/responses", "max_output_tokens"),
        ("/v1/responses", "max_output_tokens"),
        ("/v1/rerank", None),
        ("/some/future/route", None),
    ],
)
async def test_every_generating_route_takes_a_slot_and_is_capped(make_relay, path, field):
    from tests.support.fakeup import Scripted

    up = await Scripted(slow_sse(0.3)).start()
    try:
        app = await make_relay(
            url=up.url, keys=[key(tokens_per_day=50000)], parallel=1, queue=0, pool_timeout_s=0.0
        )
        seen = []

        async def watch():
            while True:
                seen.append(app.upstreams["llm"].slots.in_flight)
                await asyncio.sleep(0.005)

        w = asyncio.create_task(watch())
        body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        rs = await asyncio.gather(
            *(httpc.fetch(app.port, "POST", path, body, headers=bearer()) for _ in range(3))
        )
        w.cancel()
        assert sorted(r.status for r in rs) == [200, 503, 503]
        assert max(seen) == 1 and len(up.bodies) == 1
        cap = app.config.budget.default_max_tokens
        sent = json.loads(up.bodies[0])
        if field is not None:  # the cap is written in the field this API reads
            assert sent[field] == cap and set(sent) - set(body) == {field}
        else:
            assert sent == body
        rows = await rows_of(app, 3)
        assert [r["tokens_source"] for r in rows if r["status"] == 200] == ["approx"]
        assert app.upstreams["llm"].slots.in_flight == 0
    finally:
        await up.stop()


async def test_cheap_routes_take_no_slot(make_relay, sim):
    app = await make_relay(parallel=1, queue=0, pool_timeout_s=0.0)
    long = httpc.chat(2, first_token_delay_ms=400)
    first = asyncio.create_task(httpc.fetch(app.port, "POST", CHAT, long))
    await wait_for(lambda: app.upstreams["llm"].slots.in_flight == 1)
    resp = await httpc.fetch(app.port, "POST", "/tokenize", {"content": "hi"})
    assert resp.status == 200
    assert (await first).status == 200


# ---- multi-prompt and n (issue 10 item 7) -------------------------------------------------
def multi_stream(per: int):
    """llama-server's way with `"prompt": [p1 .. pN]`: `per` tokens for each prompt, and a
    final usage that covers one completion only."""

    async def script(upstream, index, reader, writer):
        while await upstream.read_request(reader) is not None:
            doc = json.loads(upstream.bodies[-1])
            p = doc["prompt"]
            prompts = p if isinstance(p, list) and not all(isinstance(x, int) for x in p) else [p]
            n = len(prompts) * max(1, doc.get("n", 1))
            out = b"".join(
                b'data: {"choices":[{"text":"t","index":%d}]}\n\n' % (i % n) for i in range(per * n)
            )
            out += (
                b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}'
                b"\n\ndata: [DONE]\n\n" % per
            )
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(out), out)
            )
            await writer.drain()

    return script


async def test_multi_prompt_and_n_are_reserved_and_charged_in_full(make_relay):
    from tests.support.fakeup import Scripted

    up = await Scripted(multi_stream(100)).start()
    try:
        app = await make_relay(url=up.url, keys=[key(tokens_per_day=1000)])
        four = {"model": "x", "prompt": ["a", "b", "c", "d"], "max_tokens": 100, "stream": True}
        resp = await httpc.fetch(app.port, "POST", "/v1/completions", four, headers=bearer())
        assert resp.status == 200
        [row] = await rows_of(app, 1)
        assert row["completion_tokens"] == 400  # not the 100 of the final usage
        # 3 prompts x n=2 x 100: 600 more than the 1000 left -> refused before the upstream
        six = {**four, "prompt": ["a", "b", "c"], "n": 2}
        resp = await httpc.fetch(app.port, "POST", "/v1/completions", six, headers=bearer())
        assert resp.status == 429
        # a flat list of token ids is one prompt
        ids = {**four, "prompt": [1, 2, 3, 4]}
        resp = await httpc.fetch(app.port, "POST", "/v1/completions", ids, headers=bearer())
        assert resp.status == 200
        assert len(up.bodies) == 2
        assert await charged(app, 3) <= 1000
        rows = await rows_of(app, 3)
        assert [r["completion_tokens"] for r in rows] == [400, None, 100]
    finally:
        await up.stop()


def json_answers(doc: bytes):
    """A Scripted upstream script answering every request 200 with the JSON `doc`."""

    async def script(upstream, index, reader, writer):
        while await upstream.read_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(doc) + doc
            )
            await writer.drain()

    return script


async def test_a_non_streamed_answer_to_several_prompts_is_charged_its_reservation(make_relay):
    from tests.support.fakeup import Scripted

    # llama-server's /v1/completions: N choices, a usage that counts one completion only
    doc = json.dumps(
        {
            "choices": [{"text": "t" * 100, "index": i} for i in range(4)],
            "usage": {"prompt_tokens": 3, "completion_tokens": 100},
        }
    ).encode()

    up = await Scripted(json_answers(doc)).start()
    try:
        app = await make_relay(url=up.url, keys=[key(tokens_per_day=1000)])
        four = {"model": "x", "prompt": ["a", "b", "c", "d"], "max_tokens": 100, "stream": False}
        statuses = []
        for _ in range(3):
            resp = await httpc.fetch(app.port, "POST", "/v1/completions", four, headers=bearer())
            statuses.append(resp.status)
        assert statuses == [200, 200, 429]
        rows = await rows_of(app, 3)
        est = len(json.dumps(four)) // 4
        assert [(r["completion_tokens"], r["tokens_source"]) for r in rows[:2]] == [
            (400, "reserved")
        ] * 2
        assert await charged(app, 3) == 2 * (est + 400) <= 1000
    finally:
        await up.stop()


# ---- no usable token figure: the reservation is charged (issue 10 item 7) -----------------
async def test_a_served_body_without_a_usable_figure_is_charged_its_reservation(make_relay):
    from tests.support.fakeup import Scripted

    pad = "x" * (1536 * 1024)  # more than the relay keeps of a JSON body
    doc = json.dumps(
        {
            "choices": [{"message": {"content": pad}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 700},
        }
    ).encode()

    up = await Scripted(json_answers(doc)).start()
    try:
        app = await make_relay(url=up.url, keys=[key(tokens_per_day=2000)])
        body = httpc.chat(800, stream=False)
        statuses = []
        for _ in range(3):
            resp = await httpc.fetch(app.port, "POST", CHAT, body, headers=bearer())
            statuses.append(resp.status)
        assert statuses == [200, 200, 429]
        rows = await rows_of(app, 3)
        prompt_est = len(json.dumps(body)) // 4
        assert [
            (r["prompt_tokens"], r["completion_tokens"], r["tokens_source"]) for r in rows[:2]
        ] == [(prompt_est, 800, "reserved")] * 2
        assert await charged(app, 3) == 2 * (prompt_est + 800) <= 2000
    finally:
        await up.stop()


# ---- the cap is spliced in, the body otherwise untouched (issue 10 item 5) ----------------
async def test_the_cap_is_spliced_into_the_body_bytes(make_relay, sim):
    app = await make_relay(keys=[key(tokens_per_day=100000)])
    raw = b'{"model":"m", "prompt": "}{\\"}", "stream": true, "a": {"b": {}}}\r\n  '
    resp = await httpc.fetch(
        app.port,
        "POST",
        "/completion",
        raw,
        headers={**bearer(), "Content-Type": "application/json"},
    )
    assert resp.status == 200
    cap = app.config.budget.default_max_tokens
    assert sim.requests[0].body == raw.rstrip()[:-1] + b',"n_predict":%d}\r\n  ' % cap
    assert await charged(app, 1) <= 100000

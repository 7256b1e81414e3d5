"""Dispatch over real sockets: routing by model, slots held until the client drains, the FIFO
queue and its 503s, release on every exit path, upstream states, pass-through endpoints."""

from __future__ import annotations

import asyncio
import socket

import pytest

from relay.config import UpstreamConfig
from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.helpers import (
    closed_port,
    error_of,
    release,
    rows,
    slots_metrics,
    wait_for,
)
from tests.support.sockets import slow_client

CHAT = "/v1/chat/completions"


async def until_state(app, name: str, state: str, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while (await slots_metrics(app))[name]["state"] != state:
        assert loop.time() < end, f"upstream {name} never became {state}"
        await asyncio.sleep(0.02)


def content_of(resp) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in resp.data_events()
        if isinstance(e, dict) and e["choices"]
    )


class Held:
    """A streamed request kept open on its own connection (the sim stalls after one token),
    holding its slot until `release()` closes the client."""

    def __init__(self, reader, writer, resp) -> None:
        self.reader, self.writer, self.resp = reader, writer, resp

    @classmethod
    async def open(cls, port: int, tokens: int = 9, **knobs) -> Held:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(httpc.build_request("POST", CHAT, httpc.chat(tokens, stall_after=1, **knobs)))
        resp = await asyncio.wait_for(httpc.read_head(reader), 5)
        assert resp.status == 200
        return cls(reader, writer, resp)

    def release(self) -> None:
        self.writer.transport.abort()


# ---- routing -------------------------------------------------------------------------------
def two_upstreams(sim, sim_b, catch_all: bool = False) -> list[UpstreamConfig]:
    ups = [
        UpstreamConfig(name="a", url=sim.url, models=["alpha", "alpha-2"], aliases=["al"]),
        UpstreamConfig(name="b", url=sim_b.url, models=["beta"], aliases=["be", "alpha"]),
    ]
    if catch_all:
        ups.append(UpstreamConfig(name="c", url=sim_b.url))
    return ups


async def test_model_picks_the_upstream_exact_then_alias_then_first(make_relay, sim, sim_b):
    app = await make_relay(upstreams=two_upstreams(sim, sim_b))
    # (model, tokens to tell the requests apart, upstream expected)
    cases = [
        ("alpha", 1, "a"),
        ("beta", 2, "b"),
        ("alpha-2", 3, "a"),
        ("al", 4, "a"),
        ("be", 5, "b"),
        (None, 6, "a"),
    ]
    for model, tokens, _ in cases:
        body = httpc.chat(tokens, stream=False, model=model)
        if model is None:
            del body["model"]
        resp = await httpc.fetch(app.port, "POST", CHAT, body)
        assert resp.status == 200
        assert resp.json()["choices"][0]["message"]["content"] == httpc.sim_text(tokens)
    # "alpha" is also an alias on b: the exact name wins
    assert [r.json["max_tokens"] for r in sim.requests] == [1, 3, 4, 6]
    assert [r.json["max_tokens"] for r in sim_b.requests] == [2, 5]
    assert [r.json.get("model") for r in sim.requests] == ["alpha", "alpha-2", "al", None]
    got = rows(app)
    assert [
        (r["model"], r["upstream_requested"], r["upstream_served"], r["status"], r["ok"])
        for r in got
    ] == [(m, u, u, 200, 1) for m, _, u in cases]


async def test_unknown_model_is_404_model_not_found(make_relay, sim, sim_b):
    app = await make_relay(upstreams=two_upstreams(sim, sim_b))
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3, model="gamma"))
    assert resp.status == 404
    err = error_of(resp)
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    assert err["details"] == {"model": "gamma"}
    assert "gamma" in err["message"]
    assert sim.requests == [] and sim_b.requests == []
    [row] = rows(app)
    assert (
        row["status"],
        row["ok"],
        row["error_code"],
        row["model"],
        row["upstream_requested"],
        row["upstream_served"],
    ) == (404, 0, "model_not_found", "gamma", None, None)


async def test_catch_all_takes_unknown_models_but_not_listed_ones(make_relay, sim, sim_b):
    ups = two_upstreams(sim, sim_b, catch_all=True)
    app = await make_relay(upstreams=[ups[2], ups[0], ups[1]])  # catch-all listed first
    for model, tokens in [("gamma", 1), ("alpha", 2), ("be", 3), (None, 4)]:
        body = httpc.chat(tokens, stream=False, model=model)
        if model is None:
            del body["model"]
        assert (await httpc.fetch(app.port, "POST", CHAT, body)).status == 200
    assert [r.json["max_tokens"] for r in sim.requests] == [2]
    assert [r.json["max_tokens"] for r in sim_b.requests] == [1, 3, 4]
    assert [r["upstream_served"] for r in rows(app)] == ["c", "a", "b", "c"]


async def test_v1_models_lists_configured_models(make_relay, sim, sim_b):
    app = await make_relay(upstreams=two_upstreams(sim, sim_b))
    resp = await httpc.fetch(app.port, "GET", "/v1/models")
    assert resp.status == 200 and resp.header("content-type") == "application/json"
    assert resp.json() == {
        "object": "list",
        "data": [
            {"id": "alpha", "object": "model", "created": 0, "owned_by": "a"},
            {"id": "alpha-2", "object": "model", "created": 0, "owned_by": "a"},
            {"id": "beta", "object": "model", "created": 0, "owned_by": "b"},
            # every public name: the aliases too (one shadowed by an exact name is that name)
            {"id": "al", "object": "model", "created": 0, "owned_by": "a"},
            {"id": "be", "object": "model", "created": 0, "owned_by": "b"},
        ],
    }
    assert sim.requests == [] and sim_b.requests == []


# ---- slot held until the client drained -------------------------------------------------------


@pytest.mark.parametrize("stream, tokens", [(False, 14000), (True, 250)])
async def test_slot_is_held_until_the_client_drains(make_relay, sim, stream, tokens):
    app = await make_relay(parallel=1)
    up = app.upstreams["llm"]
    loop = asyncio.get_running_loop()
    sock, conn, head = await slow_client(app, httpc.chat(tokens, stream=stream))
    assert head.status == 200
    first = sim.requests[0]
    await wait_for(lambda: first.finished)  # the upstream sent everything
    await wait_for(lambda: conn.exchange is None)  # ...and the relay has read it all
    assert conn.transport.get_write_buffer_size() > 0  # but the client has not read it
    assert up.slots.in_flight == 1
    assert (await slots_metrics(app))["llm"]["in_flight"] == 1

    second = asyncio.create_task(httpc.fetch(app.port, "POST", CHAT, httpc.chat(3)))
    await wait_for(lambda: up.slots.queued == 1)
    queued_at = loop.time()
    assert len(sim.requests) == 1 and up.slots.in_flight == 1

    drain_at = loop.time()
    reader, writer = await asyncio.open_connection(sock=sock)
    await httpc.read_body(reader, head)
    writer.close()
    assert head.complete
    if stream:
        assert content_of(head) == httpc.sim_text(tokens)
    else:
        assert head.json()["choices"][0]["message"]["content"] == httpc.sim_text(tokens)

    resp = await asyncio.wait_for(second, 5)
    assert resp.status == 200 and content_of(resp) == httpc.sim_text(3)
    assert len(sim.requests) == 2
    assert sim.requests[1].started_at >= drain_at  # reached upstream only after the drain
    await wait_for(lambda: up.slots.in_flight == 0)
    r1, r2 = rows(app)
    assert r1["queue_ms"] < r2["queue_ms"]
    assert r2["queue_ms"] >= (drain_at - queued_at) * 1000
    assert r1["ok"] == 1 and r1["bytes_out"] == len(head.raw_body)


# ---- the queue -----------------------------------------------------------------------------
async def test_queued_requests_are_served_first_come_first_served(make_relay, sim):
    app = await make_relay(parallel=1, queue=3)
    up = app.upstreams["llm"]
    holder = await Held.open(app.port, tokens=10)
    done: list[int] = []

    async def one(tokens: int):
        resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(tokens, interval_ms=2))
        done.append(tokens)
        return resp

    tasks = []
    for k, tokens in enumerate([4, 7, 5], start=1):
        tasks.append(asyncio.create_task(one(tokens)))
        await wait_for(lambda k=k: up.slots.queued == k)
    assert up.slots.in_flight == 1 and len(sim.requests) == 1
    assert (await slots_metrics(app))["llm"]["queued"] == 3
    holder.release()
    responses = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert done == [4, 7, 5]
    assert [r.json["max_tokens"] for r in sim.requests] == [10, 4, 7, 5]
    assert [content_of(r) for r in responses] == [httpc.sim_text(n) for n in (4, 7, 5)]
    await wait_for(lambda: up.slots.in_flight == 0)
    got = rows(app)
    assert [r["error_code"] for r in got] == ["client_closed", None, None, None]
    assert all(r["queue_ms"] > 0 for r in got[1:])
    # each was granted the slot when the previous one settled: the grants are in order
    granted = [r["ts"] + r["queue_ms"] / 1000 for r in got[1:]]
    assert granted == sorted(granted)


async def test_queue_full_is_503_upstream_busy_with_retry_after(make_relay, sim):
    app = await make_relay(parallel=1, queue=1, pool_timeout_s=5.0)
    up = app.upstreams["llm"]
    holder = await Held.open(app.port)
    waiting = asyncio.create_task(httpc.fetch(app.port, "POST", CHAT, httpc.chat(2)))
    await wait_for(lambda: up.slots.queued == 1)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
    assert loop.time() - t0 < 1.0  # refused at once, not after pool_timeout_s
    assert resp.status == 503
    assert resp.header("retry-after") == "5"
    err = error_of(resp)
    assert err["code"] == "upstream_busy" and err["type"] == "server_error"
    assert err["details"] == {"upstream": "llm"}
    assert len(sim.requests) == 1 and up.slots.queued == 1
    holder.release()
    assert (await asyncio.wait_for(waiting, 5)).status == 200
    await wait_for(lambda: up.slots.in_flight == 0)
    busy = rows(app, "WHERE status = 503")
    assert [
        (r["error_code"], r["ok"], r["upstream_requested"], r["upstream_served"]) for r in busy
    ] == [("upstream_busy", 0, "llm", None)]


async def test_pool_timeout_is_503_after_the_wait(make_relay, sim):
    app = await make_relay(parallel=1, queue=4, pool_timeout_s=0.2)
    up = app.upstreams["llm"]
    holder = await Held.open(app.port)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
    waited = loop.time() - t0
    assert resp.status == 503 and 0.19 <= waited < 1.5
    assert resp.header("retry-after") == "1"
    assert error_of(resp)["code"] == "upstream_busy"
    assert up.slots.queued == 0 and up.slots.in_flight == 1 and len(sim.requests) == 1
    holder.release()
    await wait_for(lambda: up.slots.in_flight == 0)
    [row] = rows(app, "WHERE status = 503")
    # (asyncio timers may fire up to a clock tick early: 190, not 200)
    assert row["error_code"] == "upstream_busy" and 190 <= row["queue_ms"] < 1500


# ---- the slot comes back on every exit path, exactly once ------------------------------------
async def _client_gone(app, sim):
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("POST", CHAT, httpc.chat(20, stall_after=2)))
    await asyncio.wait_for(reader.readuntil(b'"content":" from"'), 5)
    writer.transport.abort()
    return "client_closed"


async def _gone_before_head(app, sim):
    _reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("POST", CHAT, httpc.chat(5, head_delay_ms=3000)))
    await wait_for(lambda: len(sim.requests) == 2)
    writer.transport.abort()
    await asyncio.wait_for(sim.requests[-1].closed.wait(), 2)
    return "client_closed"


async def _stall(app, sim):
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(20, stall_after=2))
    assert resp.status == 200 and resp.complete and b"relay-stall-guard" in resp.body
    return "stream_stall_idle"


async def _drop(app, sim):
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(20, drop_after=2))
    assert resp.status == 200 and not resp.complete
    return "upstream_dropped"


async def _status_500(app, sim):
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(5, status=500))
    assert resp.status == 500 and resp.json()["error"]["code"] == 500
    return "upstream_500"


async def _timeout_504(app, sim):
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(5, head_delay_ms=3000))
    assert resp.status == 504 and error_of(resp)["code"] == "upstream_timeout"
    return "upstream_timeout"


@pytest.mark.parametrize(
    "exit_path",
    [_client_gone, _gone_before_head, _stall, _drop, _status_500, _timeout_504],
    ids=["client_gone", "gone_before_head", "stall", "drop", "status_500", "timeout_504"],
)
async def test_slot_released_once_on_every_exit_path(make_relay, sim, exit_path):
    app = await make_relay(
        parallel=2, pool_timeout_s=0, stream_idle_timeout_s=0.2, direct_read_timeout_s=0.3
    )
    up = app.upstreams["llm"]
    # a long-lived holder: a double release on the exit path would free its slot too
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("POST", CHAT, httpc.chat(interval_ms=20, chatty=True)))
    head = await asyncio.wait_for(httpc.read_head(reader), 5)
    assert head.status == 200 and up.slots.in_flight == 1

    code = await exit_path(app, sim)
    await wait_for(lambda: len(rows(app)) == 1, timeout=5, step=0.02)
    assert up.slots.in_flight == 1 and up.slots.queued == 0
    assert rows(app)[0]["error_code"] == code

    # the freed slot is there at once (pool_timeout_s = 0: no waiting at all)
    again = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
    assert again.status == 200 and content_of(again) == httpc.sim_text(3)
    await wait_for(lambda: up.slots.in_flight == 1)
    writer.transport.abort()
    await wait_for(lambda: up.slots.in_flight == 0)
    await wait_for(lambda: len(rows(app)) == 3, timeout=5, step=0.02)
    assert up.slots.in_flight == 0
    assert (await slots_metrics(app))["llm"]["in_flight"] == 0


async def test_client_gone_while_queued_leaves_the_queue(make_relay, sim):
    app = await make_relay(parallel=1, queue=4)
    up = app.upstreams["llm"]
    holder = await Held.open(app.port)
    _reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("POST", CHAT, httpc.chat(3), {"X-Request-Id": "leaver"}))
    await wait_for(lambda: up.slots.queued == 1)
    behind = asyncio.create_task(httpc.fetch(app.port, "POST", CHAT, httpc.chat(4)))
    await wait_for(lambda: up.slots.queued == 2)
    writer.transport.abort()
    await wait_for(lambda: up.slots.queued == 1)
    assert up.slots.in_flight == 1
    holder.release()
    resp = await asyncio.wait_for(behind, 5)
    assert resp.status == 200 and content_of(resp) == httpc.sim_text(4)
    await wait_for(lambda: up.slots.in_flight == 0)
    assert [r.json["max_tokens"] for r in sim.requests] == [9, 4]  # the leaver never got there
    [row] = rows(app, "WHERE request_id = 'leaver'")
    assert (
        row["client_closed"],
        row["ok"],
        row["error_code"],
        row["status"],
        row["upstream_served"],
    ) == (1, 0, "client_closed", None, None)
    assert len(rows(app)) == 3


# ---- upstream state ------------------------------------------------------------------------
async def test_loading_state_from_the_health_probe(make_relay, sim):
    app = await make_relay(health_interval_s=0.05)
    await until_state(app, "llm", "ready")
    sim.loading = True
    await until_state(app, "llm", "loading")
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
    assert resp.status == 503 and resp.json()["error"]["message"] == "Loading model"
    sim.loading = False
    await until_state(app, "llm", "ready")
    assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))).status == 200


async def test_down_upstream_fails_fast_with_502_and_recovers(make_relay):
    port = closed_port()
    app = await make_relay(url=f"http://127.0.0.1:{port}", health_interval_s=0.05)
    await until_state(app, "llm", "down")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
    assert loop.time() - t0 < 0.5
    assert resp.status == 502
    err = error_of(resp)
    assert err["code"] == "upstream_unavailable" and err["type"] == "upstream_error"
    assert err["details"]["upstream"] == "llm"
    assert app.upstreams["llm"].slots.in_flight == 0
    [row] = rows(app)
    assert (row["status"], row["ok"], row["error_code"], row["upstream_served"]) == (
        502,
        0,
        "upstream_unavailable",
        None,
    )

    back = Simulator(port=release(port))
    await back.start()
    try:
        await until_state(app, "llm", "ready")
        resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(4))
        assert resp.status == 200 and content_of(resp) == httpc.sim_text(4)
    finally:
        await back.stop()


def unresponsive_listener() -> tuple[int, list[socket.socket]]:
    """A port whose accept queue is full: connects hang (SYNs dropped) instead of failing."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    held = [server]
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        held.append(c)
    return port, held


async def test_down_upstream_is_not_even_tried(make_relay):
    """Down by the probe: a request is refused at once, not after a connect timeout."""
    port, held = unresponsive_listener()
    try:
        app = await make_relay(
            url=f"http://127.0.0.1:{port}", health_interval_s=0.05, connect_timeout_s=1.0
        )
        await until_state(app, "llm", "down")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
        assert loop.time() - t0 < 0.5  # well under connect_timeout_s
        assert resp.status == 502
        err = error_of(resp)
        assert err["code"] == "upstream_unavailable" and err["details"]["upstream"] == "llm"
    finally:
        for s in held:
            s.close()


async def test_connect_failure_marks_down_without_a_probe(make_relay):
    port = closed_port()
    app = await make_relay(url=f"http://127.0.0.1:{port}", health_interval_s=0)
    assert (await slots_metrics(app))["llm"]["state"] == "unknown"  # never seen yet
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
    assert resp.status == 502 and error_of(resp)["code"] == "upstream_unavailable"
    assert (await slots_metrics(app))["llm"]["state"] == "down"
    back = Simulator(port=release(port))
    await back.start()
    try:  # no probe: the next request tries, and an answer brings the upstream back
        resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2))
        assert resp.status == 200 and content_of(resp) == httpc.sim_text(2)
        assert (await slots_metrics(app))["llm"]["state"] == "ready"
    finally:
        await back.stop()


async def test_serving_state_while_a_request_holds_a_slot(make_relay, sim):
    app = await make_relay(parallel=2)
    assert (await slots_metrics(app))["llm"]["state"] == "unknown"  # no probe, no request yet
    holder = await Held.open(app.port)
    snap = (await slots_metrics(app))["llm"]
    assert (snap["state"], snap["in_flight"], snap["parallel"]) == ("serving", 1, 2)
    holder.release()
    await wait_for(lambda: app.upstreams["llm"].slots.in_flight == 0)
    assert (await slots_metrics(app))["llm"]["state"] == "ready"


# ---- pass-through endpoints --------------------------------------------------------------------
@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/props", None),
        ("GET", "/slots", None),
        ("POST", "/tokenize", {"content": "Hello from a tiny llama"}),
        ("POST", "/detokenize", {"tokens": [300, 368, 369]}),
        ("POST", "/v1/embeddings", {"input": ["one", "two words"]}),
    ],
)
async def test_llama_server_endpoints_pass_through(make_relay, sim, method, path, body):
    app = await make_relay()
    direct = await httpc.fetch(sim.port, method, path, body)
    relayed = await httpc.fetch(app.port, method, path, body)
    assert direct.status == 200
    assert relayed.status == direct.status and relayed.body == direct.body
    assert relayed.header("content-type") == direct.header("content-type")
    assert [r.path for r in sim.requests] == [path, path]


async def test_native_completion_stream_has_no_done(make_relay, sim):
    app = await make_relay()
    body = {"prompt": "Say hi", "n_predict": 5, "stream": True}
    direct = await httpc.fetch(sim.port, "POST", "/completion", body)
    relayed = await httpc.fetch(app.port, "POST", "/completion", body)
    assert relayed.status == 200 and relayed.complete
    assert b"[DONE]" not in relayed.body
    events = relayed.data_events()
    assert len(events) == 6 and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == "".join(
        e["content"] for e in direct.data_events()
    )
    assert relayed.events()[:-1] == direct.events()[:-1]  # content events byte for byte
    [row] = rows(app, "WHERE path = '/completion'")
    assert (row["ok"], row["completion_tokens"], row["tokens_source"]) == (1, 5, "exact")

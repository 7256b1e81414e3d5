"""A drop-in for a REAL llama-server (issue 11): heartbeats during a long prompt, an
``--api-key`` server behind a key-less relay, and router mode (``--models-dir``) with two
tiny models loaded on demand."""

from __future__ import annotations

import pytest

from relay.config import UpstreamConfig
from tests.support.helpers import wait_for

from .common import CHAT, CHAT8, chat_body, mask
from .llama_server import start_or_fail
from .rawhttp import request

pytestmark = pytest.mark.e2e

HB = b": relay heartbeat\n\n"
# about 1800 prompt tokens: long enough for the 1-thread tiny model to take well over 10 ms
LONG = " Hello from a tiny llama." * 300


def content_text(chunks: list[bytes]) -> str:
    import json

    out = ""
    for event in b"".join(chunks).split(b"\n\n"):
        if event.startswith(b"data: {"):
            doc = json.loads(event[6:])
            for choice in doc.get("choices", []):
                out += choice.get("delta", {}).get("content") or ""
    return out


async def rows(app, n: int) -> list[dict]:
    def get():
        app.store.flush()
        return app.store.query("SELECT * FROM request ORDER BY rowid")

    await wait_for(lambda: len(get()) >= n, timeout=10, step=0.02)
    return get()


async def test_long_prompt_gets_heartbeats_then_the_same_stream(llama_server, make_relay):
    body = {
        "messages": [{"role": "user", "content": LONG}],
        "max_tokens": 8,
        "stream": True,
        "cache_prompt": False,
    }
    direct = await request(llama_server.port, "POST", CHAT, body)
    app = await make_relay(url=llama_server.url, parallel=2, heartbeat_s=0.01)
    via = await request(app.port, "POST", CHAT, body, headers={"X-Request-Id": "hb-real"})
    assert via.status == 200 and via.header("content-type") == "text/event-stream"
    # the client heard from the relay while the prompt was read, before any event
    assert via.chunks[0] == HB
    first = next(i for i, c in enumerate(via.chunks) if b'"content":"Hello' in c)
    assert HB not in b"".join(via.chunks[first:])  # heartbeats end with the first content
    assert mask(via.body.replace(HB, b"")) == mask(direct.body)
    assert content_text(via.chunks) == content_text(direct.chunks) == CHAT8
    [row] = await rows(app, 1)
    assert (row["ok"], row["status"], row["completion_tokens"], row["tokens_source"]) == (
        1,
        200,
        8,
        "exact",
    )


async def test_api_key_server_through_a_keyless_relay(make_relay):
    srv = start_or_fail(extra_args=("--api-key", "sk-e2e-upstream"))
    try:
        app = await make_relay(url=srv.url, parallel=2)
        body = chat_body(max_tokens=4, stream=True)
        ok = await request(
            app.port, "POST", CHAT, body, headers={"Authorization": "Bearer sk-e2e-upstream"}
        )
        assert ok.status == 200, ok.body[:300]
        assert content_text(ok.chunks) == "Hello from a tiny"
        ok2 = await request(app.port, "POST", CHAT, body, headers={"x-api-key": "sk-e2e-upstream"})
        assert ok2.status == 200, ok2.body[:300]
        direct = await request(
            srv.port, "POST", CHAT, body, headers={"Authorization": "Bearer wrong"}
        )
        wrong = await request(
            app.port, "POST", CHAT, body, headers={"Authorization": "Bearer wrong"}
        )
        assert direct.status == wrong.status == 401
        assert wrong.body == direct.body  # the server's own answer, verbatim
    finally:
        srv.cleanup()


async def test_router_mode_two_models_on_demand(make_relay):
    srv = start_or_fail(router_models=("alpha", "beta"))
    try:
        ups = [
            UpstreamConfig(name=f"router-{m}", url=srv.url, models=[m], parallel=2)
            for m in ("alpha", "beta")
        ]
        app = await make_relay(upstreams=ups, heartbeat_s=0.005)
        listed = await request(srv.port, "GET", "/v1/models")
        assert {m["id"]: m["status"]["value"] for m in listed.json()["data"]} == {
            "alpha": "unloaded",
            "beta": "unloaded",
        }
        for model in ("alpha", "beta", "alpha"):
            body = {**chat_body(max_tokens=8, stream=True), "model": model}
            resp = await request(app.port, "POST", CHAT, body)
            assert resp.status == 200, resp.body[:300]
            assert content_text(resp.chunks) == CHAT8
            assert {e["model"] for e in resp.sse_json()} == {model}
        loaded = await request(srv.port, "GET", "/v1/models")
        assert {m["id"]: m["status"]["value"] for m in loaded.json()["data"]} == {
            "alpha": "loaded",
            "beta": "loaded",
        }
        got = await rows(app, 3)
        assert [(r["model"], r["upstream_served"], r["ok"]) for r in got] == [
            ("alpha", "router-alpha", 1),
            ("beta", "router-beta", 1),
            ("alpha", "router-alpha", 1),
        ]
        slots = (await request(app.port, "GET", "/api/slots/metrics")).json()
        assert (
            slots["router-alpha"]["requests_total"],
            slots["router-beta"]["requests_total"],
        ) == (2, 1)
        assert slots["router-alpha"]["parallel"] == slots["router-beta"]["parallel"] == 2
    finally:
        srv.cleanup()


async def test_router_mode_first_request_waits_with_heartbeats(make_relay):
    srv = start_or_fail(router_models=("alpha", "beta"))
    try:
        ups = [
            UpstreamConfig(name=f"router-{m}", url=srv.url, models=[m]) for m in ("alpha", "beta")
        ]
        app = await make_relay(upstreams=ups, heartbeat_s=0.005)
        body = {**chat_body(max_tokens=8, stream=True), "model": "beta"}
        resp = await request(app.port, "POST", CHAT, body)  # beta is not loaded yet
        assert resp.status == 200
        assert resp.chunks[0] == HB  # the model loaded while the client heard heartbeats
        assert content_text(resp.chunks) == CHAT8
        [row] = await rows(app, 1)
        assert (row["ok"], row["model"], row["upstream_served"]) == (1, "beta", "router-beta")
    finally:
        srv.cleanup()

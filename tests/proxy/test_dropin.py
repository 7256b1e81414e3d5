"""A drop-in for llama-server (issue 11): credentials, model names, IPv6, CORS.

Real sockets; scripted upstreams record exactly what they were sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from relay.config import KeyConfig, UpstreamConfig
from relay.sim import frames as F
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import rows_of

CHAT = "/v1/chat/completions"
SECRET = "sk-relay-key"
EVENTS = [b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n', b"data: [DONE]\n\n"]
SSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Access-Control-Allow-Origin: \r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(F.chunk(e) for e in EVENTS)
    + b"0\r\n\r\n"
)


async def _answer(up: Scripted, index, reader, writer) -> None:
    while await up.read_request(reader) is not None:
        writer.write(up.answer)
        await writer.drain()


@pytest.fixture
async def upstreams():
    made = []

    async def make(answer: bytes = SSE, host: str = "127.0.0.1") -> Scripted:
        up = Scripted(_answer)
        up.answer = answer
        up.server = await asyncio.start_server(up._conn, host, 0)
        up.port = up.server.sockets[0].getsockname()[1]
        made.append(up)
        return up

    yield make
    for up in made:
        await up.stop()


def header(head: bytes, name: bytes) -> list[bytes]:
    return [
        line.split(b":", 1)[1].strip()
        for line in head.split(b"\r\n")[1:]
        if line.split(b":", 1)[0].lower() == name
    ]


def chat(model: str = "m") -> dict:
    return {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


# ---- credentials --------------------------------------------------------------------------------
async def test_client_credentials_reach_the_upstream_when_the_relay_checks_none(
    make_relay, upstreams
):
    up = await upstreams()
    app = await make_relay(up.url)
    creds = {"Authorization": "Bearer sk-upstream", "x-api-key": "sk-other"}
    resp = await httpc.fetch(app.port, "POST", CHAT, chat(), headers=creds)
    assert resp.status == 200
    assert header(up.heads[-1], b"authorization") == [b"Bearer sk-upstream"]
    assert header(up.heads[-1], b"x-api-key") == [b"sk-other"]
    assert "sk-upstream" not in repr(app.log.lines) and "sk-other" not in repr(app.log.lines)


async def test_client_credentials_are_consumed_when_the_relay_checks_keys(make_relay, upstreams):
    up = await upstreams()
    app = await make_relay(
        up.url, keys=[KeyConfig(id="k", sha256=hashlib.sha256(SECRET.encode()).hexdigest())]
    )
    for creds in (
        {"Authorization": f"Bearer {SECRET}"},
        {"x-api-key": SECRET, "Authorization": "Bearer " + SECRET},
    ):
        resp = await httpc.fetch(app.port, "POST", CHAT, chat(), headers=creds)
        assert resp.status == 200
        assert header(up.heads[-1], b"authorization") == []
        assert header(up.heads[-1], b"x-api-key") == []


async def test_upstream_credential_replaces_the_clients(make_relay, upstreams, monkeypatch):
    monkeypatch.setenv("RELAY_UP_KEY", "Bearer up-secret")
    up = await upstreams()
    app = await make_relay(
        upstreams=[
            UpstreamConfig(
                name="llm", url=up.url, auth_header="Authorization", auth_value_env="RELAY_UP_KEY"
            )
        ]
    )
    await httpc.fetch(
        app.port,
        "POST",
        CHAT,
        chat(),
        headers={"Authorization": "Bearer client", "x-api-key": "client"},
    )
    assert header(up.heads[-1], b"authorization") == [b"Bearer up-secret"]
    assert header(up.heads[-1], b"x-api-key") == []


# ---- model names --------------------------------------------------------------------------------
# whitespace, escapes and a nested "model" the splice must leave alone
RAW_BODY = (
    b'{ "messages" : [ {"role":"user","content":"say \\"model\\": \\"x\\"",'
    b' "model": "inner"} ],\n  "model"\t:\t"gpt-4o-mini" , "stream": true,'
    b' "max_tokens": 30, "temperature": 1e-1 }'
)


def mapped(body: bytes, old: bytes, new: bytes) -> bytes:
    i = body.rindex(old)
    return body[:i] + new + body[i + len(old) :]


async def post_raw(port: int, body: bytes) -> httpc.Response:
    return await httpc.fetch(port, "POST", CHAT, body, headers={"Content-Type": "application/json"})


async def test_model_name_rewritten_byte_exact_on_every_hop(make_relay, upstreams):
    busy = await upstreams(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
    small = await upstreams()
    app = await make_relay(
        upstreams=[
            UpstreamConfig(
                name="big",
                url=busy.url,
                models=["qwen-7b"],
                aliases=["gpt-4o-mini"],
                model_map={"gpt-4o-mini": "Qwen/Qwen2.5-7B-Instruct"},
                fallback=["small"],
            ),
            UpstreamConfig(
                name="small",
                url=small.url,
                models=["qwen-0.5b"],
                model_map={"*": "Qwen/Qwen2.5-0.5B-Instruct"},
            ),
        ]
    )
    resp = await post_raw(app.port, RAW_BODY)
    assert resp.status == 200 and resp.body == b"".join(EVENTS)
    # each hop got the client's bytes with only the model value replaced, its own name each
    assert busy.bodies == [mapped(RAW_BODY, b'"gpt-4o-mini"', b'"Qwen/Qwen2.5-7B-Instruct"')]
    assert small.bodies == [mapped(RAW_BODY, b'"gpt-4o-mini"', b'"Qwen/Qwen2.5-0.5B-Instruct"')]
    assert header(busy.heads[0], b"content-length") == [b"%d" % len(busy.bodies[0])]
    assert header(small.heads[0], b"content-length") == [b"%d" % len(small.bodies[0])]
    [row] = await rows_of(app, 1)
    assert (row["model"], row["upstream_requested"], row["upstream_served"]) == (
        "gpt-4o-mini",
        "big",
        "small",
    )


async def test_no_rewrite_when_the_names_agree_or_none_is_mapped(make_relay, upstreams):
    up = await upstreams()
    app = await make_relay(
        upstreams=[
            UpstreamConfig(
                name="u",
                url=up.url,
                models=["gpt-4o-mini", "other"],
                model_map={"gpt-4o-mini": "gpt-4o-mini"},
            )
        ]
    )
    await post_raw(app.port, RAW_BODY)
    other = RAW_BODY.replace(b'"gpt-4o-mini"', b'"other"')
    await post_raw(app.port, other)
    assert up.bodies == [RAW_BODY, other]


async def test_models_list_every_public_name(make_relay, upstreams):
    up = await upstreams()
    app = await make_relay(
        upstreams=[
            UpstreamConfig(
                name="u",
                url=up.url,
                models=["qwen-7b"],
                aliases=["gpt-4o-mini"],
                model_map={"gpt-4o-mini": "Qwen/Qwen2.5-7B-Instruct"},
            )
        ]
    )
    resp = await httpc.fetch(app.port, "GET", "/v1/models")
    assert [m["id"] for m in resp.json()["data"]] == ["qwen-7b", "gpt-4o-mini"]


# ---- IPv6 ---------------------------------------------------------------------------------------
async def test_ipv6_upstream_gets_a_bracketed_host(make_relay, upstreams):
    up = await upstreams(host="::1")
    app = await make_relay(upstreams=[UpstreamConfig(name="v6", url=f"http://[::1]:{up.port}")])
    resp = await httpc.fetch(app.port, "POST", CHAT, chat())
    assert resp.status == 200 and resp.body == b"".join(EVENTS)
    assert header(up.heads[-1], b"host") == [b"[::1]:%d" % up.port]


async def fetch_v6(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("::1", port)
    try:
        writer.write(httpc.build_request("POST", CHAT, chat()))
        resp = await asyncio.wait_for(httpc.read_head(reader), 5)
        await asyncio.wait_for(httpc.read_body(reader, resp), 5)
        return resp.body
    finally:
        writer.close()


@pytest.mark.parametrize("host", ["::1", "::"])
async def test_listening_on_ipv6(make_relay, upstreams, host):
    up = await upstreams()
    app = await make_relay(up.url, host=host)
    assert await fetch_v6(app.port) == b"".join(EVENTS)


# ---- CORS ---------------------------------------------------------------------------------------
ORIGIN = "https://chat.example"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
}


async def test_preflight_answered_before_auth(make_relay, upstreams):
    up = await upstreams()
    app = await make_relay(
        up.url,
        cors_origins=[ORIGIN],
        keys=[KeyConfig(id="k", sha256=hashlib.sha256(SECRET.encode()).hexdigest())],
    )
    resp = await httpc.fetch(app.port, "OPTIONS", CHAT, headers=PREFLIGHT)
    assert resp.status == 204
    assert resp.header("access-control-allow-origin") == ORIGIN
    assert resp.header("access-control-allow-methods") == "GET, POST, OPTIONS"
    allowed = {h.strip().lower() for h in resp.header("access-control-allow-headers").split(",")}
    assert {"authorization", "content-type", "x-api-key", "x-stainless-os"} <= allowed
    assert resp.header("access-control-expose-headers") == "X-Request-Id"
    assert up.heads == []  # the upstream never saw it
    # an origin not listed gets no allowance
    other = await httpc.fetch(
        app.port, "OPTIONS", CHAT, headers={**PREFLIGHT, "Origin": "https://evil.example"}
    )
    assert other.status == 204 and other.header("access-control-allow-origin") is None


async def test_cors_headers_on_relayed_and_own_responses(make_relay, upstreams):
    up = await upstreams()
    app = await make_relay(
        up.url,
        cors_origins=["*"],
        keys=[KeyConfig(id="k", sha256=hashlib.sha256(SECRET.encode()).hexdigest())],
    )
    ok = await httpc.fetch(
        app.port,
        "POST",
        CHAT,
        chat(),
        headers={"Origin": ORIGIN, "Authorization": f"Bearer {SECRET}"},
    )
    assert ok.status == 200
    # the upstream's own (empty) Access-Control-Allow-Origin is replaced, not doubled
    assert [v for k, v in ok.headers if k.lower() == "access-control-allow-origin"] == ["*"]
    assert ok.header("access-control-expose-headers") == "X-Request-Id"
    denied = await httpc.fetch(app.port, "POST", CHAT, chat(), headers={"Origin": ORIGIN})
    assert denied.status == 401
    assert denied.header("access-control-allow-origin") == "*"
    assert denied.header("access-control-expose-headers") == "X-Request-Id"


async def test_cors_off_by_default(make_relay, upstreams):
    up = await upstreams(b"HTTP/1.1 204 No Content\r\nAccess-Control-Allow-Origin: *\r\n\r\n")
    app = await make_relay(up.url)
    resp = await httpc.fetch(app.port, "OPTIONS", CHAT, headers=PREFLIGHT)
    assert resp.status == 204 and len(up.heads) == 1  # relayed as any request
    assert resp.header("access-control-allow-origin") == "*"  # the upstream's own answer


async def test_reload_turns_cors_and_model_map_on(make_relay, upstreams):
    import msgspec

    up = await upstreams()
    app = await make_relay(upstreams=[UpstreamConfig(name="u", url=up.url)])
    server = msgspec.structs.replace(app.config.server, cors_origins=[ORIGIN])
    ups = [msgspec.structs.replace(app.config.upstream[0], model_map={"m": "served-m"})]
    app.reload(msgspec.structs.replace(app.config, server=server, upstream=ups))
    resp = await httpc.fetch(app.port, "POST", CHAT, chat("m"), headers={"Origin": ORIGIN})
    assert resp.header("access-control-allow-origin") == ORIGIN
    assert json.loads(up.bodies[-1])["model"] == "served-m"


async def test_admin_key_is_not_passed_to_the_upstream(make_relay, upstreams):
    up = await upstreams(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    admin = "sk-admin"
    app = await make_relay(up.url, admin_key_sha256=hashlib.sha256(admin.encode()).hexdigest())
    resp = await httpc.fetch(
        app.port, "POST", "/props", {"x": 1}, headers={"Authorization": f"Bearer {admin}"}
    )
    assert resp.status == 200
    assert header(up.heads[-1], b"authorization") == []  # the relay's own secret stays here
    await httpc.fetch(app.port, "POST", CHAT, chat(), headers={"Authorization": "Bearer up"})
    assert header(up.heads[-1], b"authorization") == [b"Bearer up"]  # not an admin call

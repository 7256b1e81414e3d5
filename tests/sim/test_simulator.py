"""Tests of the built-in llama-server simulator over real sockets (raw asyncio streams)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys

import pytest

from relay.sim import frames as F
from relay.sim.server import SimDefaults, Simulator
from relay.sim.tinymodel import N_VOCAB
from tests.support.fixtures import FIXTURES as FIX
from tests.support.fixtures import ROOT
from tests.support.sim_client import (
    CHAT,
    Client,
    T,
    events,
    hval,
    parse_chunks,
    parse_head,
    req_bytes,
    stream,
)

# ----------------------------------------------------------------------------- helpers


def hnames(headers) -> list[bytes]:
    return [k for k, _ in headers]


def fixture(name: str):
    """(request json, status, headers, body-or-chunk-list) of a capture."""
    raw = (FIX / name).read_bytes()
    reqpart, resp = raw.split(b"======== RESPONSE (raw bytes) ========\n", 1)
    rb = reqpart.split(b"\r\n\r\n", 1)[1].strip()
    head, body = resp.split(b"\r\n\r\n", 1)
    status, headers = parse_head(head)
    if hval(headers, b"transfer-encoding") == b"chunked":
        return (json.loads(rb) if rb else None), status, headers, parse_chunks(body)
    return (
        (json.loads(rb) if rb.startswith(b"{") and rb.endswith(b"}") else rb),
        status,
        headers,
        body[: int(hval(headers, b"content-length"))],
    )


def ev_json(ev: bytes):
    assert ev.startswith(b"data: ")
    return None if ev == F.DONE_EVENT else json.loads(ev[6:])


def shape(o):
    """Key order (recursively) and value types, ignoring values."""
    if isinstance(o, dict):
        return [(k, shape(v)) for k, v in o.items()]
    if isinstance(o, list):
        return [shape(x) for x in o]
    return type(o).__name__


def norm(b: bytes) -> bytes:
    b = re.sub(rb"chatcmpl-[A-Za-z0-9]{32}", b"chatcmpl-X", b)
    return re.sub(rb'"created":\d+', b'"created":0', b)


# ----------------------------------------------------------------------------- fixture fidelity

STREAM_CASES = [
    ("chat_stream.http", {}, True),
    ("chat_stream_stopword.http", {}, True),
    ("chat_stream_usage.http", {}, True),
    ("completions_stream.http", {"tokens": 4, "eos_event": True}, False),
    ("completions_stream_usage.http", {}, True),
    ("native_completion_stream.http", {}, False),
]


@pytest.mark.parametrize("name,knobs,exact", STREAM_CASES)
async def test_stream_matches_fixture(sim, name, knobs, exact):
    body, fstatus, fheaders, fchunks = fixture(name)
    path = (FIX / name).read_bytes().split(b" ", 2)[1].decode()
    if knobs:
        body = {**body, "sim": knobs}
    c, status, headers = await stream(sim, path, body)
    assert status == fstatus == 200
    assert headers == fheaders  # names, order and values
    chunks = await c.chunks()
    assert await c.eof() == b""  # server closes after every stream
    assert [len(events(x)) for x in chunks] == [len(events(x)) for x in fchunks]
    native = path == "/completion"
    for mine, theirs in zip(chunks, fchunks):
        for me, te in zip(events(mine), events(theirs)):
            mj, tj = ev_json(me), ev_json(te)
            if (
                native and tj.get("stop") is True
            ):  # shorter final event: same leading keys + timings
                mk, tk = list(mj), list(tj)
                assert mk[:8] == tk[:8] and mk[-1] == tk[-1] == "timings"
                assert all(k in tk for k in mk) and [k for k in tk if k in mj] == mk
                assert shape(mj["timings"]) == shape(tj["timings"])
                assert mj["stop_type"] == tj["stop_type"]
                continue
            assert shape(mj) == shape(tj), (me, te)
            if exact and b'"timings"' not in te:
                assert norm(me) == norm(te)
    if path != "/completion":
        assert chunks[-1] == F.DONE_EVENT and fchunks[-1] == F.DONE_EVENT
    else:
        assert all(F.DONE_EVENT not in x for x in chunks)
    req = sim.requests[-1]
    assert req.finished and req.closed.is_set() and req.peer_closed_at is None


async def test_stopword_and_usage_counts(sim):
    body, *_ = fixture("chat_stream_stopword.http")
    c, _, _ = await stream(sim, "/v1/chat/completions", body)
    chunks = await c.chunks()
    fin = ev_json(events(chunks[-2])[0])
    assert fin["choices"][0]["finish_reason"] == "stop" and fin["timings"]["predicted_n"] == 6
    req = sim.requests[-1]
    assert req.tokens_sent == 5 and req.completion_tokens == 6
    body, *_ = fixture("chat_stream_usage.http")
    c, _, _ = await stream(sim, "/v1/chat/completions", body)
    evs = events((await c.chunks())[-2])
    assert "timings" not in ev_json(evs[0]) and ev_json(evs[1])["usage"]["completion_tokens"] == 8
    assert sim.tokens_sent_total == 13


@pytest.mark.parametrize(
    "name,knobs", [("chat_nonstream.http", {}), ("completions_nonstream.http", {"tokens": 4})]
)
async def test_nonstream_matches_fixture_and_keeps_alive(sim, name, knobs):
    body, fstatus, fheaders, fbody = fixture(name)
    path = (FIX / name).read_bytes().split(b" ", 2)[1].decode()
    c = await Client.connect(sim)
    await c.send("POST", path, {**body, "sim": knobs} if knobs else body)
    status, headers = await c.head()
    assert status == fstatus and hnames(headers) == hnames(fheaders)
    assert [h for h in headers if h[0] != b"Content-Length"] == [
        h for h in fheaders if h[0] != b"Content-Length"
    ]
    mine, theirs = json.loads(await c.body(headers)), json.loads(fbody)
    assert shape(mine) == shape(theirs)
    assert mine["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
    if name == "chat_nonstream.http":
        assert mine["choices"][0]["message"] == theirs["choices"][0]["message"]
    assert sim.requests[-1].completion_tokens == mine["usage"]["completion_tokens"]
    await c.send("GET", "/health")  # same connection: kept alive
    status, headers = await c.head()
    assert status == 200 and await c.body(headers) == b'{"status":"ok"}'
    assert sim.connections_opened == 1 and sim.open_connections == 1
    c.close()


@pytest.mark.parametrize(
    "name", ["health.http", "slots.http", "metrics.http", "models.http", "props.http"]
)
async def test_get_endpoints_match_fixture(sim, name):
    _, fstatus, fheaders, fbody = fixture(name)
    path = (FIX / name).read_bytes().split(b" ", 2)[1].decode()
    c = await Client.connect(sim)
    await c.send("GET", path)
    status, headers = await c.head()
    assert status == fstatus == 200 and hnames(headers) == hnames(fheaders)
    assert hval(headers, b"content-type") == hval(fheaders, b"content-type")
    body = await c.body(headers)
    if name in ("health.http", "slots.http", "metrics.http"):
        assert body == fbody  # idle, fresh simulator: byte-identical
    elif name == "models.http":
        mine, theirs = json.loads(body), json.loads(fbody)
        assert shape(mine) == shape(theirs) and mine["data"][0]["id"] == "models/tiny.gguf"
    else:
        mine, theirs = json.loads(body), json.loads(fbody)
        assert [k for k in theirs if k in mine] == list(mine) and mine["total_slots"] == 2
    c.close()


@pytest.mark.parametrize("name", ["err_404.http", "err_invalid_json.http"])
async def test_errors_match_fixture(sim, name):
    raw = (FIX / name).read_bytes()
    method, path = raw.split(b" ", 2)[:2]
    _, fstatus, fheaders, fbody = fixture(name)
    c = await Client.connect(sim)
    body = (
        raw.split(b"\r\n\r\n", 1)[1].split(b"\n======== RESPONSE", 1)[0]
        if method == b"POST"
        else None
    )
    await c.send(method.decode(), path.decode(), body)
    status, headers = await c.head()
    assert status == fstatus
    assert [h for h in headers if h[0] != b"Content-Length"] == [
        h for h in fheaders if h[0] != b"Content-Length"
    ]
    mine = await c.body(headers)
    assert shape(json.loads(mine)) == shape(json.loads(fbody))
    if name == "err_404.http":
        assert mine == fbody
    assert await c.eof() == b""


# ----------------------------------------------------------------------------- knobs


async def test_stall_after(sim):
    c, status, _ = await stream(
        sim, "/v1/chat/completions", {**CHAT, "stream": True, "sim": {"stall_after": 3}}
    )
    assert status == 200
    first = events(await c.chunk())
    assert len(first) == 2 and b'"role":"assistant"' in first[0]
    assert b'" from"' in await c.chunk() and b'" a"' in await c.chunk()
    assert await c.silent()
    req = sim.requests[-1]
    assert req.tokens_sent == 3 and not req.closed.is_set() and sim.open_connections == 1
    c.close()
    await asyncio.wait_for(req.closed.wait(), T)
    assert req.peer_closed_at is not None and not req.finished and req.completion_tokens is None


async def test_stall_mid_line(sim):
    c, _, _ = await stream(
        sim,
        "/v1/chat/completions",
        {**CHAT, "stream": True, "sim": {"stall_after": 2, "stall_mid_line": True}},
    )
    await c.chunk(), await c.chunk()
    half = await c.chunk()  # a complete chunk holding half an event
    full = F.StreamFrames("chat", "models/tiny.gguf", 2).event(2)
    assert half.startswith(b'data: {"choi') and len(half) == len(full) // 2 and b"\n\n" not in half
    assert await c.silent()
    c.close()
    await asyncio.wait_for(sim.requests[-1].closed.wait(), T)
    assert sim.requests[-1].peer_closed_at is not None


async def test_stall_mid_chunk(sim):
    c, _, _ = await stream(
        sim,
        "/v1/completions",
        {"prompt": "x", "stream": True, "sim": {"stall_after": 1, "stall_mid_chunk": True}},
    )
    await c.chunk()
    size = int((await asyncio.wait_for(c.r.readuntil(b"\r\n"), T))[:-2], 16)
    full = F.StreamFrames("text", "models/tiny.gguf", 1).event(1)
    assert size == len(full)
    part = await asyncio.wait_for(c.r.readexactly(size // 2), T)
    assert part == full[: size // 2] or norm(part) == norm(full)[: len(norm(part))]
    assert await c.silent()
    c.close()


async def test_chatty_until_peer_closes(sim):
    c, _, _ = await stream(
        sim,
        "/v1/chat/completions",
        {**CHAT, "stream": True, "sim": {"chatty": True, "interval_ms": 2}},
    )
    for _ in range(25):
        assert b'"content"' in await c.chunk()
    req = sim.requests[-1]
    c.close()
    await asyncio.wait_for(req.closed.wait(), T)
    sent = req.tokens_sent
    assert sent >= 25 and req.peer_closed_at is not None and not req.finished
    await asyncio.sleep(0.05)
    assert req.tokens_sent == sent and sim.open_connections == 0


async def test_drop_after(sim):
    c, _, _ = await stream(
        sim, "/v1/chat/completions", {**CHAT, "stream": True, "sim": {"drop_after": 2}}
    )
    assert len(events(await c.chunk())) == 2
    assert b'" from"' in await c.chunk()
    assert await c.eof() == b""  # no terminating chunk
    req = sim.requests[-1]
    await asyncio.wait_for(req.closed.wait(), T)
    assert req.tokens_sent == 2 and not req.finished and req.peer_closed_at is None


@pytest.mark.parametrize(
    "code,type_",
    [
        (500, "server_error"),
        (429, "unavailable_error"),
        (400, "invalid_request_error"),
        (503, "unavailable_error"),
    ],
)
async def test_status_knob(sim, code, type_):
    c, status, headers = await stream(
        sim, "/v1/chat/completions", {**CHAT, "stream": True, "sim": {"status": code}}
    )
    assert status == code
    assert hnames(headers) == [
        b"Server",
        b"Access-Control-Allow-Origin",
        b"Content-Type",
        b"Content-Length",
        b"Connection",
    ]
    assert hval(headers, b"connection") == b"close"
    err = json.loads(await c.body(headers))
    assert list(err) == ["error"] and list(err["error"]) == ["code", "message", "type"]
    assert err["error"]["code"] == code and err["error"]["type"] == type_
    assert await c.eof() == b""


async def test_error_event(sim):
    c, status, headers = await stream(
        sim, "/v1/chat/completions", {**CHAT, "stream": True, "sim": {"error_event": True}}
    )
    assert status == 200 and hval(headers, b"content-type") == b"text/event-stream"
    assert await c.chunks() == [
        b'data: {"error":{"code":500,"message":"simulated","type":"server_error"}}\n\n'
    ]
    assert await c.eof() == b""


async def test_octet_body(sim):
    c, status, headers = await stream(
        sim, "/v1/completions", {"prompt": "x", "sim": {"body_kind": "octet", "tokens": 5}}
    )
    assert status == 200 and hval(headers, b"content-type") == b"application/octet-stream"
    assert hval(headers, b"transfer-encoding") == b"chunked"
    assert await c.chunks() == [F.octet_payload(i) for i in range(5)]
    assert await c.eof() == b""
    assert sim.requests[-1].tokens_sent == 5
    c, _, _ = await stream(
        sim, "/v1/completions", {"prompt": "x", "sim": {"body_kind": "octet", "stall_after": 2}}
    )
    assert [await c.chunk(), await c.chunk()] == [F.octet_payload(0), F.octet_payload(1)]
    assert await c.silent()
    c.close()


@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})]
)
async def test_content_length_stream(sim, path, body):
    c, status, headers = await stream(
        sim,
        path,
        {
            **body,
            "stream": True,
            "sim": {"content_length_stream": True, "tokens": 9, "interval_ms": 1},
        },
    )
    assert status == 200 and hval(headers, b"transfer-encoding") is None
    assert hnames(headers) == [
        b"Server",
        b"Access-Control-Allow-Origin",
        b"X-Accel-Buffering",
        b"Content-Type",
        b"Content-Length",
        b"Keep-Alive",
    ]
    data = await c.body(headers)
    assert await c.eof() == b""
    evs = events(data)
    chat = path.startswith("/v1/chat")
    assert len(evs) == 9 + 2 + chat and evs[-1] == F.DONE_EVENT
    assert ev_json(evs[-2])["choices"][0]["finish_reason"] == "stop"
    assert sim.requests[-1].tokens_sent == 9 and sim.requests[-1].finished


async def test_head_delay(sim):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    c, status, _ = await stream(
        sim, "/v1/chat/completions", {**CHAT, "stream": True, "sim": {"head_delay_ms": 120}}
    )
    assert status == 200 and loop.time() - t0 >= 0.11
    assert len(await c.chunks()) == 16 + 2


async def test_first_token_delay_sends_role_first(sim):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    c, _, _ = await stream(
        sim,
        "/v1/chat/completions",
        {**CHAT, "stream": True, "sim": {"first_token_delay_ms": 150, "tokens": 2}},
    )
    role = events(await c.chunk())
    assert len(role) == 1 and ev_json(role[0])["choices"][0]["delta"] == {
        "role": "assistant",
        "content": None,
    }
    first = await c.chunk()
    assert loop.time() - t0 >= 0.14
    assert ev_json(events(first)[0])["choices"][0]["delta"] == {"content": "Hello"}
    assert len(await c.chunks()) == 3


async def test_pacing_no_drift(sim):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    c, _, _ = await stream(
        sim,
        "/v1/chat/completions",
        {**CHAT, "stream": True, "sim": {"tokens": 10, "interval_ms": 20}},
    )
    stamps = []
    while await c.chunk() is not None:
        stamps.append(loop.time())
    total = stamps[-1] - t0
    # uvloop's timers tick in whole milliseconds and may fire up to 1 ms early: 2 ms of slack
    assert len(stamps) == 12 and 0.178 <= total <= 0.4, total
    # Token 9 is due 180 ms after the simulator read the request (its own stamp, on this
    # clock), whenever token 0 was read: a late first read on a busy machine shortens the
    # span from it, not this one.
    assert stamps[9] - sim.requests[-1].started_at >= 0.178


async def test_defaults_and_max_tokens(sim):
    sim.defaults = SimDefaults(tokens=3)
    c, _, _ = await stream(sim, "/v1/completions", {"prompt": "hello world!", "stream": True})
    chunks = await c.chunks()
    fin = ev_json(events(chunks[-2])[0])
    assert len(chunks) == 3 + 2 and fin["choices"][0]["finish_reason"] == "stop"
    assert fin["usage"] == {
        "completion_tokens": 3,
        "prompt_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    c, _, _ = await stream(
        sim, "/completion", {"prompt": "x", "n_predict": 2, "stream": True, "sim": {"tokens": 9}}
    )
    chunks = await c.chunks()
    assert len(chunks) == 3 and ev_json(events(chunks[-1])[0])["stop_type"] == "limit"
    assert [r.completion_tokens for r in sim.requests] == [3, 2] and sim.tokens_sent_total == 5


async def test_backpressure_pauses_and_resumes(sim):
    n = 60000
    c = await Client.connect(sim)
    await c.send("POST", "/v1/chat/completions", {**CHAT, "stream": True, "sim": {"tokens": n}})
    req = None
    for _ in range(200):  # wait (bounded) until the sim's transport is paused by the unread socket
        conns = list(sim._conns)
        if conns and conns[0].paused:
            req = sim.requests[-1]
            break
        await asyncio.sleep(0.01)
    assert req is not None, "transport never paused"
    sent = req.tokens_sent
    assert sent < n
    await asyncio.sleep(0.05)
    assert req.tokens_sent == sent  # nothing produced while paused
    status, _ = await c.head()
    rest = await asyncio.wait_for(c.r.read(), 30)  # drain everything; the sim resumes and finishes
    chunks = parse_chunks(rest)
    assert status == 200 and len(chunks) == n + 2 and chunks[-1] == F.DONE_EVENT
    assert req.finished and req.tokens_sent == n


async def test_nonstream_delay_stall_drop(sim):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    c = await Client.connect(sim)
    await c.send(
        "POST",
        "/v1/chat/completions",
        {**CHAT, "sim": {"tokens": 3, "head_delay_ms": 60, "interval_ms": 20}},
    )
    status, h = await c.head()
    assert status == 200 and loop.time() - t0 >= 0.09
    body = json.loads(await c.body(h))
    assert body["usage"]["completion_tokens"] == 3 and sim.requests[-1].tokens_sent == 3
    stalled = await Client.connect(sim)
    await stalled.send("POST", "/v1/completions", {"prompt": "x", "sim": {"stall_after": 1}})
    assert await stalled.silent()
    stalled.close()
    await asyncio.wait_for(sim.requests[-1].closed.wait(), T)
    assert sim.requests[-1].peer_closed_at is not None and not sim.requests[-1].finished
    dropped = await Client.connect(sim)
    await dropped.send("POST", "/v1/completions", {"prompt": "x", "sim": {"drop_after": 1}})
    assert await dropped.eof() == b""
    assert sim.requests[-1].closed.is_set() and sim.requests[-1].peer_closed_at is None


async def test_content_length_stall_mid_line(sim):
    c, _, headers = await stream(
        sim,
        "/v1/chat/completions",
        {
            **CHAT,
            "stream": True,
            "sim": {"content_length_stream": True, "stall_after": 1, "stall_mid_line": True},
        },
    )
    assert int(hval(headers, b"content-length")) > 1000
    first = await asyncio.wait_for(c.r.readuntil(b'"Hello"'), T)
    rest = await asyncio.wait_for(c.r.readuntil(b'data: {"choi'), T)
    assert first.startswith(b"data: ") and rest.count(b"\n\n") == 1
    half = len(F.StreamFrames("chat", "models/tiny.gguf", 2).event(1)) // 2
    tail = await asyncio.wait_for(c.r.readexactly(half - len(b'data: {"choi')), T)
    assert b"\n" not in tail
    assert await c.silent()
    c.close()


async def test_stream_honours_connection_close(sim):
    c = await Client.connect(sim)
    await c.send(
        "POST",
        "/v1/chat/completions",
        {**CHAT, "stream": True, "max_tokens": 1},
        headers=("Connection: close",),
    )
    _, headers = await c.head()
    assert hnames(headers)[-1] == b"Connection" and hval(headers, b"connection") == b"close"
    assert len(await c.chunks()) == 1 + 2
    assert await c.eof() == b""


# ----------------------------------------------------------------------------- connection behaviour


async def test_pipelined_requests_and_idle_close(sim):
    sim.keepalive_timeout = 0.3
    c = await Client.connect(sim)
    c.w.write(
        req_bytes("GET", "/health")
        + req_bytes("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    )
    s1, h1 = await c.head()
    assert s1 == 200 and await c.body(h1) == b'{"status":"ok"}'
    _s2, h2 = await c.head()
    body = json.loads(await c.body(h2))
    assert body["choices"][0]["message"]["content"] == "Hello from"
    assert body["choices"][0]["finish_reason"] == "length"
    assert await c.eof() == b""  # idle keep-alive timeout
    assert sim.connections_opened == 1


async def test_connection_close_request_header(sim):
    c = await Client.connect(sim)
    await c.send("GET", "/health", headers=("Connection: close",))
    _status, headers = await c.head()
    assert hval(headers, b"connection") == b"close" and hval(headers, b"keep-alive") is None
    await c.body(headers)
    assert await c.eof() == b""


async def test_loading_and_slots_and_metrics(sim):
    sim.loading = True
    for method, path, body in [("GET", "/health", None), ("POST", "/v1/chat/completions", CHAT)]:
        c = await Client.connect(sim)
        await c.send(method, path, body)
        status, headers = await c.head()
        assert status == 503
        assert (
            await c.body(headers)
            == b'{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'
        )
    sim.loading = False
    s, _, _ = await stream(
        sim, "/v1/chat/completions", {**CHAT, "stream": True, "sim": {"stall_after": 4}}
    )
    await s.chunk()
    c = await Client.connect(sim)
    await c.send("GET", "/slots")
    _, h = await c.head()
    # llama-server's least recently used of equally old slots is the last one
    assert [x["is_processing"] for x in json.loads(await c.body(h))] == [False, True]
    await c.send("GET", "/metrics")
    _, h = await c.head()
    text = (await c.body(h)).decode()
    assert "\nllamacpp:requests_processing 1\n" in text
    s.close()
    await asyncio.wait_for(sim.requests[-1].closed.wait(), T)
    await c.send("GET", "/slots")
    _, h = await c.head()
    assert [x["is_processing"] for x in json.loads(await c.body(h))] == [False, False]
    await c.send("GET", "/metrics")
    _, h = await c.head()
    assert (
        f"\nllamacpp:tokens_predicted_total {sim.tokens_sent_total}\n" in (await c.body(h)).decode()
    )
    assert sim.tokens_sent_total >= 4


async def test_tokenize_detokenize_embeddings(sim):
    c = await Client.connect(sim)
    await c.send("POST", "/tokenize", {"content": "Hello there friend"})
    _, h = await c.head()
    toks = json.loads(await c.body(h))["tokens"]
    assert len(toks) == 4 and all(0 <= t < N_VOCAB for t in toks)
    await c.send("POST", "/detokenize", {"tokens": [364, 368]})
    _, h = await c.head()
    assert json.loads(await c.body(h)) == {"content": " Hello from"}
    await c.send("POST", "/v1/embeddings", {"input": ["a", "bb"]})
    _, h = await c.head()
    e = json.loads(await c.body(h))
    assert list(e) == ["model", "object", "usage", "data"] and len(e["data"]) == 2
    assert list(e["data"][1]) == ["embedding", "index", "object"] and e["data"][1]["index"] == 1


async def test_stop_closes_everything():
    s = Simulator(defaults=SimDefaults(interval_ms=1000))
    await s.start()
    c, _, _ = await stream(s, "/v1/chat/completions", {**CHAT, "stream": True})
    req = s.requests[-1]
    await s.stop()
    await asyncio.wait_for(req.closed.wait(), T)
    assert not req.finished and req.peer_closed_at is None
    await c.eof()


def test_main_smoke():
    code = (
        "from relay.sim.cli import main; raise SystemExit(main(['--port', '0', '--tokens', '3']))"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        line = json.loads(p.stdout.readline())
        assert line["event"] == "sim_listening" and line["port"] > 0

        async def go():
            r, w = await asyncio.open_connection("127.0.0.1", line["port"])
            w.write(req_bytes("POST", "/v1/chat/completions", {**CHAT, "stream": True}))
            return await asyncio.wait_for(r.read(), T)

        data = asyncio.run(go())
        chunks = parse_chunks(data.split(b"\r\n\r\n", 1)[1])
        assert len(chunks) == 3 + 2 and chunks[-1] == F.DONE_EVENT
        p.send_signal(signal.SIGTERM)
        assert p.wait(5) == 0
    finally:
        p.kill()
        p.wait()

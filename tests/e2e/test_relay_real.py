"""End to end through the relay to a REAL llama-server (tiny deterministic model).

These are the relay's own promises, so they run against every llama-server build on the
machine (`llama_any`: `[pinned]`, the reference, and e.g. `[skulk]` where the CPU runs it).

* streams (chat, /v1/completions, native /completion) are byte-identical to a direct request:
  same status line, same headers (minus the hop-by-hop Keep-Alive / Connection, plus the
  relay's X-Request-Id), same chunk framing, same bytes - with only ids, ``created`` and the
  timing floats masked (``cache_prompt: false`` keeps the prompt-cache counts deterministic);
* the official ``openai`` client (AsyncOpenAI, base_url = relay/v1) gets the deterministic text;
* a client that goes away mid-stream frees the llama-server slot, and the row says so;
* exact token accounting: row ``completion_tokens`` (``tokens_source='exact'``) equals the
  stream's ``timings.predicted_n`` and the rise of ``llamacpp:tokens_predicted_total``;
* llama-server's own 4xx errors and its plain endpoints (/health, /props, /slots, /tokenize,
  /detokenize, /v1/models) pass through unchanged;
* one client connection carries many requests although llama-server closes its side after
  every stream and drops idle keep-alive connections after 5 s.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from tests.support.helpers import wait_for

from .common import CHAT, CHAT8, chat_body, mask
from .llama_server import start_or_fail
from .rawhttp import RawResponse, build_request, read_head, read_response, request
from .tiny_gguf import STOP_TEXT, STOP_TRIGGER_PROMPT

pytestmark = pytest.mark.e2e

TEXT = "/v1/completions"
NATIVE = "/completion"

# Hop-by-hop response headers of llama-server that the relay does not forward to its client.
HOP_BY_HOP = {"connection", "keep-alive"}


CHAT_EOS = {
    "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well?"}],
    "max_tokens": 16,
    "cache_prompt": False,
}


def text_body(prompt: str = "Say hi", **kw) -> dict:
    return {"prompt": prompt, "cache_prompt": False, **kw}


# ---- masking and framing ----------------------------------------------------------------------
def frames(resp: RawResponse) -> list[tuple[bytes | None, bytes]]:
    """The chunked body as (size line, masked payload) per chunk, terminator included.

    The size line is kept where it cannot depend on a masked value: ids and ``created`` have
    a fixed length, so only chunks holding ``timings`` floats get ``None``.
    """
    assert resp.header("transfer-encoding") == "chunked", resp.headers
    body = resp.raw[resp.raw.index(b"\r\n\r\n") + 4 :]
    out: list[tuple[bytes | None, bytes]] = []
    pos = 0
    while True:
        eol = body.index(b"\r\n", pos)
        size_line = body[pos:eol]
        size = int(size_line, 16)
        payload = body[eol + 2 : eol + 2 + size]
        assert body[eol + 2 + size : eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size
        out.append((None if b'"timings"' in payload else size_line, mask(payload)))
        if size == 0:
            assert pos == len(body), f"bytes after the last chunk: {body[pos:]!r}"
            return out


def expected_relay_headers(direct: RawResponse, rid: str) -> list[tuple[str, str]]:
    return [(k, v) for k, v in direct.headers if k not in HOP_BY_HOP] + [("x-request-id", rid)]


def untimed(via: RawResponse) -> list[tuple[str, str]]:
    """The relayed headers less the relay's own Server-Timing line (this run's durations),
    which a relayed answer carries once."""
    mine = [(k, v) for k, v in via.headers if k == "server-timing" and v.startswith("relay;")]
    assert len(mine) == 1, via.headers
    return [kv for kv in via.headers if kv not in mine]


async def relayed(
    app, method: str, path: str, body=None, rid: str = "e2e", check_close: bool = False
) -> RawResponse:
    return await request(
        app.port, method, path, body, headers={"X-Request-Id": rid}, check_close=check_close
    )


async def row(app, rid: str) -> dict:
    """The request's row once settled (exactly one)."""

    def get():
        app.store.flush()
        return app.store.query("SELECT * FROM request WHERE request_id = ?", (rid,))

    await wait_for(lambda: get(), timeout=5, step=0.02)
    rows = get()
    assert len(rows) == 1, rows
    return rows[0]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


async def tokens_predicted_total(port: int) -> float:
    resp = await request(port, "GET", "/metrics")
    assert resp.status == 200
    return metric(resp.body.decode(), "llamacpp:tokens_predicted_total")


@pytest.fixture
async def relay(llama_any, make_relay):
    """An in-process relay in front of the session's llama-server (2 slots)."""
    return await make_relay(url=llama_any.url, parallel=2)


# ---- byte-identical streams -------------------------------------------------------------------
STREAMS = {
    "chat_length": (CHAT, chat_body(max_tokens=8, stream=True)),
    "chat_include_usage": (
        CHAT,
        chat_body(max_tokens=8, stream=True, stream_options={"include_usage": True}),
    ),
    "chat_stop_word": (CHAT, chat_body(max_tokens=16, stream=True, stop=["."])),
    "chat_eos": (CHAT, {**CHAT_EOS, "stream": True}),
    "completions_length": (TEXT, text_body(max_tokens=8, stream=True)),
    "completions_eos": (TEXT, text_body(STOP_TRIGGER_PROMPT, max_tokens=16, stream=True)),
    "completions_stop_word": (TEXT, text_body(max_tokens=16, stream=True, stop=["."])),
    "completions_include_usage": (
        TEXT,
        text_body(max_tokens=5, stream=True, stream_options={"include_usage": True}),
    ),
    "native_length": (NATIVE, text_body(n_predict=6, stream=True)),
    "native_eos": (NATIVE, text_body(STOP_TRIGGER_PROMPT, n_predict=16, stream=True)),
}


@pytest.mark.parametrize("path,body", list(STREAMS.values()), ids=list(STREAMS))
async def test_stream_byte_identical_to_direct(llama_any, relay, path, body):
    rid = "e2e-bytes-" + path.strip("/").replace("/", "-")
    direct = await request(llama_any.port, "POST", path, body, check_close=True)
    via = await relayed(relay, "POST", path, body, rid)
    assert direct.status == 200 and direct.closed is True, direct.raw[:500]
    assert (via.status, via.reason) == (direct.status, direct.reason)
    assert untimed(via) == expected_relay_headers(direct, rid)
    assert frames(via) == frames(direct)
    assert mask(via.body) == mask(direct.body)  # the de-chunked body, for a readable diff
    r = await row(relay, rid)
    assert (r["status"], r["ok"], r["client_closed"], r["stream"]) == (200, 1, 0, 1)


async def test_nonstream_identical_to_direct(llama_any, relay):
    for path, body in (
        (CHAT, chat_body(max_tokens=8)),
        (TEXT, text_body(max_tokens=8)),
        (NATIVE, text_body(n_predict=8)),
    ):
        direct = await request(llama_any.port, "POST", path, body)
        via = await relayed(relay, "POST", path, body, "e2e-nonstream")
        assert direct.status == via.status == 200
        # Content-Length follows the (unmasked) timing floats; everything else is equal
        unlen = lambda hs: [(k, "<n>" if k == "content-length" else v) for k, v in hs]  # noqa: E731
        assert unlen(untimed(via)) == unlen(expected_relay_headers(direct, "e2e-nonstream"))
        assert int(via.header("content-length")) == len(via.body)
        assert mask(via.body) == mask(direct.body)


# ---- the official openai client ---------------------------------------------------------------
async def test_openai_client_streams_through_relay(relay):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=f"http://127.0.0.1:{relay.port}/v1", api_key="sk-e2e", max_retries=0, timeout=30.0
    )
    try:
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi there"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        assert text == CHAT8
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == 8

        stream = await client.completions.create(
            model="tiny", prompt=STOP_TRIGGER_PROMPT, max_tokens=16, stream=True
        )
        pieces = [c.choices[0].text async for c in stream if c.choices]
        assert "".join(pieces) == STOP_TEXT

        done = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi there"}], max_tokens=8
        )
        assert done.choices[0].message.content == CHAT8
        assert done.usage.completion_tokens == 8
    finally:
        await client.close()


# ---- client disconnect frees the slot ---------------------------------------------------------
@pytest.fixture(scope="module")
def long_ctx_server(llama_build):
    """A 1-slot server with the model's whole context (4096): a stream that is not cut runs for
    seconds, so a slot freed within a second of the disconnect was freed BY the disconnect."""
    srv = start_or_fail(binary=llama_build.binary, extra_args=("-c", "32768", "-np", "1"))
    try:
        yield srv
    finally:
        srv.cleanup()


async def test_client_disconnect_frees_llama_slot(long_ctx_server, make_relay):
    srv = long_ctx_server
    slots = (await request(srv.port, "GET", "/slots")).json()
    n_ctx = slots[0]["n_ctx"]
    assert len(slots) == 1 and n_ctx >= 4096, slots
    app = await make_relay(url=srv.url, parallel=1)
    before = await tokens_predicted_total(srv.port)

    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 100000, "stream": True}
    writer.write(build_request("POST", CHAT, app.port, body, {"X-Request-Id": "e2e-disconnect"}))
    await writer.drain()
    status, _, _, _ = await read_head(reader)
    assert status == 200
    got = b""
    while got.count(b"data: ") < 30:  # a few dozen events went through the relay
        got += await asyncio.wait_for(reader.read(65536), 10)
    busy = (await request(srv.port, "GET", "/slots")).json()
    assert busy[0]["is_processing"] is True, "the stream should still be generating"

    writer.close()  # the client goes away mid-stream
    t0 = time.monotonic()
    while True:
        slots = (await request(srv.port, "GET", "/slots")).json()
        if not slots[0]["is_processing"]:
            break
        assert time.monotonic() - t0 < 2.0, f"slot still busy 2 s after the disconnect: {slots}"
        await asyncio.sleep(0.02)

    predicted = await tokens_predicted_total(srv.port) - before
    assert 30 <= predicted < n_ctx // 2, f"{predicted} tokens: generation was not cut short"
    r = await row(app, "e2e-disconnect")
    assert r["client_closed"] == 1 and r["status"] == 200 and r["ok"] == 0, r

    # the slot is really usable again
    after = await relayed(app, "POST", CHAT, chat_body(max_tokens=8), "e2e-after-disconnect")
    assert after.json()["choices"][0]["message"]["content"] == CHAT8


# ---- exact token accounting -------------------------------------------------------------------
TOKEN_CASES = {
    "chat": (CHAT, chat_body(max_tokens=11, stream=True), 11),
    "chat_include_usage": (
        CHAT,
        chat_body(max_tokens=7, stream=True, stream_options={"include_usage": True}),
        7,
    ),
    "chat_eos": (CHAT, {**CHAT_EOS, "stream": True}, 5),  # 4 text tokens + EOS
    "completions_eos": (TEXT, text_body(STOP_TRIGGER_PROMPT, max_tokens=16, stream=True), 5),
    "completions_stop_word": (TEXT, text_body(max_tokens=16, stream=True, stop=["."]), 6),
    "native": (NATIVE, text_body(n_predict=9, stream=True), 9),
    "chat_nonstream": (CHAT, chat_body(max_tokens=6), 6),
}


@pytest.mark.parametrize("path,body,n", list(TOKEN_CASES.values()), ids=list(TOKEN_CASES))
async def test_exact_tokens_equal_timings_and_server_metrics(llama_any, relay, path, body, n):
    rid = "e2e-tokens-" + path.strip("/").replace("/", "-")
    before = await tokens_predicted_total(llama_any.port)
    resp = await relayed(relay, "POST", path, body, rid)
    assert resp.status == 200
    if body.get("stream"):
        final = [e for e in resp.sse_json() if "timings" in e][-1]
    else:
        final = resp.json()
    predicted_n = final["timings"]["predicted_n"]
    assert predicted_n == n
    delta = None
    for _ in range(100):  # bounded: the counter is normally up to date at once
        delta = await tokens_predicted_total(llama_any.port) - before
        if delta >= predicted_n:
            break
        await asyncio.sleep(0.02)
    assert delta == predicted_n
    r = await row(relay, rid)
    assert r["tokens_source"] == "exact", r
    assert r["completion_tokens"] == predicted_n == delta, r


# ---- every content event counted, however its numbers change -----------------------------------
def _text_of(event: dict) -> str:
    """The generated text of one parsed event of the three APIs (empty if none)."""
    if "choices" not in event:
        return event.get("content") or ""
    choice = (event["choices"] or [{}])[0]
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


GAP_CASES = {
    "chat": (CHAT, chat_body(max_tokens=24, stream=True)),
    "completions": (TEXT, text_body(max_tokens=24, stream=True)),
    # Its events carry their token ids and counts after the text, new every event.
    "native": (NATIVE, text_body(n_predict=24, stream=True)),
}


@pytest.mark.parametrize("path,body", list(GAP_CASES.values()), ids=list(GAP_CASES))
async def test_the_rows_gaps_are_one_fewer_than_the_content_events(llama_any, relay, path, body):
    """Most reads of a stream are counted by the fast path; what it counts must be every
    content event the client got (the row's inter-token gaps: one fewer)."""
    from relay.stream.itl import decode

    rid = "e2e-gaps-" + path.strip("/").replace("/", "-")
    resp = await relayed(relay, "POST", path, body, rid)
    assert resp.status == 200
    content = sum(1 for e in resp.sse_json() if _text_of(e))
    assert content >= 10, resp.body[:300]
    r = await row(relay, rid)
    buckets, zeros = decode(r["itl_hist"])
    assert zeros + sum(buckets.values()) == content - 1, r


# ---- llama-server's own errors pass through verbatim -------------------------------------------
ERRORS = {
    "prompt_over_context_stream": ("POST", TEXT, text_body("a " * 5000, max_tokens=4, stream=True)),
    "prompt_over_context_chat": (
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": "a " * 5000}], "max_tokens": 4},
    ),
    "unknown_path_404": ("GET", "/nope", None),
    "unknown_post_404": ("POST", "/v1/nope", {"x": 1}),
}


@pytest.mark.parametrize("method,path,body", list(ERRORS.values()), ids=list(ERRORS))
async def test_llama_4xx_pass_through_verbatim(llama_any, relay, method, path, body):
    direct = await request(llama_any.port, method, path, body)
    via = await relayed(relay, method, path, body, "e2e-4xx")
    assert 400 <= direct.status < 500, direct.raw[:300]
    assert (via.status, via.reason) == (direct.status, direct.reason)
    assert via.body == direct.body  # byte for byte
    assert untimed(via) == expected_relay_headers(direct, "e2e-4xx")
    r = await row(relay, "e2e-4xx")
    assert r["status"] == direct.status and r["ok"] == 0, r


# ---- plain endpoints pass through -------------------------------------------------------------
PLAIN = {
    "props": ("GET", "/props", None),
    "slots": ("GET", "/slots", None),
    "tokenize": ("POST", "/tokenize", {"content": "Hello from a tiny llama.", "with_pieces": True}),
    "detokenize": ("POST", "/detokenize", {"tokens": [265, 273, 274, 278, 283, 328]}),
    "models": ("GET", "/v1/models", None),
}
_VOLATILE = re.compile(rb'"(created|id_task|t_start|t_end)":[0-9.]+')


@pytest.mark.parametrize("method,path,body", list(PLAIN.values()), ids=list(PLAIN))
async def test_plain_endpoints_pass_through(llama_any, relay, method, path, body):
    before = await request(llama_any.port, method, path, body)
    via = await relayed(relay, method, path, body, "e2e-plain")
    after = await request(llama_any.port, method, path, body)
    assert before.status == via.status == 200
    norm = lambda b: _VOLATILE.sub(rb'"\1":0', b)  # noqa: E731
    assert norm(via.body) in (norm(before.body), norm(after.body))
    expected = expected_relay_headers(before, "e2e-plain")
    assert [k for k, _ in untimed(via)] == [k for k, _ in expected]
    assert [(k, v) for k, v in untimed(via) if k != "content-length"] == [
        (k, v) for k, v in expected if k != "content-length"
    ]
    assert int(via.header("content-length")) == len(via.body)


async def test_health_is_the_relays_own_in_llama_servers_shape(llama_any, make_relay):
    """GET /health is answered by the relay (no key, never forwarded): with the upstream
    probed ready, the same status, body and Content-Type as llama-server's own."""
    relay = await make_relay(url=llama_any.url, parallel=2, health_interval_s=5.0)
    await wait_for(lambda: relay.upstreams["llm"].health.probe == "ready", timeout=10)
    direct = await request(llama_any.port, "GET", "/health")
    via = await relayed(relay, "GET", "/health", None, "e2e-health")
    assert (via.status, via.body) == (direct.status, direct.body) == (200, b'{"status":"ok"}')
    assert via.header("content-type") == direct.header("content-type")


# ---- connection reuse ---------------------------------------------------------------------------
async def test_one_client_connection_many_requests(relay):
    """llama-server closes after every stream: the relay must not hand the client a dead
    pooled upstream connection, and keeps the client's connection open throughout."""
    port = relay.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    seq = [
        (CHAT, chat_body(max_tokens=8)),
        (CHAT, chat_body(max_tokens=8, stream=True)),
        (TEXT, text_body(STOP_TRIGGER_PROMPT, max_tokens=16, stream=True)),
        (CHAT, chat_body(max_tokens=8)),
        (CHAT, chat_body(max_tokens=8)),
        (NATIVE, text_body(STOP_TRIGGER_PROMPT, n_predict=16, stream=True)),
        (CHAT, chat_body(max_tokens=8, stream=True)),
    ]
    try:
        for path, body in seq:
            writer.write(build_request("POST", path, port, body))
            await writer.drain()
            resp = await read_response(reader)
            assert resp.status == 200, resp.raw[:500]
            if not body.get("stream"):
                assert resp.json()["choices"][0]["message"]["content"] == CHAT8
            elif path == CHAT:
                events = resp.sse_json()
                assert (
                    "".join(
                        e["choices"][0]["delta"].get("content") or ""
                        for e in events
                        if e["choices"]
                    )
                    == CHAT8
                )
            elif path == TEXT:
                assert "".join(e["choices"][0]["text"] for e in resp.sse_json()) == STOP_TEXT
            else:
                assert "".join(e["content"] for e in resp.sse_json()) == STOP_TEXT
    finally:
        writer.close()
    relay.store.flush()
    rows = relay.store.query("SELECT ok, fallback_attempts FROM request")
    assert rows == [{"ok": 1, "fallback_attempts": 0}] * len(seq)


async def test_pooled_connection_survives_llama_keepalive_timeout(relay):
    """llama-server drops an idle keep-alive connection after 5 s; the next request through
    the relay must still succeed (no 502, no error to the client)."""
    first = await relayed(relay, "POST", CHAT, chat_body(max_tokens=8), "e2e-pool-1")
    assert first.status == 200
    await asyncio.sleep(5.5)
    for i, body in enumerate((chat_body(max_tokens=8), chat_body(max_tokens=8, stream=True))):
        resp = await relayed(relay, "POST", CHAT, body, f"e2e-pool-{i + 2}")
        assert resp.status == 200, resp.raw[:500]
        r = await row(relay, f"e2e-pool-{i + 2}")
        assert r["ok"] == 1, r

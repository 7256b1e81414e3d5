"""Streams through the relay over real sockets: bytes unchanged, framing right, many at once."""

import asyncio
import random
import re
import sys

import pytest

from relay.http.chunked import frame
from tests.support import httpc
from tests.support.fakeup import Scripted, response_of
from tests.support.fixtures import FIXTURES
from tests.support.need import missing, need_extra


def split_head(raw: bytes) -> tuple[bytes, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, body


def replay(raw_response: bytes, pieces: int = 1, close: bool = True):
    """A script that answers every request with `raw_response`, written in `pieces` writes."""

    async def script(up, index, reader, writer):
        while await up.read_request(reader) is not None:
            rng = random.Random(index)
            cuts = sorted(rng.sample(range(1, len(raw_response)), pieces - 1)) if pieces > 1 else []
            last = 0
            for cut in cuts + [len(raw_response)]:
                writer.write(raw_response[last:cut])
                await writer.drain()
                last = cut
            if close:
                return

    return script


@pytest.mark.parametrize(
    "name",
    [
        "chat_stream.http",
        "chat_stream_usage.http",
        "completions_stream.http",
        "native_completion_stream.http",
    ],
)
@pytest.mark.parametrize("pieces", [1, 7])
async def test_captured_llama_stream_is_relayed_byte_for_byte(make_relay, name, pieces):
    raw = response_of((FIXTURES / name).read_bytes())
    up_head, up_body = split_head(raw)
    up = await Scripted(replay(raw, pieces)).start()
    app = await make_relay(url=up.url)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(8))
    assert resp.complete
    assert resp.raw_body == up_body  # chunk framing included: passed through untouched
    assert resp.status == 200
    # upstream headers cross verbatim, in order, minus hop-by-hop (Keep-Alive)
    crossed = [line for line in up_head.split(b"\r\n")[1:] if not line.startswith(b"Keep-Alive")]
    got = resp.raw_head.split(b"\r\n")
    assert got[1 : 1 + len(crossed)] == crossed
    assert resp.header("keep-alive") is None
    await up.stop()


async def test_thousand_event_stream_identical_through_relay_and_direct(make_relay):
    rng = random.Random(7)
    events = [
        b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i for i in range(1000)
    ]
    payload = b"".join(events) + b"data: [DONE]\n\n"
    # chunk boundaries fall anywhere, including inside events and markers
    chunks, pos = [], 0
    while pos < len(payload):
        n = rng.randint(1, 300)
        chunks.append(frame(payload[pos : pos + n]))
        pos += n
    raw = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(chunks) + b"0\r\n\r\n"
    )
    up = await Scripted(replay(raw, pieces=50)).start()
    app = await make_relay(url=up.url)
    direct = await httpc.fetch(up.port, "POST", "/v1/chat/completions", httpc.chat())
    relayed = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat())
    assert relayed.complete and direct.complete
    assert relayed.raw_body == direct.raw_body
    assert relayed.body == payload
    access = app.log.of("access")[-1]
    assert access["completion_tokens"] == 1000 and access["tokens_source"] == "approx"
    await up.stop()


async def test_simulator_stream_through_relay_matches_direct(make_relay, sim):
    app = await make_relay()
    # ids, times and measured timings differ per request; everything else must not
    mask = re.compile(rb'"(id|created)":("chatcmpl-[A-Za-z0-9]+"|\d+)|"timings":\{[^}]*\}')
    direct = await httpc.fetch(sim.port, "POST", "/v1/chat/completions", httpc.chat(40))
    relayed = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(40))
    assert relayed.complete
    assert mask.sub(b"", relayed.body) == mask.sub(b"", direct.body)
    assert relayed.raw_body.count(b"\r\n") == direct.raw_body.count(b"\r\n")  # same chunks
    assert relayed.data_events()[-1] == "[DONE]"
    assert (
        sum(
            1
            for e in relayed.data_events()
            if isinstance(e, dict) and e["choices"] and e["choices"][0]["delta"].get("content")
        )
        == 40
    )


async def test_openai_client_streams_through_relay(make_relay, sim):
    openai = need_extra("test", "openai")
    app = await make_relay()
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{app.port}/v1", api_key="sk-test", max_retries=0, timeout=10
    )
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    await client.close()
    assert (
        "".join(text) == httpc.sim_text(12) == "Hello from a tiny llama. Hello from a tiny llama."
    )
    assert finish == "length"
    assert usage.completion_tokens == 12
    # the relay checks no key here: the caller's reaches the upstream, which may check it
    assert [v for k, v in sim.requests[-1].headers if k.lower() == b"authorization"] == [
        b"Bearer sk-test"
    ]


async def test_request_id_generated_forwarded_and_echoed(make_relay, sim):
    app = await make_relay()
    given = await httpc.fetch(
        app.port,
        "POST",
        "/v1/chat/completions",
        httpc.chat(2),
        headers={"X-Request-Id": "abc-123", "Authorization": "Bearer sk-x"},
    )
    assert given.header("x-request-id") == "abc-123"
    sent = {k.lower(): v for k, v in sim.requests[-1].headers}
    assert sent[b"x-request-id"] == b"abc-123"
    assert sent[b"authorization"] == b"Bearer sk-x"  # no relay keys: the upstream checks it
    made = await httpc.fetch(app.port, "GET", "/props")
    rid = made.header("x-request-id")
    assert rid and re.fullmatch(r"[0-9a-f]{24}", rid)
    assert {k.lower(): v for k, v in sim.requests[-1].headers}[b"x-request-id"] == rid.encode()
    again = (await httpc.fetch(app.port, "GET", "/props")).header("x-request-id")
    assert re.fullmatch(r"[0-9a-f]{24}", again) and again != rid


async def test_upstream_auth_header_injected_from_environment(make_relay, sim, monkeypatch):
    from relay.config import UpstreamConfig

    monkeypatch.setenv("RELAY_TEST_UPSTREAM_KEY", "Bearer up-secret")
    app = await make_relay(
        upstreams=[
            UpstreamConfig(
                name="llm",
                url=sim.url,
                auth_header="Authorization",
                auth_value_env="RELAY_TEST_UPSTREAM_KEY",
            )
        ]
    )
    await httpc.fetch(
        app.port,
        "POST",
        "/v1/chat/completions",
        httpc.chat(2),
        headers={"Authorization": "Bearer client-secret"},
    )
    auth = [v for k, v in sim.requests[-1].headers if k.lower() == b"authorization"]
    assert auth == [b"Bearer up-secret"]
    assert "up-secret" not in repr(app.log.lines) and "client-secret" not in repr(app.log.lines)


async def test_http10_client_gets_dechunked_close_delimited_stream(make_relay, sim):
    app = await make_relay()
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(5), http="1.0")
    assert resp.header("transfer-encoding") is None
    assert resp.header("connection") == "close"
    assert resp.body.startswith(b"data: {") and resp.body.endswith(b"data: [DONE]\n\n")
    assert len(resp.data_events()) == 1 + 5 + 1 + 1  # role, tokens, finish, [DONE]


async def test_content_length_stream_passes_length_through(make_relay, sim):
    app = await make_relay()
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(4, content_length_stream=True)
    )
    assert resp.complete and resp.header("content-length") == str(len(resp.body))
    assert resp.header("transfer-encoding") is None
    assert resp.data_events()[-1] == "[DONE]"


async def test_keep_alive_on_both_sides(make_relay, sim):
    app = await make_relay()
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    first = await httpc.exchange(
        reader, writer, "POST", "/v1/chat/completions", httpc.chat(3, stream=False)
    )
    second = await httpc.exchange(
        reader, writer, "POST", "/v1/chat/completions", httpc.chat(3, stream=False)
    )
    third = await httpc.exchange(reader, writer, "GET", "/props")
    writer.close()
    assert [first.status, second.status, third.status] == [200, 200, 200]
    assert first.json()["usage"]["completion_tokens"] == 3
    assert [r.path for r in sim.requests][-1] == "/props"
    # one client connection, and one upstream connection reused for all three
    assert app.upstreams["llm"].pool.connects == 1
    assert sim.connections_opened == 1


async def test_pipelined_requests_are_answered_in_order(make_relay, sim):
    app = await make_relay()
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(httpc.build_request("GET", "/health") + httpc.build_request("GET", "/slots"))
    first = await httpc.read_head(reader)
    await httpc.read_body(reader, first, "GET")
    second = await httpc.read_head(reader)
    await httpc.read_body(reader, second, "GET")
    writer.close()
    assert first.json() == {"status": "ok"}
    assert isinstance(second.json(), list)


async def test_dead_pooled_connection_is_retried_once_on_a_fresh_one(make_relay):
    body = b'{"ok":true}'
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(body), body)
    )

    async def script(up, index, reader, writer):
        # answers once, keeps the connection open, then closes it unanswered on the next
        # request - like llama-server after a stream, or a keep-alive that just expired
        if await up.read_request(reader) is None:
            return
        writer.write(answer)
        await writer.drain()
        await up.read_request(reader)

    up = await Scripted(script).start()
    app = await make_relay(url=up.url)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    a = await httpc.exchange(reader, writer, "POST", "/v1/chat/completions", httpc.chat(1, False))
    b = await httpc.exchange(reader, writer, "POST", "/v1/chat/completions", httpc.chat(1, False))
    writer.close()
    assert (a.status, a.body, b.status, b.body) == (200, body, 200, body)
    assert (
        up.connections == 2 and len(up.heads) == 3
    )  # the dead one got the request, then a fresh one
    await up.stop()


async def test_two_hundred_concurrent_streams_all_correct(make_relay, sim):
    app = await make_relay()

    async def one(i):
        resp = await httpc.fetch(
            app.port, "POST", "/v1/chat/completions", httpc.chat(20, interval_ms=5), timeout=30
        )
        events = resp.data_events()
        tokens = "".join(
            e["choices"][0]["delta"].get("content") or ""
            for e in events
            if isinstance(e, dict) and e["choices"]
        )
        return resp.complete, resp.status, tokens, events[-1]

    results = await asyncio.gather(*(one(i) for i in range(200)))
    expected = httpc.sim_text(20)
    assert all(r == (True, 200, expected, "[DONE]") for r in results), results[:3]
    access = app.log.of("access")
    assert len(access) == 200 and {a["outcome"] for a in access} == {"done"}
    assert sim.tokens_sent_total == 200 * 20


async def test_suite_runs_on_uvloop_where_it_is_a_dependency():
    if sys.platform != "linux":
        missing("needs uvloop, a dependency on Linux only (pyproject.toml)")
    import uvloop

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)

"""An upstream that stalls mid-line inside the event that ends its stream, through the relay
(issue 31, items 4 and 11): the bytes the client gets hold no end and no figure the upstream
did not send, and exactly one end, the relay's, in the API's own shape (Responses' sequence
numbers increasing); each SDK's consumer ends on the relay's end, never on a forged one. A
stream without content has no `last_content_ms`."""

from __future__ import annotations

import pytest

from relay.stream import dialect as D
from tests.stream import spellings as S
from tests.stream.sse_client import check_cut, read, view
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import rows_of
from tests.support.need import need_extra

anthropic = need_extra("test", "anthropic")
openai = need_extra("test", "openai")

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
PATHS = {
    D.CHAT: "/v1/chat/completions",
    D.TEXT: "/v1/completions",
    D.NATIVE: "/completion",
    D.MESSAGES: "/v1/messages",
    D.RESPONSES: "/v1/responses",
}
STREAMS = S.STREAMS
REQUEST = {"model": "m", "stream": True, "max_tokens": 16}
MESSAGES_REQ = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def stalling(body: bytes) -> Scripted:
    """An upstream answering every request with `body` in one chunk, then nothing: it keeps
    the connection until the relay gives up on it."""

    async def script(up, index, reader, writer):
        if await up.read_request(reader) is None:
            return
        writer.write(HEAD + chunk(body))
        await writer.drain()
        await reader.read()

    return Scripted(script)


async def relay_for(make_relay, body: bytes):
    up = await stalling(body).start()
    return await make_relay(up.url, stream_idle_timeout_s=0.3, stream_total_timeout_s=0)


def cut_after(body: bytes, marker: bytes, within: bytes | None = None) -> int:
    """Where a cut just after `marker` (in the last event holding `within`) falls."""
    start = body.rindex(within) if within is not None else 0
    return body.index(marker, start) + len(marker)


# (api, marker the upstream stops right after, inside the last events)
CUTS = [
    (D.CHAT, b'"completion_tokens":1'),
    (D.CHAT, b'"finish_reason":"st'),
    (D.TEXT, b'"completion_tokens":1'),
    (D.NATIVE, b'"stop":tr'),
    (D.NATIVE, b'"predicted_n":1'),
    (D.MESSAGES, b'"output_tokens":1'),
    (D.RESPONSES, b'"status":"comp'),
    (D.RESPONSES, b'"output_tokens":1'),
]


@pytest.mark.parametrize("api,marker", CUTS)
async def test_a_stall_inside_the_ending_event(make_relay, api, marker):
    body, start = STREAMS[api]()
    cut = body.rindex(marker) + len(marker)
    assert cut > start
    app = await relay_for(make_relay, body[:cut])
    resp = await httpc.fetch(app.port, "POST", PATHS[api], REQUEST)
    assert resp.status == 200 and resp.complete
    assert resp.body.startswith(body[:cut])
    seen = check_cut(api, body, cut, resp.body[cut:])
    end = seen[-1]
    # the one end is the relay's, in the API's shape
    if api in (D.CHAT, D.TEXT):
        assert end[0].data == "[DONE]" and seen[-2][1].relay
        assert seen[-2][1].doc["choices"][0]["finish_reason"] == "length"
    elif api == D.NATIVE:
        assert end[1].relay and end[1].doc["stop_type"] == "limit"
    elif api == D.MESSAGES:
        assert end[1].kind == "message_stop"
        [delta] = [v for _, v in seen if v.kind == "message_delta"]
        assert delta.relay and delta.doc["delta"]["stop_reason"] == "max_tokens"
    else:
        assert end[1].kind == "response.incomplete" and end[1].relay
    [row] = await rows_of(app, 1)
    assert (row["ok"], row["error_code"]) == (0, "stream_stall_idle")


async def test_a_half_done_is_left_as_it_came_and_the_relays_frame_ends(make_relay):
    body, _ = S.chat()
    cut = body.rindex(b"data: [DO") + len(b"data: [DO")
    app = await relay_for(make_relay, body[:cut])
    resp = await httpc.fetch(app.port, "POST", PATHS[D.CHAT], REQUEST)
    assert resp.body.startswith(body[:cut] + b"\n\n") and resp.complete
    events = read(resp.body)
    assert [e.data for e in events].count("[DONE]") == 1 and events[-1].data == "[DONE]"
    assert events[-3].data == "[DO" and view(D.CHAT, events[-2]).relay


# ---- what each SDK's consumer ends with --------------------------------------------------------
def oclient(port: int):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)


@pytest.mark.parametrize("marker", [b'"status":"comp', b'"output_tokens":1'])
async def test_the_openai_sdks_responses_never_end_on_a_forged_completion(make_relay, marker):
    body, _ = S.responses()
    cut = cut_after(body, marker, b"response.completed")
    app = await relay_for(make_relay, body[:cut])
    client = oclient(app.port)
    events = [e async for e in await client.responses.create(model="m", input="Hi", stream=True)]
    kinds = [e.type for e in events]
    assert "response.completed" not in kinds and kinds[-1] == "response.incomplete"
    last = events[-1]
    assert last.response.status == "incomplete" and last.response.usage.output_tokens == 3
    assert last.sequence_number == 9  # after the dropped event's 8
    async with client.responses.stream(model="m", input="Hi") as stream:
        async for _ in stream:
            pass
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            await stream.get_final_response()  # no completion, not a forged one


async def test_the_openai_sdks_chat_gets_no_forged_usage(make_relay):
    body, _ = S.chat()
    cut = cut_after(body, b'"completion_tokens":1')
    app = await relay_for(make_relay, body[:cut])
    chunks = [
        c
        async for c in await oclient(app.port).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    ]
    assert [c.usage for c in chunks if c.usage is not None] == []
    pieces = [c.choices[0].delta.content for c in chunks if c.choices]
    assert "".join(p or "" for p in pieces).startswith("Hello there")
    assert "[relay] stall guard: idle" in pieces[-1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-2:] == ["stop", "length"]


def aclient(port: int):
    return anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key="k", max_retries=0)


async def test_the_anthropic_sdk_ends_on_the_relays_message_delta(make_relay):
    body, _ = S.messages()
    cut = cut_after(body, b'"output_tokens":1', b"message_delta")
    app = await relay_for(make_relay, body[:cut])
    async with aclient(app.port).messages.stream(**MESSAGES_REQ) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_message()
    assert kinds.count("message_delta") == 1 and kinds.count("message_stop") == 1
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3
    assert final.content[0].text == "Hello there"


@pytest.mark.parametrize("where", ["before", "in its name", "in its data"])
async def test_a_stall_after_message_delta(make_relay, where):
    # the upstream's message_delta went out whole: its stop reason and usage stand, and the
    # relay's message_stop alone ends the message (no second message_delta, no forged usage)
    body, _ = S.messages()
    stop = body.rindex(b"event: message_stop")
    cut = {"before": stop, "in its name": stop + 10, "in its data": len(body) - 4}[where]
    app = await relay_for(make_relay, body[:cut])
    resp = await httpc.fetch(app.port, "POST", PATHS[D.MESSAGES], REQUEST)
    seen = check_cut(D.MESSAGES, body, cut, resp.body[cut:])
    kinds = [v.kind for _, v in seen]
    assert kinds.count("message_delta") == 1 and kinds.count("message_stop") == 1
    [delta] = [v for _, v in seen if v.kind == "message_delta"]
    assert not delta.relay and delta.doc["usage"] == {"output_tokens": 10}
    assert seen[-1][1].doc["x_relay_stall"]["reason"] == "idle"
    async with aclient(app.port).messages.stream(**MESSAGES_REQ) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 10


# ---- last_content_ms ---------------------------------------------------------------------------
def whole(body: bytes) -> Scripted:
    async def script(up, index, reader, writer):
        if await up.read_request(reader) is None:
            return
        writer.write(HEAD + chunk(body) + b"0\r\n\r\n")
        await writer.drain()

    return Scripted(script)


@pytest.mark.parametrize("stalls", [False, True])
async def test_a_stream_without_content_has_no_last_content_time(make_relay, stalls):
    body, start = S.responses()
    # its created and output item events, then (whole) its end: no delta
    events = body[:start].split(b"\n\n")
    body = b"\n\n".join(e for e in events if b".delta" not in e) + body[start:]
    if stalls:
        body = body[: cut_after(body, b'"status":"comp')]
    up = await (stalling(body) if stalls else whole(body)).start()
    app = await make_relay(up.url, stream_idle_timeout_s=0.3, stream_total_timeout_s=0)
    resp = await httpc.fetch(app.port, "POST", PATHS[D.RESPONSES], REQUEST)
    assert resp.status in (200, 502, 504)
    [row] = await rows_of(app, 1)
    assert row["ttft_ms"] is None and row["last_content_ms"] is None
    assert row["e2e_ms"] is not None

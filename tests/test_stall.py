"""The stall guard over real sockets: every reason, every shape, exact bytes at the end."""

import asyncio
import json

from tests import httpc

TAIL = b"data: [DONE]\n\n"


def synthetic(resp) -> dict:
    """The one synthetic event: the last event before [DONE]."""
    body = resp.body
    assert body.endswith((b"\n\n" + TAIL, TAIL))
    assert body.count(b"data: [DONE]") == 1
    events = resp.events()
    assert events[-1].strip(b"\n") == b"data: [DONE]"
    return json.loads(events[-2].strip(b"\n")[len(b"data: ") :])


async def test_idle_stall_ends_stream_with_chat_frame(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(50, model="tiny-model", stall_after=3)
    )
    assert resp.status == 200 and resp.complete  # ended cleanly: terminating chunk present
    frame = synthetic(resp)
    assert list(frame) == ["id", "object", "created", "model", "choices", "x_relay_stall"]
    assert frame["id"] == "relay-stall-guard" and frame["object"] == "chat.completion.chunk"
    assert frame["model"] == "tiny-model"
    stall = frame["x_relay_stall"]
    assert stall["reason"] == "idle" and stall["upstream"] == "llm"
    assert 0.2 <= stall["elapsed_s"] < 1.0
    choice = frame["choices"][0]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert choice["delta"] == {
        "role": "assistant",
        "content": f"\n\n[relay] stall guard: idle after {stall['elapsed_s']}s",
    }
    tokens = [
        e
        for e in resp.data_events()
        if isinstance(e, dict)
        and e["choices"]
        and e["choices"][0].get("delta", {}).get("content")
        and e["id"] != "relay-stall-guard"
    ]
    assert len(tokens) == 3
    # the guard closed the upstream connection, and logged the trip
    await asyncio.wait_for(sim.requests[-1].closed.wait(), 2)
    trip = app.log.of("stream_stall_guard_tripped")
    assert [(t["reason"], t["upstream"], t["request_id"]) for t in trip] == [
        ("idle", "llm", resp.header("x-request-id"))
    ]
    assert trip[0]["elapsed_s"] == stall["elapsed_s"]
    access = app.log.of("access")[-1]
    assert access["error_code"] == "stream_stall_idle" and access["completion_tokens"] == 3


async def test_total_stall_cuts_a_chatty_stream(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0, stream_total_timeout_s=0.3)
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(model="m", chatty=True, interval_ms=10)
    )
    frame = synthetic(resp)
    assert frame["x_relay_stall"]["reason"] == "total"
    assert 0.3 <= frame["x_relay_stall"]["elapsed_s"] < 1.5
    assert resp.complete
    await asyncio.wait_for(sim.requests[-1].closed.wait(), 2)
    assert sim.requests[-1].peer_closed_at is not None


async def test_read_reason_when_both_bounds_are_zero(make_relay, sim):
    app = await make_relay(
        stream_idle_timeout_s=0, stream_total_timeout_s=0, direct_read_timeout_s=0.25
    )
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(10, stall_after=2)
    )
    frame = synthetic(resp)
    assert frame["x_relay_stall"]["reason"] == "read"
    assert frame["x_relay_stall"]["elapsed_s"] >= 0.25


async def test_idle_beats_total_when_it_comes_first(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.15, stream_total_timeout_s=5)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(9, stall_after=1))
    assert synthetic(resp)["x_relay_stall"]["reason"] == "idle"


async def test_stall_in_the_middle_of_a_data_line(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(9, stall_after=2, stall_mid_line=True)
    )
    body = resp.body
    # the half line is followed by the blank line, then the synthetic event
    cut = body.index(b'\n\ndata: {"id":"relay-stall-guard"')
    before = body[:cut]
    half = before[before.rindex(b"\n\n") + 2 :]
    assert half.startswith(b"data: {") and not half.endswith(b"}")
    assert resp.complete
    assert synthetic(resp)["x_relay_stall"]["reason"] == "idle"


async def test_stall_in_the_middle_of_a_chunk(make_relay, sim):
    """The upstream announced a chunk and sent half of it: the owed bytes are filled."""
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(9, stall_after=2, stall_mid_chunk=True)
    )
    assert resp.complete  # strict de-chunking succeeded: the framing is valid
    frame = synthetic(resp)
    assert frame["x_relay_stall"]["reason"] == "idle"
    body = resp.body
    cut = body.index(b'data: {"id":"relay-stall-guard"')
    # half an event, then only newlines (padding + the blank line) before the synthetic one
    head = body[:cut].rstrip(b"\n")
    assert head.endswith(b"}") is False and body[len(head) : cut].strip(b"\n") == b""
    assert body[len(head) : cut].count(b"\n") >= 2


async def test_legacy_completions_shape(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    body = {
        "model": "legacy",
        "prompt": "How are you?",
        "max_tokens": 9,
        "stream": True,
        "sim": {"stall_after": 2},
    }
    resp = await httpc.fetch(app.port, "POST", "/v1/completions", body)
    frame = synthetic(resp)
    assert frame["object"] == "text_completion"
    choice = frame["choices"][0]
    assert "delta" not in choice
    assert (
        choice["text"]
        == f"\n\n[relay] stall guard: idle after {frame['x_relay_stall']['elapsed_s']}s"
    )
    assert choice["finish_reason"] == "length"


async def test_native_completion_gets_done_only_after_a_stall_frame(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    ok = await httpc.fetch(
        app.port, "POST", "/completion", {"prompt": "Say hi", "n_predict": 3, "stream": True}
    )
    assert b"[DONE]" not in ok.body and ok.complete
    stalled = await httpc.fetch(
        app.port,
        "POST",
        "/completion",
        {"prompt": "Say hi", "n_predict": 9, "stream": True, "sim": {"stall_after": 1}},
    )
    assert synthetic(stalled)["object"] == "text_completion"


async def test_non_sse_body_is_cut_with_nothing_injected(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(
        app.port,
        "POST",
        "/v1/chat/completions",
        {"sim": {"body_kind": "octet", "tokens": 9, "stall_after": 3}},
    )
    assert resp.status == 200
    assert resp.header("content-type") == "application/octet-stream"
    assert not resp.complete  # no terminating chunk: the client can tell it was cut
    direct = sim.requests[-1]
    await asyncio.wait_for(direct.closed.wait(), 2)
    assert b"relay" not in resp.body and b"[DONE]" not in resp.body
    assert app.log.of("stream_stall_guard_tripped")[0]["reason"] == "idle"
    assert app.log.of("access")[-1]["error_code"] == "stream_stall_idle"


async def test_stall_before_first_content_still_ends_cleanly(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.2, stream_total_timeout_s=0)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(5, stall_after=0))
    assert resp.status == 200 and resp.complete
    events = resp.data_events()
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert events[1]["id"] == "relay-stall-guard" and events[2] == "[DONE]" and len(events) == 3


async def test_keep_alive_survives_a_stall(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=0.15, stream_total_timeout_s=0)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    first = await httpc.exchange(
        reader, writer, "POST", "/v1/chat/completions", httpc.chat(5, stall_after=1)
    )
    second = await httpc.exchange(reader, writer, "GET", "/health")
    writer.close()
    assert first.complete and synthetic(first)["x_relay_stall"]["reason"] == "idle"
    assert second.json() == {"status": "ok"}

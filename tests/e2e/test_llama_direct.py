"""The real llama-server, spoken to directly over raw asyncio sockets.

These pin down the upstream facts the relay is built on (see tests/support/captures/llama-server):
deterministic text from the tiny model, SSE framing, connection close after streams.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from .rawhttp import build_request, read_head, read_response, request
from .tiny_gguf import STOP_TEXT, STOP_TRIGGER_PROMPT

pytestmark = pytest.mark.e2e

CHAT8 = "Hello from a tiny llama. Hello from"  # 8 tokens
CHAT_HI = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 8}


def assert_stream_headers(resp) -> None:
    assert resp.status == 200, resp.raw[:2000]
    assert resp.header("content-type") == "text/event-stream"
    assert resp.header("transfer-encoding") == "chunked"
    assert resp.header("x-accel-buffering") == "no"
    assert resp.header("keep-alive") == "timeout=5, max=100"
    assert resp.header("connection") is None
    assert resp.header("content-length") is None


def chat_text(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


async def test_health_keeps_connection_open(llama_server):
    resp = await request(llama_server.port, "GET", "/health", check_close=True)
    assert resp.status == 200 and resp.json() == {"status": "ok"}
    assert resp.header("keep-alive") == "timeout=5, max=100"
    assert resp.closed is False  # non-streamed: kept alive


async def test_nonstream_reuses_connection(llama_server):
    port = llama_server.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(2):
            writer.write(build_request("POST", "/v1/chat/completions", port, CHAT_HI))
            await writer.drain()
            resp = await read_response(reader)
            assert resp.status == 200
            body = resp.json()
            assert body["choices"][0]["message"]["content"] == CHAT8
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 8
            assert int(resp.header("content-length")) == len(resp.body)
    finally:
        writer.close()


async def test_chat_stream_length(llama_server):
    resp = await request(
        llama_server.port,
        "POST",
        "/v1/chat/completions",
        {**CHAT_HI, "stream": True},
        check_close=True,
    )
    assert_stream_headers(resp)
    data = resp.sse_data()
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert events[0]["object"] == "chat.completion.chunk"
    # the first HTTP chunk carries the role-only event and the first content event together
    first_chunk = resp.sse_data(resp.chunks[0])
    assert len(first_chunk) == 2 and json.loads(first_chunk[1])["choices"][0]["delta"] == {
        "content": "Hello"
    }
    assert chat_text(events) == CHAT8
    final = events[-1]
    assert final["choices"][0] == {"finish_reason": "length", "index": 0, "delta": {}}
    assert final["timings"]["predicted_n"] == 8
    assert {"prompt_n", "predicted_per_second", "cache_n"} <= final["timings"].keys()
    assert "usage" not in final and all(e["choices"] for e in events)  # no usage event
    assert len({e["id"] for e in events}) == 1
    assert resp.closed is True  # server closes after every stream


async def test_chat_stream_include_usage(llama_server):
    resp = await request(
        llama_server.port,
        "POST",
        "/v1/chat/completions",
        {**CHAT_HI, "stream": True, "stream_options": {"include_usage": True}},
        check_close=True,
    )
    assert_stream_headers(resp)
    data = resp.sse_data()
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert chat_text(events) == CHAT8
    finish, usage = events[-2], events[-1]
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 8
    assert usage["usage"]["total_tokens"] == (usage["usage"]["prompt_tokens"] + 8)
    assert (finish.get("timings") or usage["timings"])["predicted_n"] == 8
    assert resp.closed is True


async def test_chat_stream_stop_word(llama_server):
    resp = await request(
        llama_server.port,
        "POST",
        "/v1/chat/completions",
        {**CHAT_HI, "stream": True, "stop": ["."]},
        check_close=True,
    )
    events = resp.sse_json()
    assert chat_text(events) == "Hello from a tiny llama"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert resp.sse_data()[-1] == "[DONE]"


async def test_chat_stream_eos_via_assistant_prefill(llama_server):
    body = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well?"}],
        "max_tokens": 16,
        "stream": True,
    }
    resp = await request(llama_server.port, "POST", "/v1/chat/completions", body, check_close=True)
    assert_stream_headers(resp)
    events = resp.sse_json()
    # llama-server streams the prefilled assistant text again, then the continuation
    assert chat_text(events) == "Well?" + STOP_TEXT
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["timings"]["predicted_n"] == 5  # 4 text tokens + EOS
    assert resp.sse_data()[-1] == "[DONE]" and resp.closed is True


async def test_completions_stream_eos_stop(llama_server):
    resp = await request(
        llama_server.port,
        "POST",
        "/v1/completions",
        {"prompt": STOP_TRIGGER_PROMPT, "max_tokens": 16, "stream": True},
        check_close=True,
    )
    assert_stream_headers(resp)
    data = resp.sse_data()
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert all(e["object"] == "text_completion" for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == STOP_TEXT
    final = events[-1]
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["usage"]["completion_tokens"] == 5 and final["timings"]["predicted_n"] == 5
    assert resp.closed is True


async def test_completions_stream_length_has_usage(llama_server):
    resp = await request(
        llama_server.port,
        "POST",
        "/v1/completions",
        {"prompt": "Say hi", "max_tokens": 5, "stream": True},
        check_close=True,
    )
    data = resp.sse_data()
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == " Hello from a tiny llama"
    final = events[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 5  # always, even without include_usage
    assert final["timings"]["predicted_n"] == 5
    assert resp.closed is True


async def test_completions_nonstream_stop(llama_server):
    resp = await request(
        llama_server.port,
        "POST",
        "/v1/completions",
        {"prompt": STOP_TRIGGER_PROMPT, "max_tokens": 16},
        check_close=True,
    )
    body = resp.json()
    assert body["choices"][0]["text"] == STOP_TEXT
    assert body["choices"][0]["finish_reason"] == "stop"
    assert resp.closed is False


async def test_native_completion_stream_has_no_done(llama_server):
    resp = await request(
        llama_server.port,
        "POST",
        "/completion",
        {"prompt": "Say hi", "n_predict": 3, "stream": True},
        check_close=True,
    )
    assert_stream_headers(resp)
    data = resp.sse_data()
    assert "[DONE]" not in data
    events = [json.loads(d) for d in data]
    assert "".join(e["content"] for e in events) == " Hello from a"
    assert [e["stop"] for e in events] == [False, False, False, True]
    assert events[-1]["stop_type"] == "limit" and events[-1]["timings"]["predicted_n"] == 3
    assert resp.closed is True

    resp = await request(
        llama_server.port,
        "POST",
        "/completion",
        {"prompt": STOP_TRIGGER_PROMPT, "n_predict": 16, "stream": True},
        check_close=True,
    )
    events = [json.loads(d) for d in resp.sse_data()]
    assert "".join(e["content"] for e in events) == STOP_TEXT
    assert events[-1]["stop_type"] == "eos"


async def test_deterministic_at_high_temperature(llama_server):
    body = {
        **CHAT_HI,
        "max_tokens": 13,
        "temperature": 2.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "seed": 123,
    }
    resp = await request(llama_server.port, "POST", "/v1/chat/completions", body)
    content = resp.json()["choices"][0]["message"]["content"]
    assert content == "Hello from a tiny llama. Hello from a tiny llama. Hello"


async def test_slots(llama_server):
    resp = await request(llama_server.port, "GET", "/slots")
    slots = resp.json()
    assert [s["id"] for s in slots] == [0, 1]
    assert all(s["n_ctx"] == 2048 for s in slots)  # -c 4096 split over -np 2


async def test_props(llama_server):
    props = (await request(llama_server.port, "GET", "/props")).json()
    assert props["total_slots"] == 2
    assert props["bos_token"] == "<s>" and props["eos_token"] == "</s>"
    assert "<|im_start|>" in props["chat_template"]
    assert props["default_generation_settings"]["n_ctx"] == 2048


async def test_tokenize_roundtrip(llama_server):
    port = llama_server.port
    resp = await request(
        port, "POST", "/tokenize", {"content": "Hello from a tiny llama.", "with_pieces": True}
    )
    pieces = [t["piece"] for t in resp.json()["tokens"]]
    assert pieces == [" Hello", " from", " a", " tiny", " llama", "."]
    ids = [t["id"] for t in resp.json()["tokens"]]
    resp = await request(port, "POST", "/detokenize", {"tokens": ids})
    assert resp.json()["content"].strip() == "Hello from a tiny llama."
    # any text tokenizes thanks to byte fallback
    resp = await request(port, "POST", "/tokenize", {"content": "Zürich ✓"})
    assert len(resp.json()["tokens"]) > 0


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


async def test_metrics_count_streamed_tokens(llama_server):
    port = llama_server.port
    before = await request(port, "GET", "/metrics")
    assert before.status == 200 and before.header("content-type").startswith("text/plain")
    n0 = _metric(before.body.decode(), "llamacpp:tokens_predicted_total")
    resp = await request(
        port,
        "POST",
        "/v1/chat/completions",
        {**CHAT_HI, "max_tokens": 11, "stream": True},
        check_close=True,
    )
    predicted = resp.sse_json()[-1]["timings"]["predicted_n"]
    assert predicted == 11
    after = await request(port, "GET", "/metrics")
    n1 = _metric(after.body.decode(), "llamacpp:tokens_predicted_total")
    assert n1 - n0 == predicted


async def test_prompt_over_context_is_json_4xx(llama_server):
    prompt = "a " * 5000
    resp = await request(
        llama_server.port,
        "POST",
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 4, "stream": True},
        check_close=True,
    )
    assert 400 <= resp.status < 500
    assert resp.header("content-type").startswith("application/json")
    err = resp.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 2048
    assert err["n_prompt_tokens"] > 2048
    assert resp.header("connection") == "close" and resp.closed is True


async def test_unknown_path_404(llama_server):
    resp = await request(llama_server.port, "GET", "/nope")
    assert resp.status == 404 and resp.json()["error"]["type"] == "not_found_error"
    assert resp.header("connection") == "close"


async def test_client_disconnect_frees_slot(llama_server):
    port = llama_server.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 1000000, "stream": True}
    writer.write(build_request("POST", "/v1/chat/completions", port, body))
    await writer.drain()
    status, _, _, _ = await read_head(reader)
    assert status == 200
    await asyncio.wait_for(reader.read(4096), 10)  # some events arrived
    writer.close()
    for _ in range(100):
        slots = (await request(port, "GET", "/slots")).json()
        if not any(s["is_processing"] for s in slots):
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail(f"slot still busy after disconnect: {slots}")
    # and the server still serves
    resp = await request(port, "POST", "/v1/chat/completions", CHAT_HI)
    assert resp.json()["choices"][0]["message"]["content"] == CHAT8

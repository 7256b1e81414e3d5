"""The built-in simulator (relay.sim) against the real llama-server, STRUCTURALLY.

The same request goes to both; each response is reduced to what a client or relay can depend
on and the reductions must be equal, so the simulator cannot drift from the real server:

* status, and the response header names in order with their values (Content-Length, which
  follows the body, and Date-like headers excepted);
* per HTTP chunk (a Content-Length body counts as one chunk), the list of SSE events in it,
  each event either ``"[DONE]"`` or its JSON "shape": every key path in order with its value
  type; framing-relevant values (``object``, ``finish_reason``, ``role``, ``stop``,
  ``stop_type``, ...) are compared as values too, and where the tiny model and the simulator
  produce the same text (length-limited runs, stop words) so are the generated strings and
  token counts;
* whether the server closed the connection right after the response.

Where the real model's output cannot be imitated by the simulator from the request alone
(EOS after a prompt ending in "?"), the request carries ``"sim": {...}`` knobs (llama-server
ignores unknown fields) and only the model-dependent strings/counts are left out.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

from .rawhttp import RawResponse, request

pytestmark = pytest.mark.e2e


# Values compared exactly whatever the model: they are framing, not generated text.
FRAMING_KEYS = {
    "object",
    "finish_reason",
    "role",
    "stop",
    "stop_type",
    "index",
    "logprobs",
    "has_new_line",
    "truncated",
    "choices",
}
# Generated text / counts: compared only where the simulator models the tiny model's output.
MODEL_KEYS = {
    "content",
    "text",
    "completion_tokens",
    "predicted_n",
    "tokens_predicted",
    "stopping_word",
}
# Objects whose inner keys follow the llama.cpp build (sampler settings): only their presence
# and position count.
OPAQUE_KEYS = {"generation_settings"}
# Header values that legitimately vary (lower-case names); the NAMES are still compared.
VARIABLE_HEADERS = {"content-length", "date", "process-start-time-unix"}


def json_pairs(text: str) -> Any:
    """JSON with object key order kept (a list of (key, value) pairs per object)."""
    return json.loads(text, object_pairs_hook=lambda pairs: ("__obj__", pairs))


def shape(value: Any, same_model: bool, path: str = "$", key: str = "") -> list[tuple]:
    """Key paths in order with value types (and the values that must match)."""
    if isinstance(value, tuple) and value and value[0] == "__obj__":
        out: list[tuple] = [(path, "object")]
        if key in OPAQUE_KEYS:
            return out
        for k, v in value[1]:
            out += shape(v, same_model, f"{path}.{k}", k)
        return out
    if isinstance(value, list):
        out = [(path, "array", len(value)) if key in FRAMING_KEYS else (path, "array")]
        for i, v in enumerate(value):
            out += shape(v, same_model, f"{path}[{i}]", key)
        return out
    typ = {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}[type(value)]
    if key in FRAMING_KEYS or (same_model and key in MODEL_KEYS):
        return [(path, typ, value)]
    return [(path, typ)]


def reduce(resp: RawResponse, same_model: bool) -> dict:
    """The structural summary that the simulator and the real server must share."""
    headers = [(k, "<variable>" if k in VARIABLE_HEADERS else v) for k, v in resp.headers]
    sse = resp.header("content-type") == "text/event-stream"
    chunks = resp.chunks if resp.chunks is not None else [resp.body]
    per_chunk = []
    for payload in chunks:
        if sse:
            datas = resp.sse_data(payload)
        else:
            datas = [payload.decode()] if payload else []
        events = []
        for d in datas:
            if d == "[DONE]":
                events.append("[DONE]")
            elif sse or (resp.header("content-type") or "").startswith("application/json"):
                events.append(shape(json_pairs(d), same_model))
            else:
                events.append(("<opaque>", len(d.splitlines())))
        per_chunk.append(events)
    return {"status": resp.status, "headers": headers, "chunks": per_chunk, "closed": resp.closed}


def explain(real: dict, sim: dict) -> str:
    """A short account of the first structural difference (pytest's dict diff is unreadable)."""
    lines = []
    for k in ("status", "headers", "closed"):
        if real[k] != sim[k]:
            lines.append(f"{k}: real={real[k]!r}\n{' ' * len(k)}   sim={sim[k]!r}")
    rc, sc = real["chunks"], sim["chunks"]
    if len(rc) != len(sc):
        lines.append(
            f"HTTP chunks: real {len(rc)}, sim {len(sc)}; events per chunk: "
            f"real {[len(c) for c in rc]}, sim {[len(c) for c in sc]}"
        )
    for i, (a, b) in enumerate(zip(rc, sc)):
        if a == b:
            continue
        lines.append(f"chunk {i}: real {len(a)} event(s), sim {len(b)}")
        for j, (ea, eb) in enumerate(zip(a, b)):
            if ea == eb:
                continue
            if isinstance(ea, list) and isinstance(eb, list):
                only_r = [t for t in ea if t not in eb]
                only_s = [t for t in eb if t not in ea]
                lines.append(
                    f"  event {j}: only real: {only_r[:8]}{' ...' if len(only_r) > 8 else ''}"
                )
                lines.append(
                    f"  event {j}: only sim:  {only_s[:8]}{' ...' if len(only_s) > 8 else ''}"
                )
                if not only_r and not only_s:
                    lines.append(f"  event {j}: same paths, different order")
            else:
                lines.append(f"  event {j}: real={str(ea)[:200]} sim={str(eb)[:200]}")
        break
    return "\n".join(lines) or "equal"


class SimDrift(AssertionError):
    """The simulator's response differs structurally from the real server's."""


@dataclass
class Case:
    method: str
    path: str
    body: dict | None = None
    same_model: bool = True  # the simulator produces the model's exact text for this request


CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
NATIVE = "/completion"


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "Hi there"}], **kw}


# Assistant prefill ending in "?" -> " Fine, thanks!" + EOS (see tiny_gguf); the simulator
# stops after 4 content events when told so.
CHAT_EOS = {
    "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well?"}],
    "max_tokens": 16,
    "stream": True,
    "sim": {"tokens": 4},
}

CASES = {
    "chat_stream_length": Case("POST", CHAT, chat(max_tokens=4, stream=True)),
    "chat_stream_length_long": Case("POST", CHAT, chat(max_tokens=13, stream=True)),
    "chat_stream_include_usage": Case(
        "POST", CHAT, chat(max_tokens=4, stream=True, stream_options={"include_usage": True})
    ),
    "chat_stream_include_usage_false": Case(
        "POST", CHAT, chat(max_tokens=4, stream=True, stream_options={"include_usage": False})
    ),
    "chat_stream_stop_word": Case("POST", CHAT, chat(max_tokens=16, stream=True, stop=["."])),
    "chat_stream_stop_word_usage": Case(
        "POST",
        CHAT,
        chat(max_tokens=16, stream=True, stop=["."], stream_options={"include_usage": True}),
    ),
    "chat_stream_eos": Case("POST", CHAT, CHAT_EOS, same_model=False),
    "chat_nonstream": Case("POST", CHAT, chat(max_tokens=4)),
    "completions_stream_length": Case(
        "POST", TEXT, {"prompt": "Say hi", "max_tokens": 4, "stream": True}
    ),
    "completions_stream_include_usage": Case(
        "POST",
        TEXT,
        {
            "prompt": "Say hi",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "completions_stream_eos": Case(
        "POST",
        TEXT,
        {
            "prompt": "How are you?",
            "max_tokens": 16,
            "stream": True,
            "sim": {"tokens": 4, "eos_event": True},
        },
        same_model=False,
    ),
    "completions_stream_stop_word": Case(
        "POST", TEXT, {"prompt": "Say hi", "max_tokens": 16, "stream": True, "stop": ["."]}
    ),
    "completions_nonstream": Case("POST", TEXT, {"prompt": "Say hi", "max_tokens": 4}),
    "native_stream_length": Case(
        "POST", NATIVE, {"prompt": "Say hi", "n_predict": 3, "stream": True}
    ),
    "native_stream_eos": Case(
        "POST",
        NATIVE,
        {"prompt": "How are you?", "n_predict": 16, "stream": True, "sim": {"tokens": 4}},
        same_model=False,
    ),
    "native_stream_stop_word": Case(
        "POST", NATIVE, {"prompt": "Say hi", "n_predict": 16, "stream": True, "stop": ["."]}
    ),
    "native_nonstream": Case("POST", NATIVE, {"prompt": "Say hi", "n_predict": 3}),
    "health": Case("GET", "/health"),
    "models": Case("GET", "/v1/models"),
    "unknown_path_404": Case("GET", "/nope"),
}


async def both(llama_server, sim, case: Case) -> tuple[RawResponse, RawResponse]:
    real, fake = await asyncio.gather(
        *(
            request(port, case.method, case.path, case.body, check_close=True)
            for port in (llama_server.port, sim.port)
        )
    )
    return real, fake


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
async def test_sim_matches_real_structurally(llama_server, sim, case: Case):
    real, fake = await both(llama_server, sim, case)
    assert real.status < 500, real.raw[:1000]
    r, s = reduce(real, case.same_model), reduce(fake, case.same_model)
    if r != s:
        raise SimDrift("simulator drifted from llama-server:\n" + explain(r, s))


# The per-path [DONE] / close / usage rules, stated once more as plain facts on BOTH servers,
# so a failure says which rule broke (the structural test above says where).
@pytest.mark.parametrize(
    "path,body,done",
    [
        (CHAT, chat(max_tokens=3, stream=True), True),
        (TEXT, {"prompt": "Say hi", "max_tokens": 3, "stream": True}, True),
        (NATIVE, {"prompt": "Say hi", "n_predict": 3, "stream": True}, False),
    ],
    ids=["chat", "completions", "native"],
)
async def test_done_and_close_rules(llama_server, sim, path, body, done):
    for who, port in (("real", llama_server.port), ("sim", sim.port)):
        resp = await request(port, "POST", path, body, check_close=True)
        data = resp.sse_data()
        assert resp.status == 200, (who, resp.raw[:500])
        if done:
            assert data.count("[DONE]") == 1 and data[-1] == "[DONE]", (who, data[-2:])
            assert resp.sse_data(resp.chunks[-1]) == ["[DONE]"], who  # [DONE] in its own chunk
        else:
            assert "[DONE]" not in data, who
        assert resp.closed is True, f"{who}: connection not closed after the stream"
        events = [json.loads(d) for d in data if d != "[DONE]"]
        assert events[-1]["timings"]["predicted_n"] == 3, who


async def test_native_stream_framing_matches(llama_server, sim):
    """Native /completion: same chunks, same content events; the final event's keys of the
    simulator are an in-order subset of the real ones (generation_settings' inner keys aside)."""
    case = Case("POST", NATIVE, {"prompt": "Say hi", "n_predict": 3, "stream": True})
    real, fake = await both(llama_server, sim, case)
    r, s = reduce(real, True), reduce(fake, True)
    assert (r["status"], r["headers"], r["closed"]) == (s["status"], s["headers"], s["closed"])
    assert [len(c) for c in r["chunks"]] == [len(c) for c in s["chunks"]] == [1, 1, 1, 1]
    assert r["chunks"][:-1] == s["chunks"][:-1], explain(r, s)
    real_final = [t for t in r["chunks"][-1][0] if not t[0].startswith("$.generation_settings.")]
    real_paths = [t[0] for t in real_final]
    sim_paths = [t[0] for t in s["chunks"][-1][0]]
    it = iter(real_paths)
    missing = [p for p in sim_paths if p not in it]
    assert not missing, f"simulator final-event keys not in the real order/set: {missing}"
    assert {t[0]: t[1:] for t in s["chunks"][-1][0]}.items() <= {
        t[0]: t[1:] for t in real_final
    }.items()

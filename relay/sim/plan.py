"""What the simulator sends for one request: the error its knobs ask for, or a generation's plan.

Knobs come from an optional ``"sim": {...}`` object in the request body (tokens, pacing,
first-token and head delays, stall / drop points, body shapes, an error status or event) over
the server's SimDefaults; the rest follows llama-server (n_predict, then max_tokens and its
alias, stop words, the EOS event of the text routes).
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.sim.completion import generation_settings
from relay.sim.shapes import SHAPES
from relay.sim.state import SimDefaults
from relay.sim.tinymodel import stop_match, stop_words


@dataclass
class Plan:
    """What to send for one generation request (derived from the body and the "sim" knobs)."""

    kind: str
    stream: bool
    n: int | None  # content events; None = chatty (endless)
    predicted_n: int
    finish: str
    prompt_n: int
    interval: float
    ftd: float
    head_delay: float
    stall_after: int | None = None
    mid_line: bool = False
    mid_chunk: bool = False
    drop_after: int | None = None
    content_length: bool = False
    eos: bool = False  # an EOS token event before the final one (text: knob; native: default)
    stop_word: str | None = (
        None  # the stop string that ended generation (its token is not sent as text)
    )
    settings: dict | None = None  # native: generation_settings of the final event
    prompt: str = ""  # native: "prompt" of the final event
    shape: str = "llama"  # chat chunks: "llama", "vllm" or "openai" (shapes.py)
    events_per_chunk: int = 1  # content events per chunk (coalesced, as some servers do)
    chunks_per_write: int = 1  # chunks per write (so several reach the peer in one read)
    error_event: bool = False  # a 200 stream holding only an {"error": ...} event


def as_int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def as_num(v, default: float) -> float:
    return (
        float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else default
    )


def knobs_of(body: dict) -> dict:
    """The request's ``"sim"`` object (its knobs), or {}."""
    sim = body.get("sim")
    return sim if isinstance(sim, dict) else {}


def error_reply(body: dict, d: SimDefaults) -> tuple[int, float] | None:
    """The ``status`` knob: (status, seconds before the head) of an error answer, else None."""
    knobs = knobs_of(body)
    status = as_int(knobs.get("status"))
    if status is None or status < 400:
        return None
    return status, as_num(knobs.get("head_delay_ms"), d.head_delay_ms) / 1000.0


def _prompt_chars(kind: str, body: dict) -> int:
    if kind == "chat":
        total = 0
        for m in body.get("messages") or ():
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                total += len(c)
            elif isinstance(c, list):
                total += sum(len(p.get("text") or "") for p in c if isinstance(p, dict))
        return total
    p = body.get("prompt")
    if isinstance(p, list):
        return sum(len(x) if isinstance(x, str) else 4 for x in p)
    return len(p) if isinstance(p, str) else 0


def _count(v, default: int) -> int:
    v = as_int(v)
    return v if v is not None and 1 <= v <= 4096 else default


def make_plan(kind: str, body: dict, d: SimDefaults) -> Plan:
    """The plan of a generation request on route ``kind``, from its body and the defaults."""
    sim = knobs_of(body)
    # llama-server: n_predict if given, else max_tokens (max_completion_tokens on the OpenAI
    # routes; the native /completion knows no such alias, and no route reads
    # max_output_tokens but the Responses API); the first one present wins, and a negative
    # one means no limit
    limit = None
    fields = (
        ("n_predict", "max_tokens")
        if kind == "native"
        else ("n_predict", "max_tokens", "max_completion_tokens")
    )
    for k in fields:
        v = as_int(body.get(k))
        if v is not None:
            limit = v if v >= 0 else None
            break
    n = as_int(sim.get("tokens"))
    if n is not None and n >= 0:
        finish = "length" if limit is not None and limit <= n else "stop"
        n = min(n, limit) if limit is not None else n
    elif limit is not None:
        n, finish = limit, "length"
    else:
        n, finish = d.tokens, "stop"
    predicted = n
    sm = stop_match(body.get("stop"), n, kind == "chat")
    word = None
    if sm is not None:
        (n, word), predicted, finish = sm, sm[0] + 1, "stop"
    if sim.get("body_kind") == "octet":
        kind = "octet"
    cl = bool(sim.get("content_length_stream"))
    # Real llama-server sends the EOS token as an empty event on /v1/completions and /completion
    # (not on chat); the tiny model's text never ends on its own, so the "tokens" knob stands for
    # "the model stopped after N tokens" and an EOS event is opt-in for text, default for native.
    eos = (
        kind in ("text", "native")
        and finish == "stop"
        and sm is None
        and bool(sim.get("eos_event", kind == "native"))
    )
    if eos:
        predicted += 1
    settings, prompt = None, ""
    if kind == "native":
        settings = generation_settings(
            stop_words(body.get("stop")), -1 if limit is None else limit, body.get("stream") is True
        )
        p = body.get("prompt")
        if isinstance(p, list):
            p = "".join(x for x in p if isinstance(x, str))
        prompt = "<s> " + p if isinstance(p, str) else ""
    interval = as_num(sim.get("interval_ms"), d.interval_ms) / 1000.0
    chatty = bool(sim.get("chatty")) and not cl
    if chatty:
        n, interval = None, interval or 0.01
    shape = sim.get("shape", d.shape)
    return Plan(
        kind=kind,
        stream=body.get("stream") is True or chatty or kind == "octet" or cl,
        n=n,
        predicted_n=predicted,
        finish=finish,
        prompt_n=max(1, _prompt_chars(kind, body) // 4),
        interval=interval,
        ftd=as_num(sim.get("first_token_delay_ms"), d.first_token_delay_ms) / 1000.0,
        head_delay=as_num(sim.get("head_delay_ms"), d.head_delay_ms) / 1000.0,
        stall_after=as_int(sim.get("stall_after")),
        mid_line=bool(sim.get("stall_mid_line")),
        mid_chunk=bool(sim.get("stall_mid_chunk")),
        drop_after=as_int(sim.get("drop_after")),
        content_length=cl,
        eos=eos,
        stop_word=word,
        settings=settings,
        prompt=prompt,
        shape=shape if shape in SHAPES else d.shape,
        events_per_chunk=_count(sim.get("events_per_chunk"), d.events_per_chunk),
        chunks_per_write=_count(sim.get("chunks_per_write"), d.chunks_per_write),
        error_event=bool(sim.get("error_event")),
    )

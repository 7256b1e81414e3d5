"""What the simulator sends for one request: the error its knobs ask for, or a generation's plan.

Knobs come from an optional ``"sim": {...}`` object in the request body (tokens, pacing,
first-token and head delays, stall / drop points, body shapes, an error status or event, a
tool call on the Messages and Responses routes) over the server's SimDefaults; the rest
follows llama-server (n_predict, then max_tokens and its aliases, stop words, the EOS event of
the text routes, the errors of a Messages or Responses request it cannot take).
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.sim import messages as M
from relay.sim import responses as R
from relay.sim.completion import generation_settings
from relay.sim.shapes import SHAPES
from relay.sim.state import SimDefaults
from relay.sim.tinymodel import DEFAULT_TOOL_ARGS, arg_pieces, stop_match, stop_words
from relay.sim.wire import error_body, jdump

API_KINDS = ("messages", "responses")  # Anthropic Messages, OpenAI Responses
# the body fields holding the token limit, the first one present wins (llama-server: the
# native /completion knows no max_tokens alias; /v1/messages reads max_tokens only; the
# Responses API's max_output_tokens comes before max_tokens but after n_predict)
_LIMIT_FIELDS = {
    "native": ("n_predict", "max_tokens"),
    "messages": ("max_tokens",),
    "responses": ("n_predict", "max_output_tokens", "max_tokens", "max_completion_tokens"),
}
_CHAT_LIMITS = ("n_predict", "max_tokens", "max_completion_tokens")
_JSON_TYPES: dict[type, str] = {str: "string", list: "array", dict: "object"}


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
    # messages / responses with the tool_call knob: text tokens before the call (None: text
    # only), and the call (name, argument pieces: one event each after the text)
    text_n: int | None = None
    tool: tuple[str, list[str]] | None = None


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


def request_error(route: str, body: dict) -> tuple[int, bytes] | None:
    """What llama-server answers a Messages or Responses request it cannot take, else None."""
    if route in ("messages", "count_tokens"):
        if "messages" not in body:
            return 500, error_body(500, "'messages' is required", "server_error")
        field = "max_tokens"
    elif route in ("responses", "input_tokens"):
        if "input" not in body:
            return 400, error_body(400, "'input' is required")
        if "previous_response_id" in body:
            return 400, error_body(400, "llama.cpp does not support 'previous_response_id'.")
        field = "max_output_tokens"
    else:
        return None
    typ = _JSON_TYPES.get(type(body.get(field)))
    if typ is None:
        return None
    msg = f"Field 'max_tokens': [json.exception.type_error.302] type must be number, but is {typ}"
    return 400, error_body(400, msg)


def prompt_n(kind: str, body: dict) -> int:
    """The prompt's tokens as the simulator counts them: a token per 4 characters."""
    return max(1, _prompt_chars(kind, body) // 4)


def _first_tool(body: dict) -> str | None:
    tools = body.get("tools")
    for t in tools if isinstance(tools, list) else ():
        if isinstance(t, dict):
            fn = t.get("function")
            name = fn.get("name") if isinstance(fn, dict) else t.get("name")
            if isinstance(name, str) and name:
                return name
    return None


def tool_call(body: dict, knob) -> tuple[str, list[str]] | None:
    """The ``tool_call`` knob: (name, argument pieces) of the call to make, or None.

    ``true``: the request's first tool (else ``get_weather``) with ``{"city": "Paris"}`` in
    runs of word / other characters; an object may set ``name``, ``arguments`` (a JSON text,
    or a value to encode) and ``pieces`` (that many argument deltas of equal length)."""
    if not knob:
        return None
    spec = knob if isinstance(knob, dict) else {}
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        name = _first_tool(body) or "get_weather"
    args = spec.get("arguments", DEFAULT_TOOL_ARGS)
    if not isinstance(args, str):
        args = jdump(args).decode()
    k = as_int(spec.get("pieces"))
    if k is None or k < 1 or not args:
        return name, arg_pieces(args)
    size = -(-len(args) // k)
    return name, [args[j : j + size] for j in range(0, len(args), size)]


def _prompt_chars(kind: str, body: dict) -> int:
    if kind == "messages":
        return M.prompt_chars(body)
    if kind == "responses":
        return R.prompt_chars(body)
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
    for k in _LIMIT_FIELDS.get(kind, _CHAT_LIMITS):
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
    chat = kind == "chat" or kind in API_KINDS  # chat-style text (starts "Hello")
    stop = body.get("stop_sequences" if kind == "messages" else "stop")
    sm = stop_match(stop, n, chat)
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
    tool = tool_call(body, sim.get("tool_call")) if kind in API_KINDS and not chatty else None
    text_n = None
    if tool is not None:  # the text the tokens knob asks for (none by default), then the call
        t = as_int(sim.get("tokens"))
        text_n = t if t is not None and t >= 0 else 0
        n = text_n + len(tool[1])
        finish, word = ("length", None) if limit is not None and limit < n else ("stop", None)
        n = predicted = n if limit is None else min(n, limit)
    shape = sim.get("shape", d.shape)
    return Plan(
        kind=kind,
        stream=body.get("stream") is True or chatty or kind == "octet" or cl,
        n=n,
        predicted_n=predicted,
        finish=finish,
        prompt_n=prompt_n(kind, body),
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
        text_n=text_n,
        tool=tool,
    )

"""What the simulator sends for one request: the error its knobs ask for, or a generation's plan.

Knobs come from an optional ``"sim": {...}`` object in the request body (tokens, pacing,
first-token and head delays, prefill time, stall / drop points, body shapes, an error status
or event, a tool call on the Messages and Responses routes) over the server's SimDefaults;
the rest follows llama-server (n_predict, then max_tokens and its aliases, stop words, the EOS
event of the text routes, ``cache_prompt``, the errors of a Messages or Responses request it
cannot take). The prompt's tokens are `prompt_tokens` (a conversation rendered by the chat
template, or the raw prompt: tinymodel.py), and a reply's tokens, as a slot keeps them and the
next turn renders them, `reply_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from relay.sim import chat as C
from relay.sim import messages as M
from relay.sim import responses as R
from relay.sim.completion import generation_settings
from relay.sim.shapes import SHAPES
from relay.sim.state import SimDefaults
from relay.sim.tinymodel import (
    DEFAULT_TOOL_ARGS,
    EOS_ID,
    TOKEN_IDS,
    Part,
    PartKind,
    Turn,
    arg_pieces,
    call_arguments,
    gen_text,
    generated_tokens,
    raw_prompt_tokens,
    stop_match,
    stop_words,
    template_tokens,
    token_text,
    turn_tokens,
)
from relay.sim.wire import (
    Finish,
    Json,
    Kind,
    Route,
    Shape,
    ToolCall,
    error_body,
    jdump,
)

# Anthropic Messages and OpenAI Responses: chat-style text, and the tool_call knob.
API_KINDS = (Kind.MESSAGES, Kind.RESPONSES)
# The body fields holding the token limit, the first one present wins. In llama-server the
# native /completion knows no max_tokens alias, /v1/messages reads max_tokens only, and the
# Responses API's max_output_tokens comes before max_tokens but after n_predict.
_LIMIT_FIELDS = {
    Kind.NATIVE: ("n_predict", "max_tokens"),
    Kind.MESSAGES: ("max_tokens",),
    Kind.RESPONSES: ("n_predict", "max_output_tokens", "max_tokens", "max_completion_tokens"),
}
_CHAT_LIMITS = ("n_predict", "max_tokens", "max_completion_tokens")
_JSON_TYPES: dict[type, str] = {str: "string", list: "array", dict: "object"}


class Cut(Enum):
    """Where a stall stops the bytes: after the last whole event, inside the next event's
    ``data:`` line (in a whole chunk), or inside the next chunk (its size line sent)."""

    NONE = "none"
    MID_LINE = "mid_line"
    MID_CHUNK = "mid_chunk"


@dataclass(frozen=True, slots=True)
class Plan:
    """What to send for one generation request (derived from the body and the "sim" knobs).

    `n` is the content events to send, None for a chatty (endless) stream. `eos` sends an EOS
    token event before the final one (a knob on the text route, the default on the native
    one). `stop_word` is the stop string that ended generation (its token is not sent as
    text). `settings` and `prompt` are the native final event's generation_settings and
    "prompt". `shape` is whose chat chunks (shapes.py); `events_per_chunk` content events are
    coalesced in a chunk (as some servers do), and `chunks_per_write` chunks go in one write
    (so several reach the peer in one read). `error_event` makes a 200 stream holding only an
    {"error": ...} event. With the tool_call knob (Messages and Responses), `text_n` text
    tokens (None: text only) come before the `tool` call's argument pieces, one event each.

    `tokens` is the prompt's tokens (`prompt_n` of them); `cache_n` of them are reused from a
    slot's cache (set once the slot is known, conn.py), unless `cache_prompt` is off; the
    others take `prefill_ms` each before the first token. `limit` is the token limit (-1
    none), as /slots shows it.
    """

    kind: Kind
    stream: bool
    n: int | None
    predicted_n: int
    finish: Finish
    prompt_n: int
    interval: float
    ftd: float
    head_delay: float
    tokens: list[int]
    stall_after: int | None = None
    stall_cut: Cut = Cut.NONE
    drop_after: int | None = None
    content_length: bool = False
    eos: bool = False
    stop_word: str | None = None
    settings: Json | None = None
    prompt: str = ""
    shape: Shape = Shape.LLAMA
    events_per_chunk: int = 1
    chunks_per_write: int = 1
    error_event: bool = False
    text_n: int | None = None
    tool: ToolCall | None = None
    cache_prompt: bool = True
    prefill_ms: float = 0.0
    cache_n: int = 0
    limit: int = -1

    @property
    def processed(self) -> int:
        """The prompt tokens processed, not reused."""
        return self.prompt_n - self.cache_n

    @property
    def prefill(self) -> float:
        """Seconds of prompt processing before the first token (0 with no prefill knob)."""
        return self.processed * self.prefill_ms / 1000.0

    @property
    def prompt_ms(self) -> float | None:
        """``timings.prompt_ms``: the prefill time, or None (the tiny model's pace) without
        the knob."""
        return self.processed * self.prefill_ms if self.prefill_ms > 0 else None


class ErrorReply(NamedTuple):
    """The error answer the ``status`` knob asks for, `delay` seconds before its head."""

    status: int
    delay: float


class Refusal(NamedTuple):
    """The answer llama-server gives a request it cannot take: its status and JSON body."""

    status: int
    body: bytes


def as_int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def as_num(v: object, default: float) -> float:
    return (
        float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else default
    )


def knobs_of(body: Json) -> Json:
    """The request's ``"sim"`` object (its knobs), or {}."""
    knobs = body.get("sim")
    return knobs if isinstance(knobs, dict) else {}


def error_reply(body: Json, d: SimDefaults) -> ErrorReply | None:
    """The ``status`` knob: the error answer to give, else None."""
    knobs = knobs_of(body)
    status = as_int(knobs.get("status"))
    if status is None or status < 400:
        return None
    return ErrorReply(status, as_num(knobs.get("head_delay_ms"), d.head_delay_ms) / 1000.0)


def request_error(route: Route, body: Json) -> Refusal | None:
    """What llama-server answers a Messages or Responses request it cannot take, else None."""
    if route in (Route.MESSAGES, Route.COUNT_TOKENS):
        if "messages" not in body:
            return Refusal(500, error_body(500, "'messages' is required", "server_error"))
        field = "max_tokens"
    elif route in (Route.RESPONSES, Route.INPUT_TOKENS):
        if "input" not in body:
            return Refusal(400, error_body(400, "'input' is required"))
        if "previous_response_id" in body:
            return Refusal(
                400, error_body(400, "llama.cpp does not support 'previous_response_id'.")
            )
        field = "max_output_tokens"
    else:
        return None
    typ = _JSON_TYPES.get(type(body.get(field)))
    if typ is None:
        return None
    msg = f"Field 'max_tokens': [json.exception.type_error.302] type must be number, but is {typ}"
    return Refusal(400, error_body(400, msg))


def prompt_tokens(kind: Kind, body: Json) -> list[int]:
    """The prompt's tokens: a conversation rendered by the chat template (chat, Messages,
    Responses), or the raw ``prompt`` (/v1/completions, /completion)."""
    if kind == Kind.MESSAGES:
        return M.prompt_tokens(body)
    if kind == Kind.RESPONSES:
        return R.prompt_tokens(body)
    if kind == Kind.CHAT:
        return template_tokens(C.prompt_turns(body))
    return raw_prompt_tokens(body.get("prompt"))


def reply_tokens(p: Plan, made: int) -> list[int]:
    """The tokens of a reply that generated `made` tokens, as the slot keeps them: on the
    chat routes the assistant turn the next request renders (its text, then the tool call's
    arguments so far), on the text routes the ids generated (the stop token last)."""
    if p.kind in (Kind.TEXT, Kind.NATIVE, Kind.OCTET):
        text = min(made, p.n) if p.n is not None else made
        ids = generated_tokens(text, False)
        if made > text:
            stop = TOKEN_IDS[token_text(text, False)] if p.stop_word is not None else EOS_ID
            ids.append(stop)
        return ids
    tn = made if p.text_n is None else min(made, p.text_n)
    parts = [Part(PartKind.TEXT, gen_text(tn, True))]
    if p.tool is not None and made > tn:
        args = call_arguments("".join(p.tool.pieces[: made - tn]))
        parts.append(Part(PartKind.CALL, args, p.tool.name))
    return turn_tokens(Turn("assistant", tuple(parts)))


def _first_tool(body: Json) -> str | None:
    tools = body.get("tools")
    for t in tools if isinstance(tools, list) else ():
        if isinstance(t, dict):
            fn = t.get("function")
            name = fn.get("name") if isinstance(fn, dict) else t.get("name")
            if isinstance(name, str) and name:
                return name
    return None


def tool_call(body: Json, knob: object) -> ToolCall | None:
    """The ``tool_call`` knob: the call to make, or None.

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
        return ToolCall(name, arg_pieces(args))
    size = -(-len(args) // k)
    return ToolCall(name, [args[j : j + size] for j in range(0, len(args), size)])


def _count(v: object, default: int) -> int:
    n = as_int(v)
    return n if n is not None and 1 <= n <= 4096 else default


def _token_limit(kind: Kind, body: Json) -> int | None:
    """The request's token limit, None for none.

    As llama-server reads it: n_predict if given, else max_tokens (max_completion_tokens on
    the OpenAI routes; the native /completion knows no such alias, and no route reads
    max_output_tokens but the Responses API). The first one present wins, and a negative one
    means no limit."""
    for k in _LIMIT_FIELDS.get(kind, _CHAT_LIMITS):
        v = as_int(body.get(k))
        if v is not None:
            return v if v >= 0 else None
    return None


def _length(tokens: int | None, limit: int | None, default: int) -> tuple[int, Finish]:
    """How many tokens to generate and why they end: the ``tokens`` knob (capped by the
    limit), else the limit, else the server's default."""
    if tokens is not None and tokens >= 0:
        finish = Finish.LENGTH if limit is not None and limit <= tokens else Finish.STOP
        return (min(tokens, limit) if limit is not None else tokens), finish
    if limit is not None:
        return limit, Finish.LENGTH
    return default, Finish.STOP


def _native_final(body: Json, limit: int | None) -> tuple[Json, str]:
    """The native final event's generation_settings and "prompt" (a list prompt's strings
    joined, after the BOS text)."""
    settings = generation_settings(
        stop_words(body.get("stop")), -1 if limit is None else limit, body.get("stream") is True
    )
    p = body.get("prompt")
    if isinstance(p, list):
        p = "".join(x for x in p if isinstance(x, str))
    return settings, "<s> " + p if isinstance(p, str) else ""


def make_plan(kind: Kind, body: Json, d: SimDefaults) -> Plan:
    """The plan of a generation request on route ``kind``, from its body and the defaults."""
    knobs = knobs_of(body)
    tokens = prompt_tokens(kind, body)
    limit = _token_limit(kind, body)
    n: int | None
    n, finish = _length(as_int(knobs.get("tokens")), limit, d.tokens)
    predicted = n
    # The chat routes' text starts "Hello".
    chat = kind == Kind.CHAT or kind in API_KINDS
    sm = stop_match(body.get("stop_sequences" if kind == Kind.MESSAGES else "stop"), n, chat)
    word = None
    if sm is not None:
        n, word, predicted, finish = sm.index, sm.word, sm.index + 1, Finish.STOP
    if knobs.get("body_kind") == "octet":
        kind = Kind.OCTET
    cl = bool(knobs.get("content_length_stream"))
    # Real llama-server sends the EOS token as an empty event on /v1/completions and /completion
    # (not on chat); the tiny model's text never ends on its own, so the "tokens" knob stands for
    # "the model stopped after N tokens" and an EOS event is opt-in for text, default for native.
    eos = (
        kind in (Kind.TEXT, Kind.NATIVE)
        and finish == Finish.STOP
        and sm is None
        and bool(knobs.get("eos_event", kind == Kind.NATIVE))
    )
    if eos:
        predicted += 1
    settings, prompt = _native_final(body, limit) if kind == Kind.NATIVE else (None, "")
    interval = as_num(knobs.get("interval_ms"), d.interval_ms) / 1000.0
    chatty = bool(knobs.get("chatty")) and not cl
    if chatty:
        n, interval = None, interval or 0.01
    tool = tool_call(body, knobs.get("tool_call")) if kind in API_KINDS and not chatty else None
    text_n = None
    if tool is not None:
        # The text the tokens knob asks for (none by default), then the call.
        t = as_int(knobs.get("tokens"))
        text_n = t if t is not None and t >= 0 else 0
        n = text_n + len(tool.pieces)
        finish = Finish.LENGTH if limit is not None and limit < n else Finish.STOP
        word = None
        n = predicted = n if limit is None else min(n, limit)
    shape = knobs.get("shape", d.shape)
    return Plan(
        kind=kind,
        stream=body.get("stream") is True or chatty or kind == Kind.OCTET or cl,
        n=n,
        predicted_n=predicted,
        finish=finish,
        prompt_n=len(tokens),
        interval=interval,
        ftd=as_num(knobs.get("first_token_delay_ms"), d.first_token_delay_ms) / 1000.0,
        head_delay=as_num(knobs.get("head_delay_ms"), d.head_delay_ms) / 1000.0,
        tokens=tokens,
        stall_after=as_int(knobs.get("stall_after")),
        stall_cut=_cut(knobs),
        drop_after=as_int(knobs.get("drop_after")),
        content_length=cl,
        eos=eos,
        stop_word=word,
        settings=settings,
        prompt=prompt,
        shape=Shape(shape) if shape in SHAPES else d.shape,
        events_per_chunk=_count(knobs.get("events_per_chunk"), d.events_per_chunk),
        chunks_per_write=_count(knobs.get("chunks_per_write"), d.chunks_per_write),
        error_event=bool(knobs.get("error_event")),
        text_n=text_n,
        tool=tool,
        cache_prompt=body.get("cache_prompt") is not False,
        prefill_ms=as_num(knobs.get("prefill_ms_per_token"), d.prefill_ms_per_token),
        limit=-1 if limit is None else limit,
    )


def _cut(knobs: Json) -> Cut:
    """The stall knobs' cut: mid-line wins when both are set."""
    if knobs.get("stall_mid_line"):
        return Cut.MID_LINE
    if knobs.get("stall_mid_chunk"):
        return Cut.MID_CHUNK
    return Cut.NONE

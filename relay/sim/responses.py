"""OpenAI Responses (``/v1/responses``) in the pinned llama-server's bytes: events and bodies.

A stream (tests/support/captures/responses_stream*.http) is named SSE events with no
``[DONE]``, and, unlike OpenAI's own API, no ``sequence_number``, ``output_index`` or
``content_index``: ``response.created`` and ``response.in_progress`` (``{"id","object",
"status"}`` only), then per token a ``response.output_text.delta`` (the first one after
``response.output_item.added`` and ``response.content_part.added``), and a last chunk with
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``
and ``response.completed`` (the whole response with ``usage``, and ``timings`` beside it).
A function call (the ``tool_call`` knob) is an ``output_item.added`` of type
``function_call`` with ``response.function_call_arguments.delta`` pieces (no ``.done``
event); an empty answer is created + in_progress (carrying ``timings``), then completed.
The non-streamed body has its keys sorted at the top and in message items. ``usage`` counts
the whole prompt in ``input_tokens`` and the tokens reused from the slot's cache in
``input_tokens_details.cached_tokens``. The prompt the model reads is `prompt_turns`: the
instructions and the tools, then the input's messages, function calls and their outputs.
Pure builders.
"""

from __future__ import annotations

import time

from relay.sim.tinymodel import (
    Part,
    PartKind,
    Turn,
    call_arguments,
    content_parts,
    gen_text,
    template_tokens,
    token_text,
    tools_part,
    with_head,
)
from relay.sim.wire import Finish, Json, PiecedFrames, Timings, ToolCall, jdump, rand32, sse


def _item_turn(item: object, turns: list[Turn]) -> None:
    """Add one input item to `turns`: a message a turn of its role; a function call joins
    the assistant turn before it (or opens one); a call's output is a ``tool`` turn."""
    if isinstance(item, str):
        turns.append(Turn("user", (Part(PartKind.TEXT, item),) if item else ()))
        return
    if not isinstance(item, dict):
        return
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        parts = content_parts(item.get("content"))
        turns.append(Turn(role if isinstance(role, str) else "user", tuple(parts)))
    elif kind == "function_call":
        name = item.get("name")
        call = Part(
            PartKind.CALL,
            call_arguments(item.get("arguments", "")),
            name if isinstance(name, str) else "",
        )
        if turns and turns[-1].role == "assistant":
            turns[-1] = Turn("assistant", (*turns[-1].parts, call))
        else:
            turns.append(Turn("assistant", (call,)))
    elif kind == "function_call_output":
        turns.append(Turn("tool", tuple(content_parts(item.get("output")))))


def prompt_turns(body: Json) -> list[Turn]:
    """The turns the model reads: the instructions and the tools, then the input (a string
    is one user message)."""
    turns: list[Turn] = []
    inp = body.get("input")
    for item in inp if isinstance(inp, list) else [inp] if isinstance(inp, str) else ():
        _item_turn(item, turns)
    head = content_parts(body.get("instructions")) + tools_part(body.get("tools"))
    return with_head(turns, head)


def prompt_tokens(body: Json) -> list[int]:
    return template_tokens(prompt_turns(body))


def _usage(prompt_n: int, cache_n: int, output_n: int) -> Json:
    return {
        "input_tokens": prompt_n,
        "output_tokens": output_n,
        "total_tokens": prompt_n + output_n,
        "input_tokens_details": {"cached_tokens": cache_n},
    }


def _part(text: str) -> Json:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def _fc_item(fid: str, arguments: str, name: str) -> Json:
    return {
        "id": "fc_" + fid,
        "type": "function_call",
        "status": "completed",
        "arguments": arguments,
        "call_id": "call_" + fid,
        "name": name,
    }


class ResponsesFrames(PiecedFrames):
    """One /v1/responses stream: ``text_n`` text tokens, then the function call's pieces."""

    __slots__ = (
        "_cache",
        "_pre",
        "cache_n",
        "created",
        "fid",
        "first_timings",
        "id",
        "model",
        "msg_id",
        "pieces",
        "prompt_n",
        "text_n",
        "tool_name",
    )

    def __init__(
        self,
        model: str,
        prompt_n: int,
        text_n: int | None = None,
        tool: ToolCall | None = None,
        first_timings: Timings | None = None,
        rid: str | None = None,
        cache_n: int = 0,
    ) -> None:
        self.model, self.prompt_n, self.cache_n = model, prompt_n, cache_n
        self.id = rid or "resp_" + rand32()
        self.msg_id = "msg_" + rand32()
        self.fid = rand32()
        self.created = int(time.time())
        self.tool_name = tool.name if tool else None
        self.pieces = tool.pieces if tool else []
        # None: text only, however many tokens.
        self.text_n = text_n
        # Set for an empty answer, whose in_progress event carries the timings.
        self.first_timings = first_timings
        self._cache: dict[int, bytes] = {}
        self._pre = (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            b'"item_id":"%s","delta":' % self.msg_id.encode()
        )

    def role_event(self) -> bytes:
        head = {"id": self.id, "object": "response", "status": "in_progress"}
        prog: Json = {"type": "response.in_progress", "response": head}
        if self.first_timings is not None:
            prog["timings"] = self.first_timings
        return sse(
            b"response.created", jdump({"type": "response.created", "response": head})
        ) + sse(b"response.in_progress", jdump(prog))

    def event(self, i: int) -> bytes:
        if self._is_text(i):
            ev = self._pre + jdump(token_text(i, True)) + b"}\n\n"
            if i == 0:
                item = {
                    "content": [],
                    "id": self.msg_id,
                    "role": "assistant",
                    "status": "in_progress",
                    "type": "message",
                }
                part = {
                    "type": "response.content_part.added",
                    "item_id": self.msg_id,
                    "part": {"type": "output_text", "text": ""},
                }
                ev = (
                    sse(
                        b"response.output_item.added",
                        jdump({"type": "response.output_item.added", "item": item}),
                    )
                    + sse(b"response.content_part.added", jdump(part))
                    + ev
                )
            return ev
        k = i - (self.text_n or 0)
        delta = {
            "type": "response.function_call_arguments.delta",
            "delta": self.pieces[k],
            "item_id": "fc_" + self.fid,
        }
        ev = sse(b"response.function_call_arguments.delta", jdump(delta))
        if k == 0:
            call = {
                "id": "fc_" + self.fid,
                "arguments": "",
                "call_id": "call_" + self.fid,
                "name": self.tool_name,
                "type": "function_call",
                "status": "in_progress",
            }
            added = {"type": "response.output_item.added", "item": call}
            ev = sse(b"response.output_item.added", jdump(added)) + ev
        return ev

    def final_events(
        self, n: int, predicted_n: int, finish: Finish, tm: Timings, stop_word: str | None
    ) -> bytes:
        """The last events: the text's and the call's done events, then ``response.completed``
        (`finish` and `stop_word` do not show in a Responses stream)."""
        text_n = n if self.text_n is None else min(n, self.text_n)
        out = b""
        output: list[Json] = []
        if text_n > 0:
            text = gen_text(text_n, True)
            item: Json = {
                "type": "message",
                "status": "completed",
                "id": self.msg_id,
                "content": [_part(text)],
                "role": "assistant",
            }
            output.append(item)
            done = {"type": "response.output_text.done", "item_id": self.msg_id, "text": text}
            part = {
                "type": "response.content_part.done",
                "item_id": self.msg_id,
                "part": _part(text),
            }
            out += (
                sse(b"response.output_text.done", jdump(done))
                + sse(b"response.content_part.done", jdump(part))
                + sse(
                    b"response.output_item.done",
                    jdump({"type": "response.output_item.done", "item": item}),
                )
            )
        if self.tool_name is not None and n > text_n:
            fc = _fc_item(self.fid, "".join(self.pieces[: n - text_n]), self.tool_name)
            output.append(fc)
            out += sse(
                b"response.output_item.done",
                jdump({"type": "response.output_item.done", "item": fc}),
            )
        resp = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "completed",
            "model": self.model,
            "output": output,
            "usage": _usage(self.prompt_n, self.cache_n, predicted_n),
        }
        done_ev = {"type": "response.completed", "response": resp, "timings": tm}
        return out + sse(b"response.completed", jdump(done_ev))


def nonstream_body(
    model: str,
    prompt_n: int,
    n: int,
    predicted_n: int,
    text_n: int | None = None,
    tool: ToolCall | None = None,
    cache_n: int = 0,
) -> bytes:
    """A non-streamed /v1/responses answer (sorted keys, no ``timings``)."""
    tn = n if text_n is None else min(n, text_n)
    output: list[Json] = []
    if tn > 0:
        output.append(
            {
                "content": [_part(gen_text(tn, True))],
                "id": "msg_" + rand32(),
                "role": "assistant",
                "status": "completed",
                "type": "message",
            }
        )
    if tool is not None and n > tn:
        output.append(_fc_item(rand32(), "".join(tool.pieces[: n - tn]), tool.name))
    now = int(time.time())
    return jdump(
        {
            "completed_at": now,
            "created_at": now,
            "id": "resp_" + rand32(),
            "model": model,
            "object": "response",
            "output": output,
            "status": "completed",
            "usage": _usage(prompt_n, cache_n, predicted_n),
        }
    )


def input_tokens_body(prompt_n: int) -> bytes:
    return b'{"input_tokens":%d,"object":"response.input_tokens"}' % prompt_n

"""Anthropic Messages (``/v1/messages``) in the pinned llama-server's bytes: events and bodies.

A stream (tests/support/captures/messages_stream*.http) is named SSE events, ``event: X`` then
``data: {...}``, with no ``[DONE]`` and no ``ping``: ``message_start`` (its ``usage`` has
``cache_read_input_tokens``, the prompt tokens reused from the slot's cache, ``input_tokens``,
the prompt's other tokens, as llama-server counts them, and ``output_tokens`` 0) alone or in
the chunk of the first token, then per token a ``content_block_delta`` (the first one of a block after its
``content_block_start``), and a last chunk with every block's ``content_block_stop`` (in index
order, all at the end: llama-server closes a text block only after a tool_use block opened
after it), ``message_delta`` (``stop_reason`` ``max_tokens``, ``end_turn`` also for a stop
sequence, or ``tool_use``; ``stop_sequence``; ``usage.output_tokens``) and ``message_stop``.
A tool_use block (the ``tool_call`` knob) streams its arguments as ``input_json_delta``
pieces; its ``content_block_start`` has no ``input``. The prompt the model reads is
`prompt_turns`: ``system`` and the tools, then the messages (text, images, tool_use and
tool_result blocks). Pure byte builders.
"""

from __future__ import annotations

import msgspec

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
)
from relay.sim.wire import Finish, Json, PiecedFrames, Timings, ToolCall, jdump, rand32, sse


def _block(block: Json) -> list[Part] | None:
    """A tool_use block as a call, a tool_result as a result (its text, then its other
    blocks), a thinking block as nothing the template renders again; else None."""
    kind = block.get("type")
    if kind == "tool_use":
        name = block.get("name")
        args = call_arguments(block.get("input", {}))
        return [Part(PartKind.CALL, args, name if isinstance(name, str) else "")]
    if kind == "tool_result":
        parts = content_parts(block.get("content"))
        text = "".join(p.text for p in parts if p.kind is PartKind.TEXT)
        return [Part(PartKind.RESULT, text), *(p for p in parts if p.kind is not PartKind.TEXT)]
    if kind in ("thinking", "redacted_thinking"):
        return []
    return None


def prompt_turns(body: Json) -> list[Turn]:
    """The turns the model reads: ``system`` and the tools, then every message."""
    head = content_parts(body.get("system")) + tools_part(body.get("tools"))
    turns = [Turn("system", tuple(head))] if head else []
    msgs = body.get("messages")
    for m in msgs if isinstance(msgs, list) else ():
        if isinstance(m, dict):
            role = m.get("role")
            parts = content_parts(m.get("content"), _block)
            turns.append(Turn(role if isinstance(role, str) else "user", tuple(parts)))
    return turns


def prompt_tokens(body: Json) -> list[int]:
    return template_tokens(prompt_turns(body))


def _usage(prompt_n: int, cache_n: int, output_n: int) -> dict[str, int]:
    """llama-server's Messages usage: the tokens reused, then the prompt's others."""
    return {
        "cache_read_input_tokens": cache_n,
        "input_tokens": prompt_n - cache_n,
        "output_tokens": output_n,
    }


def stop_reason(finish: Finish, called: bool) -> str:
    """Anthropic's ``stop_reason``: ``max_tokens`` when the token limit ended the answer (a
    tool call it cut too), else ``tool_use`` when the answer `called` a tool, else
    ``end_turn``."""
    if finish == Finish.LENGTH:
        return "max_tokens"
    return "tool_use" if called else "end_turn"


class MessagesFrames(PiecedFrames):
    """One /v1/messages stream: ``text_n`` text tokens, then the tool call's argument pieces."""

    __slots__ = (
        "_cache",
        "_pre",
        "cache_n",
        "id",
        "model",
        "pieces",
        "prompt_n",
        "text_n",
        "tool_id",
        "tool_name",
    )

    def __init__(
        self,
        model: str,
        prompt_n: int,
        text_n: int | None = None,
        tool: ToolCall | None = None,
        rid: str | None = None,
        cache_n: int = 0,
    ) -> None:
        self.model, self.prompt_n, self.cache_n = model, prompt_n, cache_n
        self.id = rid or "chatcmpl-" + rand32()
        self.tool_name = tool.name if tool else None
        self.pieces = tool.pieces if tool else []
        # None: text only, however many tokens.
        self.text_n = text_n
        self.tool_id = rand32()
        self._cache: dict[int, bytes] = {}
        self._pre = (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":'
        )

    def role_event(self) -> bytes:
        msg: dict[str, object] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self.prompt_n, self.cache_n, 0),
        }
        return sse(b"message_start", jdump({"type": "message_start", "message": msg}))

    def event(self, i: int) -> bytes:
        if self._is_text(i):
            ev = self._pre + jdump(token_text(i, True)) + b"}}\n\n"
            if i == 0:
                start = {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                }
                ev = sse(b"content_block_start", jdump(start)) + ev
            return ev
        k = i - (self.text_n or 0)
        index = 1 if self.text_n else 0
        ev = sse(
            b"content_block_delta",
            jdump(
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": self.pieces[k]},
                }
            ),
        )
        if k == 0:
            block = {"type": "tool_use", "id": self.tool_id, "name": self.tool_name}
            start = {"type": "content_block_start", "index": index, "content_block": block}
            ev = sse(b"content_block_start", jdump(start)) + ev
        return ev

    def final_events(
        self, n: int, predicted_n: int, finish: Finish, tm: Timings, stop_word: str | None
    ) -> bytes:
        """The last events: every block's stop, the message's delta and its stop (a Messages
        stream carries no ``timings``: `tm` is unused)."""
        text_n = n if self.text_n is None else min(n, self.text_n)
        blocks = (text_n > 0) + (n > text_n)
        out = b"".join(
            sse(b"content_block_stop", b'{"type":"content_block_stop","index":%d}' % k)
            for k in range(blocks)
        )
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": stop_reason(finish, n > text_n),
                "stop_sequence": stop_word,
            },
            "usage": {"output_tokens": predicted_n},
        }
        return (
            out
            + sse(b"message_delta", jdump(delta))
            + sse(b"message_stop", b'{"type":"message_stop"}')
        )


def tool_input(pieces: list[str], k: int) -> object:
    """The tool call's input, parsed from its first ``k`` argument pieces ({} if not JSON)."""
    try:
        return msgspec.json.decode("".join(pieces[:k]))
    except msgspec.DecodeError:
        return {}


def nonstream_body(
    model: str,
    prompt_n: int,
    n: int,
    predicted_n: int,
    finish: Finish,
    stop_word: str | None,
    text_n: int | None = None,
    tool: ToolCall | None = None,
    cache_n: int = 0,
) -> bytes:
    """A non-streamed /v1/messages answer (no ``timings``)."""
    tn = n if text_n is None else min(n, text_n)
    content: list[Json] = []
    if tn > 0:
        content.append({"type": "text", "text": gen_text(tn, True)})
    if tool is not None and n > tn:
        content.append(
            {
                "type": "tool_use",
                "id": rand32(),
                "name": tool.name,
                "input": tool_input(tool.pieces, n - tn),
            }
        )
    return jdump(
        {
            "id": "chatcmpl-" + rand32(),
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": model,
            "stop_reason": stop_reason(finish, n > tn),
            "stop_sequence": stop_word,
            "usage": _usage(prompt_n, cache_n, predicted_n),
        }
    )


def count_tokens_body(prompt_n: int) -> bytes:
    return b'{"input_tokens":%d}' % prompt_n

"""An OpenAI chat request (/v1/chat/completions) as the model reads it: its turns.

The messages in order, each a turn of its role: its content (text, images and other parts)
and, for an assistant, its tool calls (name and arguments); a ``tool`` message is a turn of
its own. The tool definitions join the leading system message (or make one), as
llama-server's templates render them. tinymodel.template_tokens makes the tokens. Pure.
"""

from __future__ import annotations

from relay.sim.tinymodel import (
    Part,
    PartKind,
    Turn,
    call_arguments,
    content_parts,
    tools_part,
    with_head,
)
from relay.sim.wire import Json, json_iter


def _calls(calls: object) -> list[Part]:
    out = []
    for c in calls if isinstance(calls, list) else ():
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict):
            name = fn.get("name")
            args = call_arguments(fn.get("arguments", ""))
            out.append(Part(PartKind.CALL, args, name if isinstance(name, str) else ""))
    return out


def prompt_turns(body: Json) -> list[Turn]:
    """The turns of a chat request (a ``messages`` that is no list is an error, as before:
    TypeError for a number)."""
    turns = []
    for m in json_iter(body.get("messages") or ()):
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        parts = content_parts(m.get("content")) + _calls(m.get("tool_calls"))
        turns.append(Turn(role if isinstance(role, str) else "user", tuple(parts)))
    return with_head(turns, tools_part(body.get("tools")))

"""The same JSON written every way JSON allows: compact, spaced, with whitespace (and, split
over `data:` lines, newlines) around colons and commas, with names and values escaped
(`"\\u0074ype"`, `"message\\u005fstop"`), and streams of each API's events so written."""

from __future__ import annotations

import json
from collections.abc import Callable

from relay.stream import dialect as D

Spell = Callable[[object], str]


def compact(doc: object) -> str:
    return json.dumps(doc, separators=(",", ":"))


def spaced(doc: object) -> str:
    return json.dumps(doc)


def _escaped_str(s: str) -> str:
    # The first character, every `_` and `.` as a \u escape, the others as json writes them.
    out = []
    for i, ch in enumerate(s):
        esc = i == 0 or ch in "_."
        out.append(f"\\u{ord(ch):04x}" if esc else json.dumps(ch)[1:-1])
    return '"' + "".join(out) + '"'


def _write(doc: object, string: Callable[[str], str], colon: str, comma: str) -> str:
    if isinstance(doc, dict):
        members = [string(k) + colon + _write(v, string, colon, comma) for k, v in doc.items()]
        return "{" + comma.join(members) + "}"
    if isinstance(doc, list):
        return "[" + comma.join(_write(v, string, colon, comma) for v in doc) + "]"
    if isinstance(doc, str):
        return string(doc)
    return json.dumps(doc)


def escaped(doc: object) -> str:
    return _write(doc, _escaped_str, ":", ",")


def loose(doc: object) -> str:
    """Tabs and spaces around every colon and comma."""
    return _write(doc, json.dumps, " \t: ", " ,\t")


def lines(doc: object) -> str:
    """Newlines around every colon: each becomes a `data:` line of its own."""
    return _write(doc, json.dumps, "\n:\n", ",")


SPELLINGS: dict[str, Spell] = {
    "compact": compact,
    "spaced": spaced,
    "escaped": escaped,
    "loose": loose,
    "lines": lines,
}


def event(name: str | None, doc: object, spell: Spell = compact) -> bytes:
    """One event: its `event:` line (when named), its data over as many lines as it has."""
    head = f"event: {name}\n" if name is not None else ""
    data = "".join(f"data: {line}\n" for line in spell(doc).split("\n"))
    return (head + data + "\n").encode()


DONE = b"data: [DONE]\n\n"


# ---- each API's stream, ending as its upstream ends it ----------------------------------------
def chat(spell: Spell = compact) -> tuple[bytes, int]:
    """A chat stream (llama-server's keys), and where its ending events start."""

    def chunk(delta: dict, finish: str | None = None, **more: object) -> bytes:
        choice = {"finish_reason": finish, "index": 0, "delta": delta}
        doc = {"choices": [choice], "created": 1, "id": "c", "model": "m"}
        doc.update(object="chat.completion.chunk", **more)
        return event(None, doc, spell)

    body = chunk({"role": "assistant", "content": ""})
    body += b"".join(chunk({"content": t}) for t in ("Hel", "lo", " there"))
    start = len(body)
    body += chunk({}, "stop")
    usage = {"completion_tokens": 10, "prompt_tokens": 5, "total_tokens": 15}
    body += event(None, {"choices": [], "id": "c", "usage": usage}, spell)
    return body + DONE, start


def text(spell: Spell = compact) -> tuple[bytes, int]:
    def chunk(t: str, finish: str | None = None) -> bytes:
        choice = {"text": t, "index": 0, "logprobs": None, "finish_reason": finish}
        return event(None, {"id": "t", "object": "text_completion", "choices": [choice]}, spell)

    body = b"".join(chunk(t) for t in ("Hel", "lo"))
    start = len(body)
    body += chunk("", "length")
    usage = {"completion_tokens": 10, "prompt_tokens": 5, "total_tokens": 15}
    doc = {"id": "t", "object": "text_completion", "choices": [], "usage": usage}
    body += event(None, doc, spell)
    return body + DONE, start


def native(spell: Spell = compact) -> tuple[bytes, int]:
    def ev(content: str, stop: bool, **more: object) -> bytes:
        doc = {"index": 0, "content": content, "tokens": [], "stop": stop, "id_slot": 0}
        return event(None, {**doc, **more}, spell)

    body = b"".join(ev(t, False, tokens_predicted=i + 1) for i, t in enumerate(("Hel", "lo")))
    start = len(body)
    timings = {"prompt_n": 5, "predicted_n": 10, "predicted_ms": 12.5}
    body += ev("", True, tokens_predicted=10, stop_type="eos", timings=timings)
    return body, start


def messages(spell: Spell = compact) -> tuple[bytes, int]:
    def ev(name: str, **fields: object) -> bytes:
        return event(name, {"type": name, **fields}, spell)

    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
    message.update(model="m", stop_reason=None, usage={"input_tokens": 5, "output_tokens": 1})
    body = ev("message_start", message=message)
    body += ev("content_block_start", index=0, content_block={"type": "text", "text": ""})
    for t in ("Hel", "lo", " there"):
        body += ev("content_block_delta", index=0, delta={"type": "text_delta", "text": t})
    start = len(body)
    body += ev("content_block_stop", index=0)
    delta = {"stop_reason": "end_turn", "stop_sequence": None}
    body += ev("message_delta", delta=delta, usage={"output_tokens": 10})
    return body + ev("message_stop"), start


RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m"}


def responses(spell: Spell = compact) -> tuple[bytes, int]:
    seq = iter(range(100))

    def ev(name: str, **fields: object) -> bytes:
        return event(name, {"type": name, "sequence_number": next(seq), **fields}, spell)

    item = {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant"}
    body = ev("response.created", response={**RESPONSE, "status": "in_progress", "output": []})
    body += ev("response.output_item.added", output_index=0, item={**item, "content": []})
    part = {"type": "output_text", "text": "", "annotations": []}
    body += ev("response.content_part.added", item_id="msg_1", output_index=0, content_index=0,
               part=part)  # fmt: skip
    for t in ("Hel", "lo", " there"):
        body += ev("response.output_text.delta", item_id="msg_1", output_index=0,
                   content_index=0, delta=t)  # fmt: skip
    start = len(body)
    body += ev("response.output_text.done", item_id="msg_1", output_index=0, content_index=0,
               text="Hello there")  # fmt: skip
    done = {**item, "status": "completed", "content": [{**part, "text": "Hello there"}]}
    body += ev("response.output_item.done", output_index=0, item=done)
    usage = {"input_tokens": 5, "output_tokens": 10, "total_tokens": 15}
    final = {**RESPONSE, "status": "completed", "output": [done], "usage": usage}
    return body + ev("response.completed", response=final), start


# Each API's stream, by its dialect.
STREAMS: dict[D.Api, Callable[..., tuple[bytes, int]]] = {
    D.CHAT: chat,
    D.TEXT: text,
    D.NATIVE: native,
    D.MESSAGES: messages,
    D.RESPONSES: responses,
}

"""What a client makes of the bytes of an event stream, written from the specs and the SDKs,
not from the relay: for asserting what a stall leaves a client with.

- `read`: the WHATWG event-stream parsing every SDK follows: lines end in CRLF, LF or CR; a
  field's value loses one leading space; the last `event:` field names the event; `data:`
  lines join with LF; a blank line dispatches. (The openai SDK dispatches an event with a
  name and no data too, and then fails on its empty JSON: such an event is kept, data None;
  an empty name is no name.)
- `view`: what an API's SDK takes from one event: its kind (Anthropic's SDK goes by the event
  name, OpenAI's by the data's `type`; an event giving both must give the same), whether it
  ends the stream, whether it carries figures (usage, timings), a chat choice's finish,
  Responses' `sequence_number`, whether it is the relay's own (`x_relay_stall`).
- `check_cut`: the rules a stream cut by the stall guard must keep (`stream.half_event`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from relay.stream import dialect as D

_LINE = re.compile(rb"\r\n|\r|\n")
ENDS = {
    D.MESSAGES: {"message_stop"},
    D.RESPONSES: {"response.completed", "response.incomplete", "response.failed"},
}
DELTAS = {D.MESSAGES: {"content_block_delta"}}


@dataclass(frozen=True)
class Event:
    name: str | None
    data: str | None
    # The offset of its first line in the bytes read.
    start: int


def read(raw: bytes) -> list[Event]:
    """The events a client dispatches from `raw` (the half one at its end is not)."""
    out: list[Event] = []
    name: str | None = None
    data: list[str] = []
    start = None
    pos = 0
    for m in _LINE.finditer(raw):
        line = raw[pos : m.start()].decode()
        at, pos = pos, m.end()
        if not line:
            if data or name:
                out.append(Event(name, "\n".join(data) if data else None, start))
            name, data, start = None, [], None
            continue
        if start is None:
            start = at
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
    return out


@dataclass(frozen=True)
class View:
    kind: str | None
    end: bool
    figures: bool
    finish: bool
    seq: int | None
    relay: bool
    doc: object


def view(api: D.Api, ev: Event) -> View:
    """What `api`'s SDK takes from `ev`; AssertionError when it cannot read it."""
    assert ev.data is not None, f"an event with no data: {ev}"
    if api in (D.CHAT, D.TEXT) and ev.data.startswith("[DONE]"):
        return View(None, True, False, False, None, False, None)
    doc = json.loads(ev.data)
    d = doc if isinstance(doc, dict) else {}
    relay = "x_relay_stall" in d
    if api in (D.MESSAGES, D.RESPONSES):
        kind = d.get("type")
        if ev.name is not None:
            assert ev.name == kind, f"named {ev.name!r}, typed {kind!r}"
        end = kind in ENDS[api] or kind == "error"
        figures = kind in ("message_delta", "message_start") or end
        return View(kind, end, figures, False, d.get("sequence_number"), relay, doc)
    if api == D.NATIVE:
        end = d.get("stop") is True
        return View(None, end, end or d.get("timings") is not None, end, None, relay, doc)
    figures = d.get("usage") is not None or d.get("timings") is not None
    choices = d.get("choices")
    finish = isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") is not None for c in choices
    )
    return View(None, False, figures, finish, None, relay, doc)


def check_cut(api: D.Api, upstream: bytes, cut: int, frame: bytes) -> list[tuple[Event, View]]:
    """The events a client reads of `upstream[:cut] + frame`, checked: each one readable;
    an event the relay finished (begun before the cut, not the upstream's whole one) is no
    end, carries no figures and no finish, and on Messages and Responses is a delta or a
    ping; exactly one end, the upstream's own whole one (then nothing after it) or the
    relay's, last; figures only in the upstream's whole events or the relay's; Responses'
    sequence numbers increasing."""
    whole = {(e.start, e.name, e.data) for e in read(upstream)}
    got = read(upstream[:cut] + frame)
    seen = [(e, view(api, e)) for e in got]
    ends = [i for i, (_, v) in enumerate(seen) if v.end]
    assert len(ends) == 1, f"{len(ends)} ends: {[e for e, v in seen if v.end]}"
    assert ends[0] == len(seen) - 1, "events after the end"
    for e, v in seen:
        real = (e.start, e.name, e.data) in whole
        if e.start < cut and not real:
            # The half event the relay ended: nothing made up.
            assert not (v.end or v.figures or v.finish), f"made up: {e}"
            if api in (D.MESSAGES, D.RESPONSES):
                assert v.kind == "ping" or _is_delta(api, v.kind), f"finished: {e}"
        elif not real:
            assert e.start >= cut
        if v.figures or v.end:
            assert real or e.start >= cut, e
    seqs = [v.seq for _, v in seen if v.seq is not None]
    assert seqs == sorted(set(seqs)), f"sequence numbers {seqs}"
    return seen


def _is_delta(api: D.Api, kind: str | None) -> bool:
    if api == D.MESSAGES:
        return kind == "content_block_delta"
    return kind is not None and kind.endswith(".delta")

"""relay/stream/half_event.py: an event the upstream stopped in the middle of is finished so
that it parses - every prefix of every JSON event, the shapes the APIs' SDKs dispatch on."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.stream import dialect as D
from relay.stream.half_event import MAX_CLOSE, PING, Closing, Fate, close_event, close_json
from tests.stream.sse_client import read, view

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(doc=_json, ascii_only=st.booleans(), spaced=st.booleans())
def test_every_prefix_of_a_json_text_is_closed_into_json(doc, ascii_only, spaced):
    seps = (", ", ": ") if spaced else (",", ":")
    text = json.dumps(doc, ensure_ascii=ascii_only, separators=seps).encode()
    for i in range(1, len(text) + 1):
        prefix = text[:i]
        closer = close_json(prefix)
        assert closer is not None, prefix
        json.loads(prefix + closer)  # (raises if not JSON)
    assert close_json(text) == b""  # whole: nothing to add


@pytest.mark.parametrize(
    "prefix,closer",
    [
        (b'{"a":"Hel', b'"}'),
        (b'{"a":"x\\', b'\\"}'),
        (b'{"a":"\\u00', b'00"}'),
        (b'{"a":tr', b"ue}"),
        (b'{"a":-', b"0}"),
        (b'{"a":1.5e', b"0}"),
        (b'{"a"', b":null}"),
        (b'{"a":', b"null}"),
        (b'{"a":1,', b'"":null}'),
        (b"[1,", b"null]"),
        (b"[", b"]"),
    ],
)
def test_closers(prefix, closer):
    assert close_json(prefix) == closer


def test_what_is_not_json_is_left_alone():
    assert close_json(b'{"a" 1') is None and close_json(b"}") is None
    # (`[DONE]` is no JSON: what a half one becomes is the event's business)
    assert close_json(b"[DO") is None
    assert close_event(b"data: {x") == Closing(b"\n\n", Fate.BROKEN)


def tail(pending: bytes, api: D.Api = D.CHAT) -> bytes:
    return close_event(pending, api).tail


def test_events():
    delta = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" fr'
    assert close_event(delta, D.MESSAGES) == Closing(b'"}}\n\n', Fate.FINISHED)
    # a half name, an event with no data yet: a ping, which every SDK skips
    assert tail(b"event: content_blo", D.MESSAGES) == b"\n" + PING
    assert tail(b"event: message_start\n", D.MESSAGES) == PING
    # no name and no data: its blank line (an event without data is not dispatched)
    assert tail(b"id: 4") == b"\n\n" and tail(b"da") == b"\n\n"
    assert close_event(b'data: {"a":1}\n') == Closing(b"\n", Fate.FINISHED)  # whole
    # a half [DONE] can only become [DONE], an end the upstream did not send: left as it is
    assert close_event(b"data: [DO") == Closing(b"\n\n", Fate.BROKEN)
    assert tail(b"data: ") == b"{}\n\n"
    assert tail(b"") == b""
    assert close_event(b'data: {"a":"' + b"x" * MAX_CLOSE) == Closing(b"\n\n", Fate.BROKEN)


# ---- ends and figures, spelt every way: dropped, never finished (issue 31, items 4, 11) ----
def _spelt(doc: object, rnd: random.Random) -> str:
    """`doc` as JSON with each character of its names and strings escaped or not, and
    spaces or tabs (or, split over `data:` lines, newlines) around its colons and commas."""

    def ws() -> str:
        return rnd.choice(["", "", " ", "\t", "\n", " \n "])

    def string(s: str) -> str:
        chars = (f"\\u{ord(c):04x}" if rnd.random() < 0.3 else json.dumps(c)[1:-1] for c in s)
        return '"' + "".join(chars) + '"'

    def write(v: object) -> str:
        if isinstance(v, dict):
            return (
                "{"
                + ",".join(ws() + string(k) + ws() + ":" + ws() + write(x) for k, x in v.items())
                + "}"
            )
        if isinstance(v, list):
            return "[" + ("," + ws()).join(write(x) for x in v) + "]"
        return string(v) if isinstance(v, str) else json.dumps(v)

    return write(doc)


_USAGE = {"input_tokens": 5, "output_tokens": 10, "completion_tokens": 10, "prompt_tokens": 5}
ENDINGS = {
    D.RESPONSES: [
        ("response.completed", {"sequence_number": 8, "response": {"status": "completed", "usage": _USAGE}}),
        ("response.incomplete", {"sequence_number": 8, "response": {"usage": _USAGE}}),
        ("response.failed", {"sequence_number": 8, "response": {"status": "failed"}}),
    ],
    D.MESSAGES: [
        ("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 10}}),
        ("message_stop", {}),
    ],
    D.CHAT: [(None, {"choices": [], "usage": _USAGE}), (None, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})],
    D.NATIVE: [(None, {"content": "", "stop": True, "timings": {"predicted_n": 10}})],
}  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    api=st.sampled_from(sorted(ENDINGS)),
    pick=st.integers(0, 2),
    extra=st.dictionaries(st.text(max_size=4), _json, max_size=3),
    rnd=st.randoms(use_true_random=False),
    named=st.booleans(),
)
def test_every_prefix_of_an_ending_event_in_any_spelling_is_dropped(api, pick, extra, rnd, named):
    name, fields = ENDINGS[api][pick % len(ENDINGS[api])]
    doc = {**({"type": name} if name else {}), **extra, **fields}
    items = list(doc.items())
    rnd.shuffle(items)
    data = _spelt(dict(items), rnd)
    head = f"event: {name}\n" if name and named else ""
    event = (head + "".join(f"data: {line}\n" for line in data.split("\n"))).encode()
    whole = [(e.name, e.data) for e in read(event + b"\n")]
    for i in range(len(head) + 1, len(event)):
        closing = close_event(event[:i], api, 8 if api == D.RESPONSES else None)
        got = [(e.name, e.data) for e in read(event[:i] + closing.tail)]
        if got == whole:
            # whole, its blank line missing: the upstream's own, nothing added (BROKEN when
            # even whole it is no JSON a strict parser takes: a lone surrogate's escape)
            assert closing.fate in (Fate.FINISHED, Fate.BROKEN)
            continue
        if closing.fate == Fate.BROKEN:
            # Nothing valid could be made of it (a lone surrogate's escape, say, which no
            # strict parser takes): left as it is, it parses as no event at all.
            for ev in read(event[:i] + closing.tail):
                with pytest.raises(ValueError):
                    view(api, ev)
            continue
        for ev in read(event[:i] + closing.tail):
            v = view(api, ev)
            assert not (v.end or v.figures or v.finish), (event[:i], closing)
        if api in (D.MESSAGES, D.RESPONSES):
            # (no ending event is a content delta)
            assert closing.fate == Fate.DROPPED, (event[:i], closing)

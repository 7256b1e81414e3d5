"""relay/stream/dialect.py `event_name` reads an event's name as the WHATWG event-stream rules
say a client does (issue 31, item 5): one optional space after the colon, the last `event`
field, lines ended by LF, CRLF or CR; and the data's `"type"` in every spelling JSON allows
when no field names it (item 11)."""

from __future__ import annotations

import pytest

from relay.stream import dialect as D
from relay.stream.sse import SseScanner
from tests.stream import spellings as S

DATA = b'data: {"type":"message_start","message":{}}'


@pytest.mark.parametrize(
    "ev",
    [
        b"event: message_start\n" + DATA,
        b"event:message_start\n" + DATA,
        b"id: 7\nevent:message_start\n" + DATA,
        b"retry: 100\nevent:message_start\n" + DATA,
        b"id: 7\nevent: message_start\n" + DATA,
        b": a comment\nevent:message_start\n" + DATA,
        b"event:message_start",
        b"id: 1\nevent:message_start",
        # the last `event` field wins
        b"event: ping\n" + DATA + b"\nevent:message_start",
    ],
)
@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_the_event_field(ev, ending):
    assert D.event_name(ev.replace(b"\n", ending)) == b"message_start"


def test_one_space_only_is_dropped():
    assert D.event_name(b"event:  message_start\n" + DATA) == b" message_start"
    assert D.event_name(b"id: 1\nevent:\tx\ndata: {}") == b"\tx"
    # a field named otherwise is not `event`
    assert D.event_name(b"events: x\ndata: {}") == b""


@pytest.mark.parametrize("spelling", list(S.SPELLINGS))
def test_the_data_type_in_every_spelling(spelling):
    doc = {"type": "message_stop", "x": {"type": "nested"}}
    ev = S.event(None, doc, S.SPELLINGS[spelling]).rstrip(b"\n")
    assert D.event_name(ev) == b"message_stop"
    # (no `type` at the top: none, not the nested one)
    ev = S.event(None, {"x": {"type": "nested"}}, S.SPELLINGS[spelling]).rstrip(b"\n")
    assert D.event_name(ev) == b""


def test_no_type_no_name():
    assert D.event_name(b'data: {"choices":[]}') == b""
    assert D.event_name(b"data: [DONE]") == b""
    assert D.event_name(b'data: {"type":3}') == b""
    assert D.event_name(b"id: 3") == b""


def test_a_stream_named_without_a_space_is_followed():
    # the scanner reads Anthropic's lifecycle by these names: a block open, then closed
    body = (
        b"id: 1\nevent:message_start\n" + DATA + b"\n\n"
        b"id: 2\nevent:content_block_start\r\n"
        b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text"}}\n\n'
        b"id: 3\nevent:message_stop\ndata: {}\n\n"
    )
    s = SseScanner(dialect=D.MESSAGES)
    s.feed(body[: body.index(b"id: 3")])
    assert s.started and s.blocks == {0: "text"}
    s.feed(body[body.index(b"id: 3") :])
    assert s.done_seen


@pytest.mark.parametrize("spelling", list(S.SPELLINGS))
def test_ends_in_every_spelling_are_the_streams_end(spelling):
    for api, end in ((D.MESSAGES, "message_stop"), (D.RESPONSES, "response.completed")):
        s = SseScanner(dialect=api)
        s.feed(S.event(None, {"type": end}, S.SPELLINGS[spelling]))
        assert s.done_seen, (api, spelling)

"""relay/stream/half_event.py: an event the upstream stopped in the middle of is finished so
that it parses - every prefix of every JSON event, the shapes the APIs' SDKs dispatch on."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.stream.half_event import MAX_CLOSE, PING, close_event, close_json

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
        (b"[DO", b"NE]"),
    ],
)
def test_closers(prefix, closer):
    assert close_json(prefix) == closer


def test_what_is_not_json_is_left_alone():
    assert close_json(b'{"a" 1') is None and close_json(b"}") is None
    assert close_event(b"data: {x") == b"\n\n"


def test_events():
    delta = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" fr'
    assert close_event(delta) == b'"}}\n\n'
    # a half name, an event with no data yet: a ping, which every SDK skips
    assert close_event(b"event: content_blo") == b"\n" + PING
    assert close_event(b"event: message_start\n") == PING
    # no name and no data: its blank line (an event without data is not dispatched)
    assert close_event(b"id: 4") == b"\n\n" and close_event(b"da") == b"\n\n"
    assert close_event(b'data: {"a":1}\n') == b"\n"  # whole, its blank line missing
    assert close_event(b"data: [DO") == b"NE]\n\n"
    assert close_event(b"data: ") == b"{}\n\n"
    assert close_event(b"") == b""
    assert close_event(b'data: {"a":"' + b"x" * MAX_CLOSE) == b"\n\n"  # bounded

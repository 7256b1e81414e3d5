"""The SSE scanner reads a stream alike whatever the spelling of its JSON (issue 31, item 11):
content events, figures kept, the stream's end, an error first, Anthropic's lifecycle, for
each API's stream written compact, spaced, with escaped names and values, loose, or over
several `data:` lines (tests/stream/spellings.py)."""

from __future__ import annotations

import json

import pytest

from relay.stream import dialect as D
from relay.stream.sse import SseScanner
from tests.stream import spellings as S

STREAMS = S.STREAMS


def reading(api: D.Api, body: bytes) -> tuple:
    s = SseScanner(dialect=api)
    s.feed(body)
    meta = [json.loads(D.data_of(m)) if m else None for m in (s.meta_first, s.meta)]
    return (
        s.dialect,
        s.content_events,
        s.done_seen,
        s.error_first,
        s.started,
        s.blocks,
        s.delta_seen,
        meta,
    )


@pytest.mark.parametrize("spelling", [s for s in S.SPELLINGS if s != "compact"])
@pytest.mark.parametrize("api", list(STREAMS))
def test_every_spelling_is_read_as_the_compact_one(api, spelling):
    compact, _ = STREAMS[api]()
    spelt, _ = STREAMS[api](S.SPELLINGS[spelling])
    want = reading(api, compact)
    assert want[1] >= 2 and want[2] and want[7][1] is not None  # (content, an end, figures)
    assert reading(api, spelt) == want


@pytest.mark.parametrize("spelling", list(S.SPELLINGS))
def test_an_error_first_in_every_spelling(spelling):
    s = SseScanner()
    s.feed(S.event(None, {"error": {"message": "boom", "type": "x"}}, S.SPELLINGS[spelling]))
    assert s.error_first


@pytest.mark.parametrize("api", list(STREAMS))
def test_a_compact_stream_is_read_by_its_markers_alone(api):
    # (what keeps the usual stream's cost: no other spelling looked for)
    s = SseScanner(dialect=api)
    s.feed(STREAMS[api]()[0])
    assert s.recognised and not s.spelt
    spelt = SseScanner(dialect=api)
    spelt.feed(STREAMS[api](S.spaced)[0])
    assert spelt.spelt

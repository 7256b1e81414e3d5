"""A stall inside the event that ends a stream or carries its figures (issue 31, item 4): the
half event is dropped, never finished into an end or a usage the upstream did not send; the
relay's stall frame is the stream's one end. Every cut of each API's last events, in every
spelling JSON allows (tests/stream/spellings.py), read as a client reads it
(tests/stream/sse_client.py); a content delta cut in its text is still finished."""

from __future__ import annotations

import json

import pytest

from relay.stream import dialect as D
from relay.stream.sse import SseScanner
from relay.stream.terminal import stall_frame
from tests.stream import spellings as S
from tests.stream.sse_client import check_cut, read, view

STREAMS = S.STREAMS


def frame_at(api: D.Api, body: bytes, cut: int) -> bytes:
    """What the relay sends once the upstream stalled after `body[:cut]`."""
    s = SseScanner(dialect=api)
    s.feed(body[:cut])
    return stall_frame(s, api, "m", "idle", 1.5, "llm", 7)


def done_cut(body: bytes, cut: int) -> bool:
    """The cut falls inside `data: [DONE]`: no JSON starts `[D`, so that event can only be
    `[DONE]` or broken. It is left as it came, ended by its blank line (see below)."""
    i = body.rfind(b"data: [DONE]")
    return i >= 0 and i + 6 < cut < i + len(b"data: [DONE]")


def test_the_issues_response_completed_cut_after_status_comp():
    body, _ = S.responses()
    cut = body.index(b'"status":"comp', body.index(b"response.completed")) + 14
    frame = frame_at(D.RESPONSES, body, cut)
    seen = check_cut(D.RESPONSES, body, cut, frame)
    kinds = [v.kind for _, v in seen]
    assert "response.completed" not in kinds and kinds[-2:] == ["ping", "response.incomplete"]
    # the relay's own end, numbered after every event the client got
    last = seen[-1][1]
    assert last.relay and last.doc["response"]["status"] == "incomplete"
    assert [v.seq for _, v in seen[-3:]] == [7, 8, 9]


def test_the_issues_usage_cut_inside_output_tokens():
    for api in (D.RESPONSES, D.MESSAGES):
        body, _ = STREAMS[api]()
        cut = body.rindex(b'"output_tokens":10') + len(b'"output_tokens":1')
        seen = check_cut(api, body, cut, frame_at(api, body, cut))
        figures = [v.doc for _, v in seen if v.figures and v.relay]
        assert len(figures) == 1  # the relay's own, counting the content events: 3
        usage = figures[0]["response"]["usage"] if api == D.RESPONSES else figures[0]["usage"]
        assert usage["output_tokens"] == 3


@pytest.mark.parametrize("api", list(STREAMS))
def test_every_cut_of_each_apis_stream_keeps_the_rules(api):
    body, _ = STREAMS[api]()
    for cut in range(len(body) + 1):
        frame = frame_at(api, body, cut)
        if done_cut(body, cut):
            assert frame.startswith(b"\n\n"), "[DONE] cut: nothing added to it"
            continue
        check_cut(api, body, cut, frame)


@pytest.mark.parametrize("spelling", [s for s in S.SPELLINGS if s != "compact"])
@pytest.mark.parametrize("api", list(STREAMS))
def test_every_cut_of_the_ending_events_in_every_spelling(api, spelling):
    body, start = STREAMS[api](S.SPELLINGS[spelling])
    for cut in range(start, len(body) + 1):
        frame = frame_at(api, body, cut)
        if not done_cut(body, cut):
            check_cut(api, body, cut, frame)


@pytest.mark.parametrize("api", [D.CHAT, D.MESSAGES, D.RESPONSES])
def test_a_content_delta_cut_in_its_text_is_still_finished(api):
    body, start = STREAMS[api]()
    text = b'"text":"' if api == D.MESSAGES else b'"delta":"' if api == D.RESPONSES else None
    marker = text or b'"content":"'
    at = body.rindex(marker, 0, start) + len(marker)
    ev_start = body.rfind(b"\n\n", 0, at) + 2
    for cut in range(at + 1, body.index(b'"', at)):
        seen = check_cut(api, body, cut, frame_at(api, body, cut))
        [doc] = [v.doc for e, v in seen if e.start == ev_start]
        if api == D.MESSAGES:
            got = doc["delta"]["text"]
        elif api == D.RESPONSES:
            got = doc["delta"]
        else:
            got = doc["choices"][0]["delta"]["content"]
        assert got == body[at:cut].decode()


def test_a_stall_after_message_delta_ends_with_the_relays_message_stop_only():
    body, _ = S.messages()
    cut = body.rindex(b"event: message_stop")
    for at in (cut, cut + 10, len(body) - 4):  # before it, in its name, in its data
        seen = check_cut(D.MESSAGES, body, at, frame_at(D.MESSAGES, body, at))
        kinds = [v.kind for _, v in seen]
        assert kinds.count("message_delta") == 1 and kinds.count("message_stop") == 1
        [delta] = [v.doc for _, v in seen if v.kind == "message_delta"]
        assert delta["usage"] == {"output_tokens": 10}  # the upstream's, whole
        # the relay's message_stop tells the stall apart
        assert seen[-1][1].doc["x_relay_stall"]["reason"] == "idle"


@pytest.mark.parametrize("ending", [b"\r\n", b"\r"])
def test_a_half_event_with_cr_line_ends(ending):
    body, _ = S.responses()
    body = body.replace(b"\n", ending)
    cut = body.index(b'"status":"comp', body.index(b"response.completed")) + 14
    seen = check_cut(D.RESPONSES, body, cut, frame_at(D.RESPONSES, body, cut))
    assert [v.kind for _, v in seen][-2:] == ["ping", "response.incomplete"]
    # a whole data line ended by a lone CR: the blank line after it is not taken for its LF
    cut = body.index(ending + ending, body.index(b"response.completed")) + 1
    seen = check_cut(D.RESPONSES, body, cut, frame_at(D.RESPONSES, body, cut))
    assert seen[-1][1].kind == "response.completed" and not seen[-1][1].relay


def test_a_half_field_name_data_is_not_a_data_line():
    # `data` alone is a data field with an empty value: the openai SDK would parse ""
    body, _ = S.chat()
    cut = body.rindex(b"data: [DONE]") + 4
    seen = check_cut(D.CHAT, body, cut, frame_at(D.CHAT, body, cut))
    assert json.loads(seen[-2][0].data)["x_relay_stall"]["reason"] == "idle"


def test_a_whole_end_event_without_its_blank_line_is_the_upstreams_end():
    # nothing of it is made up: the stream's own end, no frame after it
    for api in (D.MESSAGES, D.RESPONSES, D.CHAT):
        body, _ = STREAMS[api]()
        cut = len(body) - 1
        frame = frame_at(api, body, cut)
        assert frame == b"\n"
        *_, (_, v) = check_cut(api, body, cut, frame)
        assert v.end and not v.relay


def test_the_read_model_itself():
    # (the tests' client: the last event field names the event; one space is dropped)
    raw = b"event: a\r\nevent:b\rdata:  x\ndata:y\n\n: c\n\nevent: e\n\n"
    assert [(e.name, e.data) for e in read(raw)] == [("b", " x\ny"), ("e", None)]
    with pytest.raises(AssertionError):
        view(D.RESPONSES, read(b'event: a\ndata: {"type":"b"}\n\n')[0])

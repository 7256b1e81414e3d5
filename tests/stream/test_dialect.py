"""Anthropic Messages and OpenAI Responses streams read in their own terms (issue 22): the API
recognised by its events, what counts as content, exact usage, the terminal frames and
in-band errors in each API's shape (relay/stream/dialect.py, sse.py, usage.py, terminal.py)."""

from __future__ import annotations

import json

import pytest

from relay.stream import dialect as D
from relay.stream.content_hold import error_of
from relay.stream.sse import SseScanner
from relay.stream.terminal import error_events, stall_frame
from relay.stream.usage import stream_usage


def sse(name: str, doc: dict) -> bytes:
    return (
        b"event: "
        + name.encode()
        + b"\ndata: "
        + json.dumps(doc, separators=(",", ":")).encode()
        + b"\n\n"
    )


def msg(name: str, **fields) -> bytes:
    return sse(name, {"type": name, **fields})


MESSAGE_START = msg(
    "message_start",
    message={
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "tiny",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 17, "cache_read_input_tokens": 3, "output_tokens": 0},
    },
)


def text_block(index: int) -> bytes:
    return msg("content_block_start", index=index, content_block={"type": "text", "text": ""})


def text_delta(index: int, text: str) -> bytes:
    return msg("content_block_delta", index=index, delta={"type": "text_delta", "text": text})


TOOL_BLOCK = msg(
    "content_block_start",
    index=1,
    content_block={"type": "tool_use", "id": "toolu_1", "name": "get", "input": {}},
)


def json_delta(text: str) -> bytes:
    return msg(
        "content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": text}
    )


MESSAGE_END = (
    msg("content_block_stop", index=0)
    + msg(
        "message_delta",
        delta={"stop_reason": "end_turn", "stop_sequence": None},
        usage={"output_tokens": 42},
    )
    + msg("message_stop")
)


def scan(data: bytes, path: str = "/v1/chat/completions") -> SseScanner:
    s = SseScanner(dialect=D.from_path(path))
    for i in range(0, len(data), 7):  # reads cut anywhere
        s.feed(data[i : i + 7])
    return s


def test_messages_recognised_counted_and_their_usage_read_whatever_the_path():
    body = (
        MESSAGE_START
        + text_block(0)
        + text_delta(0, "Hel")
        + text_delta(0, "")
        + text_delta(0, "lo")
        + msg("ping")
        + MESSAGE_END
    )
    for path in ("/v1/messages", "/v1/chat/completions", "/api/anthropic/v1/messages"):
        s = scan(body, path)
        assert s.dialect == D.MESSAGES and s.content_events == 2
        assert s.done_seen and s.started and s.blocks == {}
        usage = stream_usage(s.meta, s.meta_first)
        # the prompt figure is input + cache read + cache creation; output the last cumulative
        assert (usage.prompt_tokens, usage.completion_tokens) == (20, 42)


def test_tool_input_and_thinking_deltas_are_content():
    think = msg("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "hm"})
    sig = msg("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "x"})
    s = scan(MESSAGE_START + think + sig + TOOL_BLOCK + json_delta("") + json_delta('{"a"'))
    assert s.content_events == 2 and s.blocks == {1: "tool_use"}
    assert not s.done_seen


def stall(s: SseScanner | None, path: str = "/v1/messages") -> bytes:
    return stall_frame(s, D.from_path(path), "m", "idle", 1.5, "llm", 7)


INFO = {"reason": "idle", "elapsed_s": 1.5, "upstream": "llm"}
NOTICE = "\n\n[relay] stall guard: idle after 1.5s"


def events(frame: bytes) -> list[tuple[str, dict]]:
    assert frame.startswith(b"\n\n") and frame.endswith(b"\n\n") and b"[DONE]" not in frame
    out = []
    for ev in frame.strip(b"\n").split(b"\n\n"):
        name, data = ev.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        doc = json.loads(data[6:])
        assert doc["type"] == name[7:].decode()
        out.append((name[7:].decode(), doc))
    return out


def test_messages_stall_in_a_text_block_ends_it_with_the_notice():
    s = scan(MESSAGE_START + text_block(0) + text_delta(0, "Hi"))
    assert events(stall(s)) == [
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": NOTICE},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                "usage": {"output_tokens": 1},
                "x_relay_stall": INFO,
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def test_messages_stall_in_a_tool_block_puts_no_text_in_it():
    s = scan(
        MESSAGE_START + text_block(0) + text_delta(0, "a") + msg("content_block_stop", index=0)
    )
    s.feed(TOOL_BLOCK + json_delta('{"x":'))
    got = events(stall(s))
    assert [name for name, _ in got] == ["content_block_stop", "message_delta", "message_stop"]
    assert got[0][1]["index"] == 1 and got[1][1]["usage"] == {"output_tokens": 2}
    # between blocks: no block to close
    s = scan(
        MESSAGE_START + text_block(0) + text_delta(0, "a") + msg("content_block_stop", index=0)
    )
    assert [name for name, _ in events(stall(s))] == ["message_delta", "message_stop"]


def test_messages_stall_with_a_text_block_left_open_under_a_tool_block():
    # llama-server closes a text block only at the end, after the tool_use block opened
    s = scan(MESSAGE_START + text_block(0) + text_delta(0, "a") + TOOL_BLOCK + json_delta('{"x'))
    got = events(stall(s))
    assert [(name, doc.get("index")) for name, doc in got] == [
        ("content_block_stop", 0),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]


def test_messages_stall_before_message_start_is_an_error_event():
    for s in (None, scan(b": ping\n\n", "/v1/messages")):
        [(name, doc)] = events(stall(s))
        assert name == "error"
        assert doc == {
            "type": "error",
            "error": {"type": "api_error", "message": NOTICE.strip()},
            "x_relay_stall": INFO,
        }


def test_no_frame_after_the_streams_own_end():
    assert stall(scan(MESSAGE_START + text_block(0) + text_delta(0, "a") + MESSAGE_END)) == b""


RESPONSE = {
    "id": "resp_7",
    "object": "response",
    "created_at": 5,
    "status": "in_progress",
    "model": "tiny",
    "output": [],
    "usage": None,
}


def rsp(name: str, seq: int, **fields) -> bytes:
    return sse(name, {"type": name, "sequence_number": seq, **fields})


def responses_stream(text: str) -> bytes:
    item = {
        "id": "msg_1",
        "type": "message",
        "status": "in_progress",
        "content": [],
        "role": "assistant",
    }
    part = {"type": "output_text", "text": "", "annotations": []}
    out = [
        rsp("response.created", 0, response=RESPONSE),
        rsp("response.in_progress", 1, response=RESPONSE),
        rsp("response.output_item.added", 2, output_index=0, item=item),
        rsp(
            "response.content_part.added",
            3,
            item_id="msg_1",
            output_index=0,
            content_index=0,
            part=part,
        ),
    ]
    for i, piece in enumerate(text.split(" ")):
        out.append(
            rsp(
                "response.output_text.delta",
                4 + i,
                item_id="msg_1",
                output_index=0,
                content_index=0,
                delta=piece,
            )
        )
    return b"".join(out)


def responses_end(text: str, seq: int) -> bytes:
    done_part = {"type": "output_text", "text": text, "annotations": []}
    final = {
        **RESPONSE,
        "status": "completed",
        "output": [{"type": "message", "content": [done_part]}],
        "usage": {"input_tokens": 11, "output_tokens": 5, "total_tokens": 16},
    }
    return (
        rsp(
            "response.output_text.done",
            seq,
            item_id="msg_1",
            output_index=0,
            content_index=0,
            text=text,
        )
        + rsp(
            "response.content_part.done",
            seq + 1,
            item_id="msg_1",
            output_index=0,
            content_index=0,
            part=done_part,
        )
        + rsp("response.completed", seq + 2, response=final)
    )


def test_responses_count_deltas_only_and_read_usage_under_response():
    body = responses_stream("one two three") + responses_end("one two three", 7)
    for path in ("/v1/responses", "/v1/chat/completions"):
        s = scan(body, path)
        # the .done events and response.completed repeat the text: not content
        assert s.dialect == D.RESPONSES and s.content_events == 3 and s.done_seen
        assert not s.shortcut  # (the fast path knows `content` / `text` markers only)
        usage = stream_usage(s.meta, s.meta_first)
        assert (usage.prompt_tokens, usage.completion_tokens) == (11, 5)


def test_responses_stall_is_response_incomplete_of_the_same_response():
    s = scan(responses_stream("a b"))
    [(name, doc)] = events(stall(s, "/v1/responses"))
    assert name == "response.incomplete"
    want = {k: v for k, v in RESPONSE.items() if k != "output"}  # the client keeps its items
    want.update(
        status="incomplete",
        incomplete_details={"reason": "max_output_tokens"},
        usage={"input_tokens": 0, "output_tokens": 2, "total_tokens": 2},
    )
    assert doc == {
        "type": "response.incomplete",
        "sequence_number": 6,
        "response": want,
        "x_relay_stall": INFO,
    }


def test_responses_stall_before_response_created_is_an_error_event():
    [(name, doc)] = events(stall(None, "/v1/responses"))
    assert (name, doc["code"], doc["message"]) == ("error", "server_error", NOTICE.strip())
    assert doc["x_relay_stall"] == INFO


@pytest.mark.parametrize(
    "body",
    [
        msg("error", error={"type": "overloaded_error", "message": "Overloaded"}),
        rsp("response.created", 0, response=RESPONSE)
        + rsp(
            "response.failed",
            1,
            response={
                **RESPONSE,
                "status": "failed",
                "error": {"code": "server_error", "message": "Overloaded"},
            },
        ),
        rsp("response.created", 0, response=RESPONSE)
        + sse(
            "error",
            {
                "type": "error",
                "code": "server_error",
                "message": "Overloaded",
                "sequence_number": 1,
            },
        ),
    ],
)
def test_failure_events_before_content_are_errors_first(body):
    s = scan(body, "/v1/chat/completions")  # (recognised by their events)
    assert s.error_first and s.content_events == 0
    s = scan(body, "/v1/messages" if b"overloaded_error" in body else "/v1/responses")
    assert s.error_first and s.done_seen and s.content_events == 0
    errs = [error_of(ev.split(b"data: ", 1)[1]) for ev in body.split(b"\n\n") if b"data: " in ev]
    assert [e.message for e in errs if e is not None] == ["Overloaded"]


def test_a_failure_after_content_is_not_an_error_first():
    s = scan(MESSAGE_START + text_block(0) + text_delta(0, "a"))
    s.feed(msg("error", error={"type": "overloaded_error", "message": "x"}))
    assert not s.error_first and s.done_seen


def test_in_band_errors_in_each_apis_shape():
    chat = error_events(D.CHAT, "gone", "server_error", "upstream_unavailable")
    assert chat.endswith(b"data: [DONE]\n\n") and chat.startswith(b'data: {"error":')
    native = error_events(D.NATIVE, "gone", "server_error", "upstream_unavailable")
    assert native.startswith(b'data: {"error":') and b"[DONE]" not in native
    anthropic = events(b"\n\n" + error_events(D.MESSAGES, "busy", "server_error", "upstream_busy"))
    assert anthropic == [
        ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
    ]
    timeout = events(b"\n\n" + error_events(D.MESSAGES, "t", "timeout_error", "upstream_timeout"))
    assert timeout[0][1]["error"]["type"] == "timeout_error"
    [(name, doc)] = events(
        b"\n\n" + error_events(D.RESPONSES, "gone", "server_error", "upstream_unavailable")
    )
    assert name == "error"
    assert doc == {
        "type": "error",
        "code": "upstream_unavailable",
        "message": "gone",
        "param": None,
    }


@pytest.mark.parametrize(
    "ev,api",
    [
        (MESSAGE_START, D.MESSAGES),
        (b'data: {"type":"message_start","message":{}}', D.MESSAGES),
        (rsp("response.created", 0, response=RESPONSE), D.RESPONSES),
        (b'data: {"type":"response.created","response":{}}', D.RESPONSES),
        (b'data: {"id":"x","object":"chat.completion.chunk","choices":[]}', D.CHAT),
        (b'data: {"choices":[{"text":"a"}],"object":"text_completion"}', D.TEXT),
        (b'data: {"index":0,"content":"a","tokens":[],"stop":false}', D.NATIVE),
        (b": ping", None),
        (b"id: 7\nevent: message_start\ndata: {}", D.MESSAGES),
        (b"retry: 100\nevent: response.created\ndata: {}", D.RESPONSES),
        (b"id: " + b"x" * 60 + b'\ndata: {"type":"response.created","response":{}}', D.RESPONSES),
        (b'data: {"error":{"message":"x"}}', None),
    ],
)
def test_recognise(ev, api):
    assert D.recognise(ev) == api


def test_a_retry_event_first_does_not_hide_the_api():
    # the first event names no API: the next one that does decides
    body = b"retry: 1000\n\n" + responses_stream("a b") + responses_end("a b", 6)
    s = scan(body)
    assert s.dialect == D.RESPONSES and s.content_events == 2

"""Unit tests for relay/stall.py: StallPolicy deadlines and the exact stall frame bytes."""

from __future__ import annotations

import json
import random

import pytest

from relay.stream.stall import DONE_EVENT, StallPolicy, stall_frame, stall_notice

INF = float("inf")


# ---- StallPolicy.due: truth table (head_at, last_read, now) -> reason ------------------------
@pytest.mark.parametrize(
    "idle,total,read,head,last,now,want",
    [
        # idle only
        (10, 0, 300, 0, 100, 109.999, None),
        (10, 0, 300, 0, 100, 110, "idle"),  # exactly at the deadline
        (10, 0, 300, 0, 100, 500, "idle"),
        (10, 0, 300, 0, 0, 9.999, None),
        (10, 0, 5, 0, 100, 106, None),  # read_s ignored when a bound is on
        (10, 0, 300, 0, 999, 1000, None),  # a huge total time never trips "total" when off
        # total only
        (0, 60, 300, 0, 59.9, 59.999, None),
        (0, 60, 300, 0, 0, 60, "total"),  # exactly at the deadline
        (0, 60, 300, 10, 10, 69.999, None),  # long idle gap never trips "idle" when off
        (0, 60, 300, 10, 10, 70, "total"),
        # both
        (10, 60, 300, 0, 50, 60, "total"),  # both due: total wins
        (10, 60, 300, 0, 45, 55, "idle"),
        (10, 60, 300, 0, 55, 59.999, None),
        (10, 60, 300, 0, 55, 65, "total"),
        (10, 60, 300, 0, 0, 10, "idle"),
        # both zero -> read with read_s
        (0, 0, 30, 0, 100, 129.999, None),
        (0, 0, 30, 0, 100, 130, "read"),
        (0, 0, 30, 0, 100, 10_000, "read"),
        (0, 0, 30, 0, 1000, 1001, None),  # no total bound at all
    ],
)
def test_due(idle, total, read, head, last, now, want):
    assert StallPolicy(idle_s=idle, total_s=total, read_s=read).due(now, head, last) == want


@pytest.mark.parametrize(
    "idle,total,read,head,last,want",
    [
        (10, 0, 300, 0, 100, 110),
        (0, 60, 300, 0, 100, 60),
        (10, 60, 300, 0, 45, 55),
        (10, 60, 300, 0, 55, 60),
        (10, 60, 300, 0, 50, 60),
        (0, 0, 30, 0, 100, 130),
        (0, 0, 30, 7, 7, 37),
    ],
)
def test_next_check(idle, total, read, head, last, want):
    p = StallPolicy(idle_s=idle, total_s=total, read_s=read)
    assert p.next_check(head, last) == want
    assert p.due(want, head, last) is not None
    assert p.due(want - 0.001, head, last) is None


def test_next_check_is_the_earliest_due_moment_random():
    rnd = random.Random(7)
    for _ in range(2000):
        idle = rnd.choice([0, 1, 10, 300])
        total = rnd.choice([0, 5, 60, 900])
        p = StallPolicy(idle_s=idle, total_s=total, read_s=rnd.choice([30, 300]))
        head = rnd.randint(0, 1000)
        last = head + rnd.randint(0, 2000)
        at = p.next_check(head, last)
        assert at < INF
        assert p.due(at, head, last) is not None
        assert p.due(at - 0.5, head, last) is None


@pytest.mark.parametrize(
    "reason,now,head,last,want",
    [
        ("total", 100.0, 10.0, 95.0, 90.0),
        ("idle", 100.0, 10.0, 95.0, 5.0),
        ("read", 130.0, 0.0, 100.0, 30.0),
        ("idle", 100.12345, 0.0, 0.0, 100.123),
        ("total", 0.3, 0.1, 0.2, 0.2),
    ],
)
def test_elapsed(reason, now, head, last, want):
    assert StallPolicy(1, 1, 1).elapsed(reason, now, head, last) == want


# ---- stall_frame exact bytes ----------------------------------------------------------------
CHAT_EXPECTED = (
    b'\n\ndata: {"id":"relay-stall-guard","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"llm-7b","choices":[{"index":0,"delta":{"role":"assistant","content":'
    b'"\\n\\n[relay] stall guard: idle after 300.0s"},"finish_reason":"length"}],'
    b'"x_relay_stall":{"reason":"idle","elapsed_s":300.0,"upstream":"llm"}}\n\n'
    b"data: [DONE]\n\n"
)
LEGACY_EXPECTED = (
    b'\n\ndata: {"id":"relay-stall-guard","object":"text_completion","created":1700000000,'
    b'"model":"llm-7b","choices":[{"index":0,"text":'
    b'"\\n\\n[relay] stall guard: total after 12.345s","finish_reason":"length"}],'
    b'"x_relay_stall":{"reason":"total","elapsed_s":12.345,"upstream":"gpu-1"}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions", "/", "/v1/foo"])
def test_chat_shape_exact(path):
    assert stall_frame(path, "llm-7b", "idle", 300.0, "llm", 1700000000) == CHAT_EXPECTED


@pytest.mark.parametrize("path", ["/v1/completions", "/completion"])
def test_legacy_shape_exact(path):
    assert stall_frame(path, "llm-7b", "total", 12.345, "gpu-1", 1700000000) == LEGACY_EXPECTED


def _event(frame: bytes) -> dict:
    assert frame.startswith(b"\n\ndata: ")
    assert frame.endswith(b"\n\n" + DONE_EVENT)
    body = frame[len(b"\n\ndata: ") : -len(b"\n\n" + DONE_EVENT)]
    assert b"\n" not in body  # one compact line
    return json.loads(body)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/completion"])
@pytest.mark.parametrize("reason", ["total", "idle", "read"])
def test_frame_structure(path, reason):
    frame = stall_frame(path, 'm"\u00e9', reason, 1.5, "up", 42)
    assert frame.count(b"data: [DONE]") == 1 and frame.endswith(b"data: [DONE]\n\n")
    assert frame.count(b"\n\n") == 3  # leading blank line, end of event, end of [DONE]
    obj = _event(frame)
    assert list(obj) == ["id", "object", "created", "model", "choices", "x_relay_stall"]
    assert obj["id"] == "relay-stall-guard" and obj["created"] == 42
    assert obj["model"] == 'm"\u00e9'
    assert obj["x_relay_stall"] == {"reason": reason, "elapsed_s": 1.5, "upstream": "up"}
    [choice] = obj["choices"]
    notice = f"\n\n[relay] stall guard: {reason} after 1.5s"
    if path == "/v1/chat/completions":
        assert obj["object"] == "chat.completion.chunk"
        assert choice == {
            "index": 0,
            "delta": {"role": "assistant", "content": notice},
            "finish_reason": "length",
        }
        assert list(choice) == ["index", "delta", "finish_reason"]
    else:
        assert obj["object"] == "text_completion"
        assert choice == {"index": 0, "text": notice, "finish_reason": "length"}
        assert list(choice) == ["index", "text", "finish_reason"]


def test_stall_notice_and_done_event():
    assert stall_notice("read", 30.0) == "\n\n[relay] stall guard: read after 30.0s"
    assert DONE_EVENT == b"data: [DONE]\n\n"


def test_policy_is_immutable():
    p = StallPolicy(1, 2, 3)
    with pytest.raises(AttributeError):
        p.idle_s = 5

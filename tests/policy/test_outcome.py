"""relay/policy/outcome.py without sockets: how a request ended, from the facts its dispatcher
recorded (the last exchange's summary, whether content went out, the error it was answered
with, a cut, the drain of a finished response, a bug). Each expected value is written out."""

from __future__ import annotations

import pytest
from msgspec.structs import astuple

from relay.errors import Code, Outcome, RelayError, shutting_down, upstream_error
from relay.policy.outcome import decide
from relay.stream.dialect import Api
from relay.stream.stall import Stall, StallReason
from relay.stream.summary import ExchangeSummary


def summary(ending: Outcome, status: int = 200, **kw) -> ExchangeSummary:
    return ExchangeSummary("llm", ending, status, False, False, True, Api.CHAT, **kw)


def unavailable() -> RelayError:
    return RelayError(Code.UPSTREAM_UNAVAILABLE, "upstream failed before the first content event")


def test_a_served_stream_that_ended_is_done_and_ok():
    v = decide(summary(Outcome.DONE), True, None)
    assert astuple(v) == (Outcome.DONE, None, 200, True, True)


def test_an_upstream_status_over_400_passed_on_is_its_code():
    v = decide(summary(Outcome.DONE, 503), True, None)
    assert astuple(v) == (Outcome.DONE, "upstream_503", 503, True, False)


@pytest.mark.parametrize(
    "drained", [Outcome.CLIENT_CLOSED, Outcome.CLIENT_WRITE_TIMEOUT]
)  # fmt: skip
def test_a_finished_response_the_client_did_not_read_whole(drained):
    v = decide(summary(Outcome.DONE), True, None, drained=drained)
    assert astuple(v) == (drained, drained.value, 200, True, False)


def test_a_2xx_stream_of_only_an_error_event():
    v = decide(summary(Outcome.DONE, error_only=True), True, None)
    assert astuple(v) == (Outcome.UPSTREAM_ERROR_EVENT, "upstream_error_event", 200, True, False)


def test_a_stall_after_content_is_its_reason_s_code():
    v = decide(summary(Outcome.STALL, stall=Stall(StallReason.IDLE, 30.0)), True, None)
    assert astuple(v) == (Outcome.STALL, "stream_stall_idle", 200, True, False)


@pytest.mark.parametrize(
    "ending", [Outcome.UPSTREAM_DROPPED, Outcome.UPSTREAM_BAD_FRAMING, Outcome.STALL]
)
def test_the_last_candidate_failing_before_content_is_answered_not_served(ending):
    v = decide(summary(ending), False, unavailable())
    assert astuple(v) == (ending, "upstream_unavailable", 502, False, False)


def test_an_upstream_error_event_before_content_is_passed_on_and_served():
    err = upstream_error(200, None, Code.UPSTREAM_ERROR, "upstream llm answered with an error")
    v = decide(summary(Outcome.UPSTREAM_ERROR_EVENT), False, err)
    assert astuple(v) == (Outcome.UPSTREAM_ERROR_EVENT, "upstream_error_event", 200, True, False)


def test_a_response_that_cannot_continue_heartbeats_is_an_error_served():
    err = upstream_error(500, None, "upstream_500", "upstream llm answered 500")
    v = decide(summary(Outcome.DONE, 500), False, err)
    assert astuple(v) == (Outcome.ERROR, "upstream_500", 500, True, False)


def test_the_drain_cutting_the_wait_for_a_head_is_shutdown():
    v = decide(summary(Outcome.SHUTDOWN, 0), False, shutting_down())
    assert astuple(v) == (Outcome.SHUTDOWN, "shutdown", 503, False, False)


def test_a_relay_refusal_before_any_upstream_is_an_error():
    err = RelayError(Code.MODEL_NOT_FOUND, "no upstream serves model 'x'")
    assert astuple(decide(None, False, err)) == (
        Outcome.ERROR,
        "model_not_found",
        404,
        False,
        False,
    )


def test_a_queued_request_the_drain_refuses_is_an_error():
    assert astuple(decide(None, False, shutting_down())) == (
        Outcome.ERROR,
        "shutting_down",
        503,
        False,
        False,
    )


def test_a_client_gone_mid_stream_is_its_cut_and_served():
    v = decide(summary(Outcome.SHUTDOWN), True, None, cut=Outcome.CLIENT_CLOSED)
    assert astuple(v) == (Outcome.CLIENT_CLOSED, "client_closed", 200, True, False)


def test_a_client_gone_while_queued_has_no_status():
    v = decide(None, False, None, cut=Outcome.CLIENT_CLOSED)
    assert astuple(v) == (Outcome.CLIENT_CLOSED, "client_closed", None, False, False)


def test_the_drain_cutting_a_held_request_answers_503_shutdown():
    v = decide(summary(Outcome.SHUTDOWN), False, shutting_down(), cut=Outcome.SHUTDOWN)
    assert astuple(v) == (Outcome.SHUTDOWN, "shutdown", 503, False, False)


def test_a_bug_is_an_internal_error_whatever_else_happened():
    err = RelayError(Code.INTERNAL_ERROR, "internal relay error")
    v = decide(summary(Outcome.DONE), False, err, bug=True)
    assert astuple(v) == (Outcome.INTERNAL_ERROR, "internal_error", 500, True, False)
    assert decide(summary(Outcome.DONE), True, None, bug=True).outcome is Outcome.INTERNAL_ERROR

"""Unit tests for relay/errors.py: status, type and exact OpenAI-shaped JSON bodies."""

from __future__ import annotations

import json

import pytest

from relay.errors import RelayError, reason_phrase

# DESIGN.md "Errors the relay itself produces": code -> (status, type)
DESIGN_TABLE = [
    ("bad_request", 400, "invalid_request_error"),
    ("invalid_json", 400, "invalid_request_error"),
    ("invalid_api_key", 401, "authentication_error"),
    ("model_not_found", 404, "invalid_request_error"),
    ("request_timeout", 408, "timeout_error"),
    ("request_too_large", 413, "invalid_request_error"),
    ("budget_exceeded", 429, "rate_limit_error"),
    ("headers_too_large", 431, "invalid_request_error"),
    ("upstream_unavailable", 502, "upstream_error"),
    ("upstream_busy", 503, "server_error"),
    ("upstream_timeout", 504, "timeout_error"),
]


@pytest.mark.parametrize("code,status,type_", DESIGN_TABLE)
def test_every_design_code(code, status, type_):
    err = RelayError(code, "msg")
    assert (err.code, err.status, err.type) == (code, status, type_)
    assert err.body() == (
        b'{"error":{"message":"msg","type":"'
        + type_.encode()
        + b'","code":"'
        + code.encode()
        + b'","param":null,"details":{}}}'
    )
    assert err.headers == [] and err.details == {} and str(err) == "msg"
    assert isinstance(err, Exception)


def test_budget_exceeded_body_exact():
    err = RelayError(
        "budget_exceeded",
        "daily token budget used up",
        {
            "limit": "daily_tokens",
            "used": 100000,
            "limit_value": 100000,
            "resets_at": "2026-01-02T00:00:00Z",
        },
        headers=[(b"Retry-After", b"3600")],
    )
    assert err.status == 429
    assert err.headers == [(b"Retry-After", b"3600")]
    assert err.body() == (
        b'{"error":{"message":"daily token budget used up","type":"rate_limit_error",'
        b'"code":"budget_exceeded","param":null,"details":{"limit":"daily_tokens",'
        b'"used":100000,"limit_value":100000,"resets_at":"2026-01-02T00:00:00Z"}}}'
    )


def test_upstream_unavailable_body_exact():
    err = RelayError(
        "upstream_unavailable",
        "no upstream reachable",
        {"upstream": "llm", "error": "connection refused"},
    )
    assert err.body() == (
        b'{"error":{"message":"no upstream reachable","type":"upstream_error",'
        b'"code":"upstream_unavailable","param":null,"details":{"upstream":"llm",'
        b'"error":"connection refused"}}}'
    )


def test_body_key_order_and_escaping():
    err = RelayError("invalid_json", 'bad "json"\n\u00e9', {"pos": 3})
    obj = json.loads(err.body())
    assert list(obj) == ["error"]
    assert list(obj["error"]) == ["message", "type", "code", "param", "details"]
    assert obj["error"]["message"] == 'bad "json"\n\u00e9'
    assert obj["error"]["param"] is None and obj["error"]["details"] == {"pos": 3}
    assert b'"bad \\"json\\"\\n' in err.body()


def test_unknown_code_rejected():
    with pytest.raises(KeyError):
        RelayError("no_such_code", "x")


@pytest.mark.parametrize(
    "status,phrase",
    [
        (200, b"OK"),
        (400, b"Bad Request"),
        (401, b"Unauthorized"),
        (404, b"Not Found"),
        (408, b"Request Timeout"),
        (429, b"Too Many Requests"),
        (431, b"Request Header Fields Too Large"),
        (502, b"Bad Gateway"),
        (503, b"Service Unavailable"),
        (504, b"Gateway Timeout"),
        (599, b""),
        (999, b""),
    ],
)
def test_reason_phrase(status, phrase):
    assert reason_phrase(status) == phrase


def test_reason_phrase_413():
    # the phrase changed name in Python 3.13 (RFC 9110 "Content Too Large")
    assert reason_phrase(413) in (b"Request Entity Too Large", b"Content Too Large")

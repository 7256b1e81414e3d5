"""The errors the relay answers with, and the outcomes a request can have (a leaf: it imports
nothing of relay).

Both are `StrEnum`s whose members are named as their values: the value is what a response
body, a row, a log line or a metric label carries, byte for byte (docs/apis.md, "Errors the
relay itself produces"; docs/operations.md, "Rows").
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum, auto
from http import HTTPStatus
from typing import NamedTuple

import msgspec

Headers = list[tuple[bytes, bytes]]


class Code(StrEnum):
    """An error code of the relay's own answers (`error.code`) and of rows (`error_code`)."""

    BAD_REQUEST = auto()
    INVALID_JSON = auto()
    INVALID_API_KEY = auto()
    FORBIDDEN = auto()
    MODEL_NOT_FOUND = auto()
    NOT_FOUND = auto()
    METHOD_NOT_ALLOWED = auto()
    REQUEST_TIMEOUT = auto()
    REQUEST_TOO_LARGE = auto()
    BUDGET_EXCEEDED = auto()
    # A key's limits that act now (`policy.limits`): requests at once, per minute.
    CONCURRENCY_EXCEEDED = auto()
    RATE_LIMIT_EXCEEDED = auto()
    HEADERS_TOO_LARGE = auto()
    INTERNAL_ERROR = auto()
    NOT_IMPLEMENTED = auto()
    UPSTREAM_UNAVAILABLE = auto()
    UPSTREAM_BAD_RESPONSE = auto()
    UPSTREAM_BUSY = auto()
    SHUTTING_DOWN = auto()
    SERVER_BUSY = auto()
    UPSTREAM_TIMEOUT = auto()
    # An upstream's in-band error passed on, when the upstream named no code of its own.
    UPSTREAM_ERROR = auto()


class Outcome(StrEnum):
    """How a request ended, as its access line says (`outcome`). An exchange with an upstream
    ends in one of the first eight; settlement decides the request's (`policy.outcome`)."""

    DONE = auto()
    UPSTREAM_DROPPED = auto()
    UPSTREAM_BAD_FRAMING = auto()
    CLIENT_CLOSED = auto()
    CLIENT_WRITE_TIMEOUT = auto()
    UPSTREAM_ERROR_EVENT = auto()
    STALL = auto()
    SHUTDOWN = auto()
    # A request answered with an error of the relay's own, or an upstream's passed on.
    ERROR = auto()
    # A request refused before it was read whole (400, 408, 413, 431).
    REJECTED = auto()
    # A bug: the request was still answered and its row written.
    INTERNAL_ERROR = auto()
    # A request a crash cut: its admission record became its row (store.admissions).
    RELAY_CRASHED = auto()


# The status and `error.type` of each code's answer.
_KINDS: dict[Code, tuple[int, str]] = {
    Code.BAD_REQUEST: (400, "invalid_request_error"),
    Code.INVALID_JSON: (400, "invalid_request_error"),
    Code.INVALID_API_KEY: (401, "authentication_error"),
    Code.FORBIDDEN: (403, "permission_error"),
    Code.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    Code.NOT_FOUND: (404, "invalid_request_error"),
    Code.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    Code.REQUEST_TIMEOUT: (408, "timeout_error"),
    Code.REQUEST_TOO_LARGE: (413, "invalid_request_error"),
    Code.BUDGET_EXCEEDED: (429, "rate_limit_error"),
    Code.CONCURRENCY_EXCEEDED: (429, "rate_limit_error"),
    Code.RATE_LIMIT_EXCEEDED: (429, "rate_limit_error"),
    Code.HEADERS_TOO_LARGE: (431, "invalid_request_error"),
    Code.INTERNAL_ERROR: (500, "server_error"),
    Code.NOT_IMPLEMENTED: (501, "invalid_request_error"),
    Code.UPSTREAM_UNAVAILABLE: (502, "upstream_error"),
    Code.UPSTREAM_BAD_RESPONSE: (502, "upstream_error"),
    Code.UPSTREAM_ERROR: (502, "upstream_error"),
    Code.UPSTREAM_BUSY: (503, "server_error"),
    Code.SHUTTING_DOWN: (503, "server_error"),
    Code.SERVER_BUSY: (503, "server_error"),
    Code.UPSTREAM_TIMEOUT: (504, "timeout_error"),
}

# Details are JSON members of the answer (`error.details`): strings, numbers, flags, None.
Detail = str | int | float | bool | None
Details = dict[str, Detail]


class _Error(msgspec.Struct):
    message: str
    type: str
    code: str
    param: None
    details: Details


class _Body(msgspec.Struct):
    error: _Error


_encode = msgspec.json.Encoder().encode


class RelayError(Exception):
    """An error answered by the relay; carries everything the response needs.

    `code` is a `Code`, except for an upstream's failure passed on (`upstream_error`), whose
    code may be the upstream's own or `upstream_<status>`."""

    def __init__(
        self,
        code: Code,
        message: str,
        details: Mapping[str, Detail] | None = None,
        headers: Headers | None = None,
    ) -> None:
        super().__init__(message)
        self.code: str = code
        self.status, self.type = _KINDS[code]
        self.message = message
        self.details: Details = dict(details) if details else {}
        self.headers: Headers = headers or []

    def body(self) -> bytes:
        return _encode(_Body(_Error(self.message, self.type, self.code, None, self.details)))

    @property
    def reason(self) -> str | None:
        """What failed, in words, when the details say (a TLS reason, a connect error)."""
        why = self.details.get("error")
        return why if isinstance(why, str) and why else None


def shutting_down() -> RelayError:
    """The answer to a request that arrives, or waits, while the relay drains."""
    return RelayError(Code.SHUTTING_DOWN, "the relay is shutting down")


def reason_phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


class _EventError(msgspec.Struct):
    message: str
    type: str
    code: str | None


class _EventBody(msgspec.Struct):
    error: _EventError


def error_event(message: str, type_: str, code: str | None) -> bytes:
    """An error delivered inside an event stream whose 200 head already went out, in the
    shape OpenAI's own streams use (its client raises APIError with `message`)."""
    return b"data: " + _encode(_EventBody(_EventError(message, type_, code))) + b"\n\n"


class UpstreamErrorFields(NamedTuple):
    """What the relay passes on of an upstream's `{"error": ...}` object: its non-empty string
    `message`, `type` and `code` (None for one it did not give as such)."""

    message: str | None = None
    type: str | None = None
    code: str | None = None


def upstream_error(
    status: int, error: UpstreamErrorFields | None, code: str, message: str
) -> RelayError:
    """An upstream's failure passed on in-band: its own message, type and (string) code
    where its body gave them; `code` / `message` otherwise."""
    err = RelayError(Code.UPSTREAM_BAD_RESPONSE, message)
    err.status, err.code = status, code
    if error is not None:
        err.message = error.message or err.message
        err.type = error.type or err.type
        err.code = error.code or err.code
    return err

"""Errors the relay itself answers with: OpenAI-shaped JSON bodies (DESIGN.md "Errors")."""

from __future__ import annotations

from http import HTTPStatus
from typing import NamedTuple

import msgspec

# code -> (status, type)
_KINDS = {
    "bad_request": (400, "invalid_request_error"),
    "invalid_json": (400, "invalid_request_error"),
    "invalid_api_key": (401, "authentication_error"),
    "forbidden": (403, "permission_error"),
    "model_not_found": (404, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "request_timeout": (408, "timeout_error"),
    "request_too_large": (413, "invalid_request_error"),
    "budget_exceeded": (429, "rate_limit_error"),
    "headers_too_large": (431, "invalid_request_error"),
    "internal_error": (500, "server_error"),
    "not_implemented": (501, "invalid_request_error"),
    "upstream_unavailable": (502, "upstream_error"),
    "upstream_bad_response": (502, "upstream_error"),
    "upstream_busy": (503, "server_error"),
    "shutting_down": (503, "server_error"),
    "server_busy": (503, "server_error"),
    "upstream_timeout": (504, "timeout_error"),
}


class _Error(msgspec.Struct):
    message: str
    type: str
    code: str
    param: None
    details: dict


class _Body(msgspec.Struct):
    error: _Error


_encode = msgspec.json.Encoder().encode


class RelayError(Exception):
    """An error answered by the relay; carries everything the response needs."""

    def __init__(
        self,
        code: str,
        message: str,
        details: dict | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.status, self.type = _KINDS[code]
        self.message = message
        self.details = details or {}
        self.headers = headers or []

    def body(self) -> bytes:
        return _encode(_Body(_Error(self.message, self.type, self.code, None, self.details)))


def shutting_down() -> RelayError:
    """The answer to a request that arrives, or waits, while the relay drains."""
    return RelayError("shutting_down", "the relay is shutting down")


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
    err = RelayError("upstream_bad_response", message)
    err.status, err.code = status, code
    if error is not None:
        err.message = error.message or err.message
        err.type = error.type or err.type
        err.code = error.code or err.code
    return err

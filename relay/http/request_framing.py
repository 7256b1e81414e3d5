"""Whether a request head frames its body unambiguously (RFC 9112 6.1-6.3, 5.2), without sockets.

A relay that reads a body one way while the next hop reads it another lets a client hide a
second request inside the first (request smuggling). So any framing two parsers could read
differently is refused and the connection closed, as HAProxy and nginx do:

- Transfer-Encoding together with Content-Length (400),
- Transfer-Encoding on an HTTP/1.0 request (400: 1.0 has no transfer codings),
- any Transfer-Encoding other than one final `chunked` (501: a coding the relay cannot decode),
- obs-fold, a header line continued on the next line (400; h11 would silently join it),
- several Content-Length values that disagree, or one that is not a plain number (400).

h11 checks some of these itself; here they are checked on every head, whatever h11 lets pass.
"""

from __future__ import annotations

import re

from relay.errors import Code, RelayError
from relay.http.fields import HeaderPairs, lower_names

_HEAD_END = re.compile(rb"\n\r?\n")
_FOLD = re.compile(rb"\n[ \t]")
_DIGITS = re.compile(rb"^[0-9]+$")


def has_obs_fold(head: bytes | bytearray) -> bool:
    """Whether a header line of the head at the start of `head` is continued (obs-fold).

    `head` holds the request's bytes from its first one (leading empty lines allowed, as h11
    allows them); anything after the empty line that ends the head is not looked at.
    """
    start = 0
    while start < len(head) and head[start] in b"\r\n":
        start += 1
    m = _HEAD_END.search(head, start)
    end = m.start() if m else len(head)
    return _FOLD.search(head, start, end) is not None


def framing_error(headers: HeaderPairs, http11: bool) -> RelayError | None:
    """The refusal for a head whose body framing is ambiguous or unsupported, else None.

    The usual head has no Transfer-Encoding and at most one Content-Length: that one is
    looked at alone, found by index; any other head is read field by field."""
    te: list[bytes] = []
    cl: list[bytes] = []
    lows = lower_names(headers)
    if b"transfer-encoding" not in lows and lows.count(b"content-length") <= 1:
        if b"content-length" in lows:
            cl.append(headers[lows.index(b"content-length")][1])
    else:
        for (_, value), low in zip(headers, lows):
            if low == b"transfer-encoding":
                te.append(value)
            elif low == b"content-length":
                cl.append(value)
    if te:
        if cl:
            return RelayError(
                Code.BAD_REQUEST, "Transfer-Encoding and Content-Length together: ambiguous framing"
            )
        if not http11:
            return RelayError(Code.BAD_REQUEST, "Transfer-Encoding on an HTTP/1.0 request")
        codings = [c.strip().lower() for v in te for c in v.split(b",")]
        if codings != [b"chunked"]:
            return RelayError(
                Code.NOT_IMPLEMENTED, "only a single Transfer-Encoding: chunked is supported"
            )
    values = {v.strip() for raw in cl for v in raw.split(b",")}
    if len(values) > 1:
        return RelayError(Code.BAD_REQUEST, "conflicting Content-Length values")
    if values and not _DIGITS.match(next(iter(values))):
        return RelayError(Code.BAD_REQUEST, "Content-Length is not a number")
    return None

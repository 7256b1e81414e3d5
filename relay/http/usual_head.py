"""The usual request head, read whole from one read without h11's machinery; h11 reads the rest.

h11 parses every client request (`proxy.client`), but its event machinery costs a request
about as much as the rest of the relay's own work before the upstream is written. Most heads
are the same simple shape: a request line, a few header lines, a Content-Length body, all in
the first read. `read` takes exactly those, by h11's own grammar (its `_abnf` expressions
compiled here), and makes the head h11 would read (`fields.RequestHead`, with no
`h11.Request` event built: that alone is a tenth of the work); for anything else it answers
None and h11 reads the bytes as before, so every head it does not take (and every error) is
h11's alone. It takes a head only when:

- it ends (CRLF CRLF) within `limit` bytes, every line ends with CRLF (no bare CR or LF),
  and it has no empty line before the request line;
- the request line matches h11's `request_line`, with HTTP/1.1 or HTTP/1.0;
- every header line matches h11's `header_field` (no obs-fold: a line starting with a space
  or a tab goes to h11, which unfolds it, and the relay refuses it);
- there is exactly one Host (at most one for HTTP/1.0), no Transfer-Encoding, no Expect
  (100-continue is h11's), no Upgrade and no CONNECT (protocol switches are h11's), and at
  most one Content-Length, of digits only (at most 20, as h11 allows).

Tests hold it to h11 as the oracle (`tests/http/test_usual_head.py`): a head it takes is
the `Request` h11 makes of the same bytes, field for field.
"""

from __future__ import annotations

import re

from h11._abnf import header_field, request_line

from relay.http.fields import RequestHead, header_list

_REQUEST_LINE = re.compile(request_line.encode("ascii"))
_HEADER_FIELD = re.compile(header_field.encode("ascii"))
# h11's bound on a Content-Length's digits.
_MAX_DIGITS = 20
_VERSIONS = (b"1.1", b"1.0")
_REFUSED = frozenset((b"transfer-encoding", b"expect", b"upgrade"))


class Head:
    """A head read whole: the request's head, its body's length, and where the body starts."""

    __slots__ = ("body_at", "length", "request")

    def __init__(self, request: RequestHead, length: int, body_at: int) -> None:
        self.request = request
        self.length = length
        self.body_at = body_at


def read(data: bytes, limit: int) -> Head | None:
    """The usual head at the start of `data`, or None: h11 reads it."""
    end = data.find(b"\r\n\r\n")
    if end <= 0 or end > limit:
        return None
    head = data[:end]
    crlf = head.count(b"\r\n")
    if head.count(b"\r") != crlf or head.count(b"\n") != crlf:
        return None
    lines = head.split(b"\r\n")
    m = _REQUEST_LINE.fullmatch(lines[0])
    if m is None:
        return None
    method, target, version = m.group("method", "target", "http_version")
    if version not in _VERSIONS or method == b"CONNECT":
        return None
    pairs: list[tuple[bytes, bytes]] = []
    lows: list[bytes] = []
    match = _HEADER_FIELD.fullmatch
    for line in lines[1:]:
        f = match(line)
        if f is None:
            return None
        name, value = f.group("field_name", "field_value")
        pairs.append((name, value))
        lows.append(name.lower())
    return _request(pairs, lows, method, target, version, end + 4)


def _request(
    pairs: list[tuple[bytes, bytes]], lows: list[bytes], method: bytes, target: bytes,
    version: bytes, body_at: int,
) -> Head | None:  # fmt: skip
    """The head of the fields read, when they are of the usual kind."""
    hosts = lows.count(b"host")
    if hosts > 1 or (hosts == 0 and version == b"1.1"):
        return None
    if not _REFUSED.isdisjoint(lows):
        return None
    length = 0
    lengths = lows.count(b"content-length")
    if lengths > 1:
        return None
    if lengths:
        value = pairs[lows.index(b"content-length")][1]
        if not value.isdigit() or len(value) > _MAX_DIGITS:
            return None
        length = int(value)
    request = RequestHead(method, target, version, header_list(pairs, lows))
    return Head(request, length, body_at)

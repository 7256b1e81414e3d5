"""The upstream's HTTP/1.1 response head, read by a small strict parser.

The client side keeps h11 (its peer is anyone on the network). Towards the upstream the
relay writes the request itself - every client header already passed h11's validation - and
reads the response head with this small strict parser: on this edge-class hardware h11's
per-request work on this side (about 150 us) was a third of the relay's added TTFT.

Strict means: whatever h11 would reject is rejected here too (tests/http/test_response_head.py
holds it to h11 as the oracle, both ways), and so is, where h11 would read it:
- a body framing that is ambiguous or in a transfer coding the relay does not carry (RFC 9112
  6.1 / 6.3, as nginx answers it: 502): Content-Length with Transfer-Encoding, either one
  repeated, a coding but `chunked`, Transfer-Encoding on HTTP/1.0, a Content-Length over 18
  digits (the framing of interim 1xx heads is held to this too);
- a control byte in the status line or a header value, a line ended by a bare LF, a header
  line continued on the next (obs-fold), an HTTP version other than 1.0 and 1.1;
- a protocol switch (101), more than 8 interim heads, over 64 KiB of heads.
The bytes are read once however they are split.
"""

from __future__ import annotations

import re
from operator import itemgetter

from relay.http.fields import Header, HeaderList, HeaderPairs, header_list, lower_names

# The bytes of all the heads of one response together (interim ones included), the interim
# 1xx heads before the final one, and the digits of a Content-Length (below 10**18 it fits
# in 63 bits).
MAX_HEAD = 64 * 1024
MAX_INTERIM = 8
MAX_LENGTH_DIGITS = 18
# A reason phrase is HTAB, SP, VCHAR or obs-text: no other control byte reaches a client.
_STATUS = re.compile(rb"HTTP/(1\.[01]) ([1-9][0-9][0-9])(?: ([\t\x20-\x7e\x80-\xff]*))?")
# Every header line at once: token name, colon, a value without control characters but TAB.
_FIELDS = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*")
# One valid header line (see _FIELDS): its name, and its value without the blanks around it.
_FIELD = re.compile(rb"([^:]+):[\t ]*(.*?)[\t ]*\r\n")
_LENGTH = re.compile(rb"[0-9]{1,%d}" % MAX_LENGTH_DIGITS)


class BadHead(ValueError):
    """A response head the relay refuses: malformed, or with a framing it does not carry."""


class ResponseHead:
    """The final response head: `headers` are the (name as sent, value) pairs in order, with
    their lower-case names beside them (`http.fields.HeaderList`); `raw` its bytes as read
    (parsed again they give the same head: a response held a long time keeps them alone)."""

    __slots__ = ("headers", "http_version", "raw", "reason", "status_code")

    def __init__(
        self,
        http_version: bytes,
        status_code: int,
        reason: bytes,
        headers: HeaderList,
        raw: bytes,
    ) -> None:
        self.http_version = http_version
        self.status_code = status_code
        self.reason = reason
        self.headers = headers
        self.raw = raw


class HeadReader:
    """The response head as it arrives in reads: `feed` returns (final head, the bytes after
    it) once it is in, None while more is needed, and raises BadHead on anything malformed.

    Each byte is searched for the blank line once (a partial head waits in a bytearray, the
    search resumes where it stopped) and each head is parsed once, so the work is linear in
    the bytes received however they are split. Interim 1xx heads are dropped as they end.
    `pending` holds an unfinished head, `used` the bytes of the interim heads already read.
    """

    __slots__ = ("interim", "pending", "used")

    def __init__(self) -> None:
        self.pending: bytearray | None = None
        self.used = 0
        self.interim = 0

    def feed(self, data: bytes) -> tuple[ResponseHead, bytes] | None:
        pending = self.pending
        # The slow case first: a head split across reads.
        if pending is not None:
            scan = max(len(pending) - 3, 0)
            pending += data
            if _blank_line(pending, scan) < 0:
                self._bound(len(pending))
                return None
            buf, self.pending = bytes(pending), None
        else:
            buf, scan = data, 0
        pos = 0
        while True:
            end = _blank_line(buf, scan)
            if end < 0:
                self._bound(len(buf) - pos)
                self.pending = bytearray(memoryview(buf)[pos:])
                return None
            self.used += end - pos
            if self.used > MAX_HEAD:
                raise BadHead("response head too large")
            head = _one_head(buf, pos, end)
            if head is not None:
                return head, buf[end:]
            self.interim += 1
            if self.interim > MAX_INTERIM:
                raise BadHead(f"more than {MAX_INTERIM} interim (1xx) responses")
            pos = scan = end

    def _bound(self, unfinished: int) -> None:
        """BadHead when the blank line of an `unfinished` head would end past MAX_HEAD."""
        if self.used + unfinished >= MAX_HEAD:
            raise BadHead("response head too large")


def _blank_line(buf: bytes | bytearray, scan: int) -> int:
    """Where the head that holds buf[scan:] ends (after its CRLF CRLF); -1 when not in yet.

    A head ends at the first blank line however its lines end (h11 reads LF as a line end
    too), so a bare LF there is refused at once, never waited past."""
    end = buf.find(b"\n\r\n", scan)
    if buf.find(b"\n\n", scan, len(buf) if end < 0 else end) >= 0 or (
        end >= 0 and (end == 0 or buf[end - 1] != 13)
    ):
        raise BadHead("bare LF in the response head")
    return end + 3 if end >= 0 else -1


def parse_response_head(buf: bytes) -> tuple[ResponseHead, int] | None:
    """(head, bytes used) once a whole final response head is in `buf`; None for more.

    Interim 1xx heads (100 Continue) are skipped. Raises BadHead on anything malformed.
    """
    out = HeadReader().feed(buf)
    if out is None:
        return None
    return out[0], len(buf) - len(out[1])


# A field's name (mapped in C over a head's fields: their lower-case names in one pass).
_name = itemgetter(0)


def _one_head(buf: bytes, pos: int, end: int) -> ResponseHead | None:
    """The head in buf[pos:end] (its blank line included); None for an interim one."""
    line_end = buf.find(b"\r\n", pos)
    m = _STATUS.fullmatch(buf, pos, line_end)
    if m is None:
        raise BadHead(f"bad status line {buf[pos:line_end][:60]!r}")
    if line_end + 4 < end:
        if _FIELDS.fullmatch(buf, line_end + 2, end - 2) is None:
            raise BadHead("malformed header line")
        # The lines are valid: one C pass splits them into names and stripped values.
        pairs: list[Header] = _FIELD.findall(buf, line_end + 2, end - 2)
        headers = header_list(pairs, list(map(bytes.lower, map(_name, pairs))))
    else:
        headers = header_list((), [])
    version = m.group(1)
    _check_framing(version, headers)
    status = int(m.group(2))
    if status == 101:
        raise BadHead("protocol switch is not relayed")
    # An interim response: the final one follows.
    if status < 200:
        return None
    return ResponseHead(version, status, m.group(3) or b"", headers, buf[pos:end])


def is_chunked(value: bytes) -> bool:
    """Whether a Transfer-Encoding value is `chunked` alone, in any case (RFC 9112 7)."""
    return value.strip(b" \t").lower() == b"chunked"


def is_length(value: bytes) -> bool:
    """Whether a Content-Length value is one number of at most MAX_LENGTH_DIGITS digits."""
    return _LENGTH.fullmatch(value) is not None


_FRAMING = (b"content-length", b"transfer-encoding")


def _check_framing(version: bytes, headers: HeaderPairs) -> None:
    """One way to read where the body ends, in a coding the relay carries (see
    `_check_framing_fields`). The usual head has one framing field: it is found by index
    (C scans of the lower-case names) instead of a Python loop over every header, and then
    judged by the same function as any other head."""
    lows = lower_names(headers)
    cl, te = lows.count(b"content-length"), lows.count(b"transfer-encoding")
    if cl + te == 0:
        return
    if cl + te == 1:
        i = lows.index(b"content-length" if cl else b"transfer-encoding")
        _check_framing_fields(version, [(lows[i], headers[i][1])])
    else:
        fields = [(low, value) for (_, value), low in zip(headers, lows) if low in _FRAMING]
        _check_framing_fields(version, fields)


def _check_framing_fields(version: bytes, fields: list[Header]) -> None:
    """The rule, on a head's framing fields in order ((lower-case name, value)): at most one
    Content-Length of at most 18 digits, at most one Transfer-Encoding and it `chunked` alone
    (any other coding would be dropped or mangled on the way), never both, and no
    Transfer-Encoding on HTTP/1.0 (RFC 9112 6.1: its framing is faulty)."""
    length: bytes | None = None
    coding: bytes | None = None
    for low, value in fields:
        if low == b"content-length":
            if length is not None:
                raise BadHead("upstream sent several Content-Length headers")
            if not is_length(value):
                raise BadHead(f"bad Content-Length {value[:20]!r}")
            length = value
        else:
            if coding is not None:
                raise BadHead("upstream sent several Transfer-Encoding headers")
            if not is_chunked(value):
                raise BadHead(f"upstream sent unknown Transfer-Encoding {value[:40]!r}")
            coding = value
    if coding is not None:
        if length is not None:
            raise BadHead(
                'upstream sent "Content-Length" and "Transfer-Encoding" headers at the same time'
            )
        if version == b"1.0":
            raise BadHead("upstream sent Transfer-Encoding in an HTTP/1.0 response")

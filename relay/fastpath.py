"""The usual read, recognised in one go: one whole chunk holding one whole token event.

llama-server (and most OpenAI-compatible servers) write one chunk per token, so nearly every
read of a stream is `<hex>\\r\\ndata: {...,"content":"x",...}\\n\\n\\r\\n`. Recognising exactly
that with a handful of C-level calls lets the relay forward it and count the token without
running the general chunk tracker and event scanner, which stay the reference for anything
else: several chunks or events in a read, partial ones, empty content, a CR inside the
payload, `usage` / `timings` anywhere in the event, a size that is not plain hex.

Two steps. `token_event` checks a read from scratch: the chunk framing, then the event as
the scanner's own in-place check sees it (`sse.content_event_at`, about ten C calls). The token events of
one stream differ only in their text: everything before it (the prefix, up to the content
marker) and after it (the suffix, from the closing quote) repeats. So once a read passed,
`shape_of` keeps that prefix and suffix, and `same_shape` accepts a next read that has both
around a text with no quote, CR or LF in it, which is the same verdict for a fraction of the
calls (the usual read, at about 40% of the cost on the machines measured).
tests/test_unit_fastpath.py holds both to the general path's result on random reads.
"""

from __future__ import annotations

from relay.chunked import chunk_size
from relay.sse import content_event_at


_META_WORDS = (b"usage", b"timings")  # a text that, quoted, reads as a usage/timings key


def token_event(data: bytes) -> int:
    """Where the token text starts when `data` is one whole chunk holding one token event
    (nothing the scanner would treat otherwise: `sse.content_event_at`); 0 when it is not."""
    if len(data) < 12:
        return 0
    # token events are 16..4095 bytes: a size of 2 or 3 hex digits, looked at directly
    nl = 2 if data[2] == 13 else 3 if data[3] == 13 else data.find(b"\r", 0, 18)
    if nl <= 0 or data[nl + 1] != 10:
        return 0
    size = chunk_size(data[:nl])
    if size < 4 or len(data) != nl + size + 4 or not data.endswith(b"\r\n"):
        return 0
    return content_event_at(data, nl + 2, nl + 2 + size)


def size_line(n: int) -> bytes | None:
    """The chunk-size line (`<hex>\\r\\n`, no leading zeros) of a whole chunk of `n` bytes:
    1-digit sizes make chunks of 6..20 bytes, 2-digit 22..261, 3-digit 263..4102."""
    if 6 <= n <= 20:
        return b"%x\r\n" % (n - 5)
    if 22 <= n <= 261:
        return b"%x\r\n" % (n - 6)
    if 263 <= n <= 4102:
        return b"%x\r\n" % (n - 7)
    return None


def shape_of(data: bytes, i: int) -> tuple | None:
    """What `same_shape` needs of a read `token_event` accepted with its text at `i`: the
    prefix (the event up to the text), the suffix (from the text's closing quote), and a
    cache of size line + prefix by chunk length. None when the text holds an escape (its end
    is then not simply the next quote)."""
    q = data.find(b'"', i)
    if q <= i or 92 in data[i:q]:  # (92: a backslash)
        return None
    start = data.find(b"\n") + 1
    return data[start:i], data[q:], len(data) - q, {}


def same_shape(data: bytes, shape: tuple) -> bool:
    """`data` is a whole chunk made of this stream's prefix, a token text and its suffix.

    The prefix ends at the first content marker, and neither it nor the suffix holds a CR,
    a second event or meta (`token_event` passed them); a text with no quote, CR or LF adds
    no marker, line break, event or meta to them, except the text `usage` or `timings`,
    which its quotes would turn into a key.
    """
    prefix, suffix, slen, heads = shape
    n = len(data)
    head = heads.get(n)
    if head is None:
        line = size_line(n)
        if line is None:
            return False
        head = line + prefix
        if len(heads) < 64:
            heads[n] = head
    b = n - slen
    if b <= len(head) or not data.startswith(head) or not data.endswith(suffix):
        return False
    t = data[len(head):b]
    return not (34 in t or 10 in t or 13 in t or t in _META_WORDS)  # (int `in`: a memchr)

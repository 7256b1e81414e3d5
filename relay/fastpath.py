"""The usual read, recognised in one go: one whole chunk holding one whole token event.

llama-server (and most OpenAI-compatible servers) write one chunk per token, so nearly every
read of a stream is `<hex>\\r\\ndata: {...,"content":"x",...}\\n\\n\\r\\n`. Recognising exactly
that with a handful of C-level finds lets the relay forward it and count the token without
running the general chunk tracker and event scanner, which stay the reference for anything
else: several chunks or events in a read, partial ones, empty content, a nested object after
the content (usage / timings ride that way), a size that is not plain hex.
"""

from __future__ import annotations

from relay.chunked import SIZES, chunk_size


def one_token_chunk(data: bytes) -> bool:
    # (single-byte finds run as memchr; each call here costs more than its scan)
    nl = data.find(b"\r", 0, 18)
    if nl <= 0:
        return False
    text = data[:nl]
    size = SIZES.get(text)  # (the cache hit inline: one call less on the usual read)
    if size is None:
        size = chunk_size(text)
        if size < 0:
            return False
    end = nl + 2 + size
    if len(data) != end + 2 or data[-4:] != b"\n\n\r\n" or size < 4 or data[nl + 1] != 10:
        return False
    i = data.find(b'"content":"', nl, end)
    if i < 0:
        i = data.find(b'"text":"', nl, end)
        if i < 0:
            return False
        i += 8
    else:
        i += 11
    # JSON strings hold no raw newline: the first newline after the size line ends the event
    return (data[i] != 0x22  # not an empty string
            and data.find(b"\n", nl + 2) == end - 2  # exactly one event, one line
            and data.find(b"{", i, end) < 0)  # no object after it (usage, timings ride so)

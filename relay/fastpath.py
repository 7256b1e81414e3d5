"""The usual read, recognised in one go: one whole chunk holding one whole token event.

llama-server (and most OpenAI-compatible servers) write one chunk per token, so nearly every
read of a stream is `<hex>\\r\\ndata: {...,"content":"x",...}\\n\\n\\r\\n`. Recognising exactly
that with a handful of C-level finds lets the relay forward it and count the token without
running the general chunk tracker and event scanner, which stay the reference for anything
else: several chunks or events in a read, partial ones, empty content, a CR inside the
payload, `usage` / `timings` anywhere in the event, a size that is not plain hex.
tests/test_unit_fastpath.py holds it to the general path's result on random reads.
"""

from __future__ import annotations

from relay.chunked import SIZES, chunk_size


def one_token_chunk(data: bytes) -> bool:
    # (each call here costs more than its scan: as few C calls as will do, finds not `in`)
    if len(data) < 12:
        return False
    # token events are 16..4095 bytes: a size of 2 or 3 hex digits, looked at directly
    nl = 2 if data[2] == 13 else 3 if data[3] == 13 else data.find(b"\r", 0, 18)
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
    i = data.find(b'"content":"')
    if i < 0:
        i = data.find(b'"text":"')
        if i < 0:
            return False
        i += 8
    else:
        i += 11
    return (i < end - 2 and data[i] != 0x22  # a string that is not empty, in the event
            and data.find(b"\n", nl + 2) == end - 2  # one line: the blank line ends it
            and data.find(b"\r", nl + 2) == end  # no CR in it (a CR may end a line too)
            and data.find(b'"usage"') < 0 and data.find(b'"timings"') < 0)  # no meta

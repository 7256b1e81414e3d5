"""The usual read, recognised in one go: whole chunks of whole token events, any server's shape.

Most reads of a stream are one chunk holding one token event, `<hex>\\r\\ndata: {...}\\n\\n\\r\\n`;
under load, or from servers that batch, a read holds several chunks, and a chunk several
events. Every token event of a stream starts the same way up to its text: llama-server's
`data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"`, vLLM's and OpenAI's
`data: {"id":"chatcmpl-..","object":..,"created":..,"model":..,["service_tier":..,
"system_fingerprint":..,]"choices":[{"index":0,"delta":{"content":"`. What follows the text
differs from server to server (`logprobs`, `"usage":null`, OpenAI's random-length
`obfuscation`), but within a stream it repeats too, except the last value at times: a string
in OpenAI's case (the padding), a number where a server stamps each event (a time, a count).

`learn` takes a `Shape` from a read whose first chunk is one event the scanner would count
alone (`sse.content_event_at`): the prefix, and the suffix from the text's closing quote to
the event's end, split around its last value when that is a string or a number. `events_in` then recognises a read
made only of such events with C-level calls (memcmp, memchr: CPython's multi-byte substring
search and every bytes method call cost far more, so the event is not searched for
markers): each chunk's size line, the prefix, a text with no quote (but escaped ones), CR
or LF that is not `usage` / `timings`, then the suffix, or its two parts around a value with
no quote, backslash, CR or LF (a string's text or a number's digits: nothing that could make
a key or end a line). Nothing in such a read can add a marker, a line end, an event or a
`usage` / `timings` key to what the scanner saw in the learned event, so it would count
exactly those events and keep nothing else: the exchange forwards the read as is and adds
them. Anything else - the first events, a usage/timings or [DONE] event, partial chunks or
events, a CR, a chunk extension, a changed key - is the general chunk tracker's and
scanner's, which stay the reference: tests/stream/test_fastpath.py holds `events_in` to the
general path on random reads of every framing.
"""

from __future__ import annotations

import re

from relay.http.chunked import SIZES, chunk_size
from relay.stream.sse import content_event_at

# The size line + prefix is kept for this many chunk lengths (per prefix).
_HEADS = 32
# The size line + prefix strings by prefix, shared by the streams whose token events start
# alike: llama-server's (its `id` comes after the text) start the same for every stream of a
# model, so its streams hold none of their own; vLLM's and OpenAI's start with the stream's
# id, and each such stream keeps its own (at most _HEADS, ~270 bytes each). Forgotten all at
# once past _PREFIXES (a live stream keeps its dict).
# prefix -> (prefix, its heads).
_SHARED: dict[bytes, tuple[bytes, dict[int, bytes]]] = {}
_PREFIXES = 256
# A text that, quoted, reads as a usage or timings key.
_META_WORDS = (b"usage", b"timings")
# A suffix's tail after a key's closing quote when its value, last in the event, is a number.
_NUMBER_LAST = re.compile(rb":(-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)[]}]*\n\n\Z")


class Shape:
    """What every token event of a stream repeats: the prefix (up to its text), the suffix
    (from the text's closing quote to the event's end), and that suffix split around its
    last value (`s1`, `s2`) when that value may vary (OpenAI's `obfuscation`, a stamp): made
    the first time a read needs it (`vary`), most streams never do."""

    __slots__ = ("heads", "lp", "prefix", "s1", "s2", "s2c", "sfx", "sfxc", "split", "stop")

    def __init__(self, prefix: bytes, sfx: bytes) -> None:
        # One prefix object and one heads dict (chunk length -> size line + prefix) for all
        # streams alike.
        shared = _SHARED.get(prefix)
        if shared is None:
            if len(_SHARED) >= _PREFIXES:
                _SHARED.clear()
            shared = _SHARED[prefix] = (prefix, {})
        self.prefix, self.heads = shared
        self.lp = len(prefix)
        # A one-event chunk ends so; the suffix alone is kept too only once a read of several
        # events in a chunk asks (`suffix`): it holds the stream's id, so each stream keeps
        # its own, about 200 bytes for llama-server's, which sends one event a chunk.
        self.sfxc = sfx + b"\r\n"
        self.sfx: bytes | None = None
        # The suffix around its varying value, set together, and the byte that ends the value
        # (a string's closing quote, what follows a number).
        self.s1: bytes | None = None
        self.s2 = self.s2c = self.stop = b""
        self.split = False

    def suffix(self) -> bytes:
        """The suffix alone: from the text's closing quote to the event's end."""
        sfx = self.sfx
        if sfx is None:
            sfx = self.sfx = self.sfxc[:-2]
        return sfx

    def vary(self) -> bytes | None:
        """`s1` (with `s2`, `s2c`, `stop`), found the first time a read asks; None when the
        suffix's last value is neither a string (`:"value"`) nor a number (`:123`)."""
        if not self.split:
            self.split = True
            sfx = self.suffix()
            r2 = sfx.rfind(b'"')
            r1 = sfx.rfind(b'"', 0, r2)
            number = _NUMBER_LAST.match(sfx, r2 + 1) if r2 > 0 else None
            # `:"value"` (58 is `:`, 92 a backslash).
            if r1 > 0 and sfx[r1 - 1] == 58 and 92 not in sfx[r1:r2]:
                self.s1, self.s2, self.stop = sfx[: r1 + 1], sfx[r2:], b'"'
            elif number is not None:
                self.s1, self.s2 = sfx[: r2 + 2], sfx[number.end(1) :]
                self.stop = self.s2[:1]
            if self.s1 is not None:
                self.s2c = self.s2 + b"\r\n"
        return self.s1


def learn(data: bytes) -> Shape | None:
    """The shape of the first event of a read's first chunk when that event is a token
    event the scanner would count and keep nothing of (`sse.content_event_at`); else None."""
    nl = data.find(b"\r\n", 0, 10)
    if nl <= 0:
        return None
    size = chunk_size(data[:nl])
    start = nl + 2
    end = data.find(b"\n\n", start, start + size) + 2
    if size <= 0 or end < 2 or not data.startswith(b"\r\n", start + size):
        return None
    t = content_event_at(data, start, end)
    q = closing_quote(data, t, end) if t else -1
    if q < 0:
        return None
    return Shape(data[start:t], data[q:end])


def closing_quote(data: bytes, t: int, end: int) -> int:
    """Where the JSON string whose text starts at `t` ends (its unescaped quote), or -1."""
    q = data.find(b'"', t, end)
    # A quote is escaped if an odd run of backslashes precedes it.
    while q > t and data[q - 1] == 92:
        b = q - 1
        while b > t and data[b - 1] == 92:
            b -= 1
        if (q - b) % 2 == 0:
            break
        q = data.find(b'"', q + 1, end)
    return q


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


def events_in(data: bytes, shape: Shape) -> int:
    """How many token events `data` holds when it is whole chunks of whole token events of
    the stream's `shape`; 0 when it is anything else. The usual read, one chunk, is
    recognised by its size line and prefix together (kept by length)."""
    n = len(data)
    heads = shape.heads
    head = heads.get(n)
    if head is None:
        line = size_line(n)
        if line is None:
            return several(data, shape)
        head = line + shape.prefix
        if len(heads) < _HEADS:
            heads[n] = head
    if data.startswith(head):
        h = len(head)
        # One event, its suffix the learned one; else its last value may vary.
        if data.endswith(shape.sfxc):
            text = data[h : n - len(shape.sfxc)]
            if text and not (34 in text or 10 in text or 13 in text or text in _META_WORDS):
                return 1
        elif (shape.split or shape.vary()) and shape.s1 is not None and data.endswith(shape.s2c):
            q = data.find(b'"', h)
            text = data[h:q]
            if (
                q > h
                and data[q - 1] != 92
                and data.startswith(shape.s1, q)
                and not (10 in text or 13 in text or text in _META_WORDS)
            ):
                value = data[q + len(shape.s1) : n - len(shape.s2c)]
                if not (
                    34 in value or 10 in value or 13 in value or 92 in value or value in _META_WORDS
                ):
                    return 1
        if data[n - 2] == 13 and data[n - 1] == 10:
            return tokens(data, h, n - 2, shape)
    return several(data, shape)


def several(data: bytes, shape: Shape) -> int:
    """`events_in` chunk by chunk: each a size line, token events, CRLF. A chunk of one
    event with the learned suffix is seen whole; others event by event (`tokens`)."""
    n = len(data)
    pos = count = 0
    prefix, lp, sfxc = shape.prefix, shape.lp, shape.sfxc
    ls = len(sfxc) - 2
    while pos < n:
        # (a size of 2 or 3 hex digits, looked at directly)
        nl = (
            pos + 2
            if data[pos + 2 : pos + 3] == b"\r"
            else pos + 3
            if data[pos + 3 : pos + 4] == b"\r"
            else data.find(b"\r\n", pos, pos + 10)
        )
        if nl <= pos:
            return 0
        text = data[pos:nl]
        size = SIZES.get(text)
        if size is None:
            size = chunk_size(text)
        start = nl + 2
        end = start + size
        pos = end + 2
        # The last chunk (size 0) ends the body: it is never here.
        if size <= lp or not data.startswith(prefix, start) or data[end:pos] != b"\r\n":
            return 0
        # (The chunk's CRLF follows at `end`: the suffix with it.)
        if data.startswith(sfxc, end - ls):
            text = data[start + lp : end - ls]
            if text and not (34 in text or 10 in text or 13 in text or text in _META_WORDS):
                count += 1
                continue
        k = tokens(data, start + lp, end, shape)
        if not k:
            return 0
        count += k
    return count


def tokens(data: bytes, t: int, end: int, shape: Shape) -> int:
    """How many token events of `shape` data[..end] is, the first one's text starting at
    `t` (its prefix checked); 0 if anything else. A text or a varying value holds no CR or
    LF and is not `usage` / `timings` (quoted, a key the scanner would keep); a text is not
    empty; the suffix, learned from an event the scanner counted alone, adds nothing."""
    sfx, s1 = shape.sfx or shape.suffix(), shape.s1 if shape.split else shape.vary()
    k = 0
    while True:
        q = data.find(b'"', t, end)
        if q <= t:
            return 0
        # An escaped quote in the text.
        if data[q - 1] == 92:
            q = closing_quote(data, t, end)
            if q < 0:
                return 0
        text = data[t:q]
        if 10 in text or 13 in text or text in _META_WORDS:
            return 0
        if data.startswith(sfx, q):
            pos = q + len(sfx)
        elif s1 is not None and data.startswith(s1, q):
            v = q + len(s1)
            r = data.find(shape.stop, v, end)
            value = data[v:r]
            if r < 0 or 10 in value or 13 in value or 92 in value or value in _META_WORDS:
                return 0
            if not data.startswith(shape.s2, r):
                return 0
            pos = r + len(shape.s2)
        else:
            return 0
        k += 1
        if pos >= end:
            return k if pos == end else 0
        if not data.startswith(shape.prefix, pos):
            return 0
        t = pos + shape.lp

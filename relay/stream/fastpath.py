"""The usual read, recognised in one go: whole chunks of whole token events, any server's shape.

Most reads of a stream are one chunk holding one token event, `<hex>\\r\\ndata: {...}\\n\\n\\r\\n`;
under load, or from servers that batch, a read holds several chunks, and a chunk several
events. Every token event of a stream starts the same way up to its text: llama-server's
`data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"`, vLLM's and OpenAI's
`data: {"id":"chatcmpl-..","object":..,"created":..,"model":..,["service_tier":..,
"system_fingerprint":..,]"choices":[{"index":0,"delta":{"content":"`. What follows the text
differs from server to server (`logprobs`, `"usage":null`, OpenAI's random-length
`obfuscation`), but within a stream it repeats too, except its numbers at times (llama-server's
`created` each second, its native `/completion` events' token ids and counts, a server's stamp)
and the last value when it is a string (OpenAI's padding).

`learn` takes a `Shape` from a read whose first chunk is one event the scanner would count
alone (`sse.content_event_at`): the prefix, and the suffix from the text's closing quote to
the event's end; the first read that misses that suffix cuts it around the numbers that
differ there and the last value if it is a string (`template`). `events_in` then recognises a
read made only of such events with C-level calls (memcmp, memchr: CPython's multi-byte
substring search and every bytes method call cost far more, so the event is not searched for
markers): each chunk's size line, the prefix, a text with no quote (but escaped ones), CR or
LF that is not `usage` / `timings`, then the suffix, or its parts with a value between each
two (`varied`): a string's text with no quote, backslash, CR or LF, a number's bytes (or the
numbers of an array). Nothing in such a read can add a marker, a line end, an event or a
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
# A suffix's strings and numbers (scanned from the byte after the text's closing quote).
_VALUES = re.compile(rb'"(?:[^"\\]|\\.)*"|-?[0-9][0-9.eE+-]*')
# What a number (or an array of numbers) may be written with in a later event: compact, as
# the learned event was (white space after a colon would make the scanner read the stream as
# spelt otherwise, `dialect.spelt_otherwise`).
_NUMBER_BYTES = b"0123456789+-.eE,"
# A suffix with more values that may vary than this is kept whole (no template).
_SLOTS = 8


class Shape:
    """What every token event of a stream repeats: the prefix (up to its text), the suffix
    (from the text's closing quote to the event's end), and that suffix cut around the
    values that may vary (`segs`, `stops`: `template`): made the first time a read misses
    the suffix (`vary`), most llama-server chat streams only after their first second."""

    __slots__ = ("heads", "lp", "prefix", "segs", "sfx", "sfxc", "split", "stops")

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
        # The suffix cut around its values that may vary, and the byte that ends each value
        # (a string's closing quote, what follows a number); set together.
        self.segs: tuple[bytes, ...] | None = None
        self.stops: tuple[bytes, ...] = ()
        self.split = False

    def suffix(self) -> bytes:
        """The suffix alone: from the text's closing quote to the event's end."""
        sfx = self.sfx
        if sfx is None:
            sfx = self.sfx = self.sfxc[:-2]
        return sfx

    def vary(self, data: bytes, q: int) -> tuple[bytes, ...] | None:
        """`segs` (with `stops`), made from the first read that asks, whose event's suffix
        starts at `q` (`template`); None when no value of the suffix may vary."""
        if not self.split:
            self.split = True
            end = data.find(b"\n\n", q) + 2
            cut = template(self.suffix(), data[q:end]) if end > 1 else None
            if cut is not None:
                self.segs, self.stops = cut
        return self.segs


def template(sfx: bytes, seen: bytes) -> tuple[tuple[bytes, ...], tuple[bytes, ...]] | None:
    """The suffix cut around its values that may vary, with the byte that ends each value:
    every number that differs in `seen` (a later event's suffix) and the last value when it
    is a string without escapes. None when `seen` differs otherwise (another key, string or
    separator), when nothing may vary, or more than _SLOTS values."""
    ours = [m.span() for m in _VALUES.finditer(sfx, 1)]
    theirs = [m.span() for m in _VALUES.finditer(seen, 1)]
    if len(ours) != len(theirs) or not ours:
        return None
    cuts: list[tuple[int, int]] = []
    at = their_at = 0
    for (a, b), (c, d) in zip(ours, theirs):
        if sfx[at:a] != seen[their_at:c]:
            return None
        value, other = sfx[a:b], seen[c:d]
        if value[0] == 34 and b == ours[-1][1] and sfx[a - 1] == 58 and 92 not in value:
            # The last value, a string (58 is `:`) with no escape: its text may vary.
            cuts.append((a + 1, b - 1))
        elif value != other:
            if value[0] == 34 or other[0] == 34:
                return None
            cuts.append((a, b))
        at, their_at = b, d
    if sfx[at:] != seen[their_at:] or not cuts or len(cuts) > _SLOTS:
        return None
    segs, stops, at = [], [], 0
    for a, b in cuts:
        segs.append(sfx[at:a])
        stops.append(sfx[b : b + 1])
        at = b
    segs.append(sfx[at:])
    return tuple(segs), tuple(stops)


def varied(
    data: bytes, pos: int, end: int, segs: tuple[bytes, ...], stops: tuple[bytes, ...]
) -> int:
    """Where the event ends whose suffix starts at `pos` when it is `segs` with a value
    between each two that may stand in the learned one's place (a string's text with no
    quote, backslash, CR or LF that is not `usage` / `timings`; a number's bytes, not
    empty); -1 if it is not."""
    i = 0
    for stop in stops:
        seg = segs[i]
        if not data.startswith(seg, pos):
            return -1
        v = pos + len(seg)
        pos = data.find(stop, v, end)
        if pos < 0:
            return -1
        value = data[v:pos]
        # (34 is a quote.)
        if stop[0] == 34:
            if 10 in value or 13 in value or 92 in value or value in _META_WORDS:
                return -1
        elif not value.isdigit() and (pos == v or value.strip(_NUMBER_BYTES)):
            return -1
        i += 1
    last = segs[i]
    return pos + len(last) if data.startswith(last, pos) else -1


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
        # One event, its suffix the learned one, or with values that vary; else event by
        # event.
        if data.endswith(shape.sfxc):
            text = data[h : n - len(shape.sfxc)]
            if text and not (34 in text or 10 in text or 13 in text or text in _META_WORDS):
                return 1
        if data[n - 2] == 13 and data[n - 1] == 10:
            q = data.find(b'"', h)
            if q > h and data[q - 1] != 92:
                text = data[h:q]
                segs = shape.segs if shape.split else shape.vary(data, q)
                if (
                    segs is not None
                    and not (10 in text or 13 in text or text in _META_WORDS)
                    and varied(data, q, n - 2, segs, shape.stops) == n - 2
                ):
                    return 1
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
    `t` (its prefix checked); 0 if anything else. A text holds no CR or LF and is not
    `usage` / `timings` (quoted, a key the scanner would keep) and is not empty; the suffix,
    learned from an event the scanner counted alone, adds nothing, nor do the values that
    may vary in it (`varied`)."""
    sfx = shape.sfx or shape.suffix()
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
        else:
            segs = shape.segs if shape.split else shape.vary(data, q)
            pos = varied(data, q, end, segs, shape.stops) if segs is not None else -1
            if pos < 0:
                return 0
        k += 1
        if pos >= end:
            return k if pos == end else 0
        if not data.startswith(shape.prefix, pos):
            return 0
        t = pos + shape.lp

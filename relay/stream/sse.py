"""Incremental scanner for Server-Sent-Event bodies passing through the relay.

It never changes a byte; it only watches. Per event it decides whether the event carries
generated content (a token, in the API's own terms: `stream.dialect`), whether it ends the
stream (`data: [DONE]`, Anthropic's `message_stop`, a Responses `response.completed` /
`.incomplete` / `.failed`, llama native's `"stop":true`), whether it is an error before any
content (an `{"error": ...}` first event, Anthropic's `event: error`, a Responses `error` /
`response.failed`), and keeps the first and the last events that carry `usage` (not null)
or `timings` so the exact figures can be read once at the end (Anthropic's prompt figure is
in the first, `message_start`; the cumulative output in the last, `message_delta`). On
Anthropic and Responses streams it follows what a terminal frame must close: whether the
message or response was started, the content blocks left open, the `response.created`
event. Events are cut at blank lines, so a marker split across two reads is seen whole: the unfinished tail
of one read waits for the next (up to 1 MiB; a larger event is relayed unscanned), and is
searched for its end only in the new bytes, so scanning stays linear however an event is
split.

Names are read in any spelling JSON allows. Event names and types, ends and errors are
parsed when they are not written compact; content and figures are found by their compact
markers (`"content":"x`), and, in a stream whose opening events spell their JSON otherwise
(white space around colons, names with escaped letters: `dialect.spelt_otherwise`), with
white space around the colon too, or in the parsed data: a compact stream pays nothing more.

A substring is looked for with `find`, a single byte with an int `in` (a memchr): on CPython
3.11, `sub in data` first tries `sub` as an integer and formats the TypeError it then clears,
some 1,000 instructions a test, more than the search itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import msgspec

from relay.stream import dialect as D
from relay.stream.dialect import Api

# An event larger than this is not scanned (it is still relayed).
_MAX_PENDING = 1 << 20
# (a Responses `response.completed` repeats the whole output and the request's instructions
# and tools: its usage is kept whatever its size up to the scanner's bound)
_MAX_META = _MAX_PENDING
# Two raw bytes that make a blank line (an event's end) however the lines end: LF LF, CR CR,
# LF CR (CRLF CRLF holds it; a lone CR and a lone LF end a line each, and CRLF once).
_RAW_ENDS = (b"\n\n", b"\r\r", b"\n\r")


def carries_content(
    event: bytes, markers: tuple[bytes, ...] = D.MARKERS, spelt: bool = True
) -> bool:
    """True when the event holds at least one non-empty generated string. `spelt`: the
    stream may spell its JSON otherwise than compact (`dialect.spelt_otherwise`): then a
    marker's name with white space (or, over several `data:` lines, a line end) around its
    colon counts too, and names spelt with escapes are looked for in the parsed data."""
    for marker in markers:
        i = event.find(marker)
        while i >= 0:
            j = i + len(marker)
            # A value that is not the empty string `""`.
            if j < len(event) and event[j] != 0x22:
                return True
            i = event.find(marker, j)
    return spelt and _spelt_content(event, markers)


def _spelt_content(event: bytes, markers: tuple[bytes, ...]) -> bool:
    for marker in markers:
        # (`"content":"` less its `:"`: the quoted name)
        name = marker[:-2]
        i = event.find(name)
        while i >= 0:
            j = i + len(name)
            k = _value_at(event, j)
            if 0 < k < len(event) and event[k - 1] == 0x22 and event[k] != 0x22:
                return True
            i = event.find(name, j)
    if not D.escapes_a_letter(event):
        return False
    names = frozenset(m[1:-3].decode() for m in markers)
    return _any_member(D.parsed(event), lambda k, v: k in names and isinstance(v, str) and v != "")


def _value_at(event: bytes, j: int) -> int:
    """One past the first byte of the value after a name that ends at `j` (past a colon and
    white space, a `data:` line's start included); 0 when no colon follows the name."""
    colon = False
    n = len(event)
    while j < n:
        c = event[j]
        if c == 0x0A:
            # A line end inside data over several lines: the next line is a `data:` one.
            if not event.startswith(b"data:", j + 1):
                return 0
            j += 6
        elif c in (0x20, 0x09, 0x0D):
            j += 1
        elif c == 0x3A and not colon:
            colon = True
            j += 1
        else:
            return j + 1 if colon else 0
    return 0


def is_meta(event: bytes, spelt: bool = True) -> bool:
    """The event carries figures to keep: a `timings` key, or a `usage` that is not null.
    (vLLM and OpenAI put `"usage":null` in every chunk when `include_usage` is set: those
    are not the usage, which comes last, and must not replace an earlier one.) `spelt`: as
    `carries_content`'s (names spelt with escapes are looked for in the parsed data)."""
    if event.find(b'"timings"') >= 0:
        return True
    i = event.find(b'"usage"')
    while i >= 0:
        i += 7
        rest = event[i : i + 16].lstrip(b" \t\r\n")
        if not (rest[:1] == b":" and rest[1:].lstrip(b" \t\r\n").startswith(b"null")):
            return True
        i = event.find(b'"usage"', i)
    if not spelt or not D.escapes_a_letter(event):
        return False
    return _any_member(
        D.parsed(event), lambda k, v: k == "timings" or (k == "usage" and v is not None)
    )


def _any_member(doc: object, test: Callable[[str, object], bool]) -> bool:
    """A member of `doc`, at any depth, for which `test(name, value)` holds."""
    todo = [doc]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            for name, value in v.items():
                if test(name, value):
                    return True
                todo.append(value)
        elif isinstance(v, list):
            todo.extend(v)
    return False


def content_event_at(data: bytes, start: int, end: int) -> int:
    """Where the text starts when data[start:end] is exactly one event, ended by its blank
    line, whose first content marker holds a non-empty string, with no CR (a CR may end a
    line too) and no `timings` nor `usage` but one `"usage":null` (`is_meta`) in it: the
    scanner would count one content event and keep nothing else. 0 when it is anything else."""
    if not data.endswith(b"\n\n", start, end):
        return 0
    i = data.find(b'"content":"', start, end)
    if i < 0:
        i = data.find(b'"text":"', start, end)
        if i < 0:
            return 0
        i += 8
    else:
        i += 11
    if (
        i < end - 2
        and data[i] != 0x22
        and data.find(b"\n\n", start, end) == end - 2
        and data.find(b"\r", start, end) < 0
        and data.find(b'"timings"', start, end) < 0
    ):
        u = data.find(b'"usage"', start, end)
        if u < 0 or (
            data.startswith(b'"usage":null', u) and data.find(b'"usage"', u + 12, end) < 0
        ):
            return i
    return 0


class _Stop(msgspec.Struct):
    stop: object = None


_stop = msgspec.json.Decoder(_Stop)


def native_end(event: bytes) -> bool:
    """A llama native event that ends its stream (`"stop":true`), in any spelling: read in
    place as llama-server writes it, else (a `true` in it: a literal has no other spelling)
    by a parse of its data."""
    if event.find(b'"stop":false') >= 0:
        return False
    if event.find(b'"stop":true') >= 0:
        return True
    if event.find(b"true") < 0:
        return False
    try:
        return _stop.decode(D.data_of(event)).stop is True
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


class _Block(msgspec.Struct):
    type: str = ""


class _BlockStart(msgspec.Struct):
    index: int = 0
    content_block: _Block = msgspec.field(default_factory=_Block)


_block_start = msgspec.json.Decoder(_BlockStart)
_COMPACT = (D.CHAT, D.TEXT)
_ENDS = (b"response.completed", b"response.incomplete", b"response.failed")


class SseScanner:
    __slots__ = (
        "blocks",
        "content_events",
        "delta_seen",
        "dialect",
        "done_seen",
        "error_first",
        "first_event",
        "head_event",
        "last_event",
        "markers",
        "meta",
        "meta_first",
        "on_first_content",
        "oversized",
        "pending",
        "recognised",
        "shortcut",
        "spelt",
        "started",
    )

    def __init__(
        self, on_first_content: Callable[[], None] | None = None, dialect: Api = D.CHAT
    ) -> None:
        # The events that carried generated content, and the unfinished event's text.
        self.content_events = 0
        self.pending: bytes | bytearray = b""
        # The stream's own end went by ([DONE], message_stop, ...); an error event came
        # before any content.
        self.done_seen = False
        self.error_first = False
        # The last event carrying usage or timings, and the first one.
        self.meta = b""
        self.meta_first = b""
        self.oversized = False
        # Called once, at the first content event.
        self.on_first_content = on_first_content
        self.first_event = True
        # An event named the stream's API (`dialect.recognise`).
        self.recognised = False
        # The stream's opening events (up to the one that names its API) spell their JSON
        # otherwise than compact and unescaped (`dialect.spelt_otherwise`): its serializer
        # does, so its markers are looked for in any spelling (a test or two per stream: a
        # compact stream pays nothing more).
        self.spelt = False
        # What a terminal frame must close. MESSAGES: message_start went by, the open content
        # blocks' types by index, message_delta (the stop reason) went by. RESPONSES:
        # response.created went by, that event, and the last event (its sequence_number
        # goes on).
        self.started = False
        # (Made at the first content block: most streams speak another API.)
        self.blocks: dict[int, str] | None = None
        self.delta_seen = False
        self.head_event = b""
        self.last_event = b""
        self.use(dialect)

    def use(self, dialect: Api) -> None:
        """Read the stream as `dialect` speaks (the path's guess, or what its events say)."""
        self.dialect = dialect
        self.markers = D.RESPONSES_MARKERS if dialect == D.RESPONSES else D.MARKERS
        # `content_event_at` (and the fast path it teaches) knows the `content` / `text`
        # markers only: a Responses `.done` event holds the whole text as `"text":"`
        self.shortcut = dialect != D.RESPONSES

    def after(self, data: bytes) -> SseScanner:
        """A copy of this scanner that has read `data` too (this one is left as it was, and
        the copy calls nothing back): what a stream will have said once `data` follows."""
        other = copy.copy(self)
        other.on_first_content = None
        other.pending = bytes(self.pending)
        other.blocks = dict(self.blocks) if self.blocks is not None else None
        other.feed(data)
        return other

    def feed_span(self, data: bytes, start: int, end: int) -> None:
        """Scan data[start:end] without copying it when it is one whole content event.

        That is the usual read (one token per read); anything else - several events, a
        partial one, a meta or [DONE] event - takes the general path.
        """
        if (
            self.shortcut
            and not self.pending
            and not self.first_event
            and content_event_at(data, start, end)
        ):
            self.content_events += 1
            if self.content_events == 1 and self.on_first_content is not None:
                self.on_first_content()
            return
        self.feed(data[start:end])

    def feed(self, data: bytes) -> None:
        pending = self.pending
        if pending:
            joined = self._joined(pending, data)
            if joined is None:
                return
            data = joined
        if 13 in data:
            if data.endswith(b"\r") and not data.endswith((b"\r\r", b"\n\r")):
                # A lone CR may be half of a CRLF: its meaning waits for the next read (what
                # comes before it is scanned now: the pending tail never holds an event end).
                self.feed(data[:-1])
                self.pending += b"\r"
                return
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        start = 0
        find = data.find
        while True:
            end = find(b"\n\n", start)
            if end < 0:
                break
            if end > start:
                self._event(data[start:end])
            start = end + 2
        if start < len(data):
            rest = data[start:] if start else data
            if rest.strip(b"\n"):
                if len(rest) > _MAX_PENDING:
                    # This event is given up on; relaying goes on.
                    self.oversized = True
                else:
                    self.pending = rest

    def _joined(self, pending: bytes | bytearray, data: bytes) -> bytes | None:
        """The unfinished event and the new bytes, when the new bytes may end it; else None,
        the event grown in place. Only the new bytes (and the one before them) are searched
        for its end, and it is joined once, so an event split over any number of reads
        costs time linear in its size (an int `in` is a memchr: no line end in the new
        bytes, no event end)."""
        if not data.endswith(b"\n\n") and (
            (10 not in data and 13 not in data)
            or not (
                data.find(b"\n\n") >= 0
                or data.find(b"\r\r") >= 0
                or data.find(b"\n\r") >= 0
                or pending[-1:] + data[:1] in _RAW_ENDS
            )
        ):
            if len(pending) + len(data) > _MAX_PENDING:
                # This event is given up on; relaying goes on.
                self.oversized = True
                self.pending = b""
            elif isinstance(pending, bytes):
                self.pending = bytearray(pending) + data
            else:
                pending += data
            return None
        self.pending = b""
        return (pending if pending.__class__ is bytes else bytes(pending)) + data

    def _event(self, ev: bytes) -> None:
        ev = ev.lstrip(b"\n")
        if not ev:
            return
        if self.first_event or not self.recognised:
            self._opening(ev)
        if self.dialect == D.MESSAGES:
            self._message_event(ev)
        elif self.dialect == D.RESPONSES:
            self._response_event(ev)
        if carries_content(ev, self.markers, self.spelt):
            self.content_events += 1
            if self.content_events == 1 and self.on_first_content is not None:
                self.on_first_content()
        elif ev.startswith((b"data: [DONE]", b"data:[DONE]")):
            self.done_seen = True
        if self.dialect == D.NATIVE and native_end(ev):
            self.done_seen = True
        if len(ev) <= _MAX_META and is_meta(ev, self.spelt):
            self.meta = ev
            if not self.meta_first:
                self.meta_first = ev

    def _opening(self, ev: bytes) -> None:
        """The events that open a stream: the first (an error?), and the first that names
        its API (the first, as a rule)."""
        if not self.recognised:
            api = D.recognise(ev)
            # Chat and legacy are found by a compact member (`"object":"..."`): their
            # serializer spells compact. A name says nothing of the data's spelling.
            if api not in _COMPACT and not self.spelt:
                self.spelt = D.spelt_otherwise(ev)
                if api is None and self.spelt:
                    api = D.recognise_parsed(ev)
            if api is not None:
                self.recognised = True
                if api != self.dialect:
                    self.use(api)
        # A comment line (llama-server's ping while it reads a long prompt) is not the first
        # event: the error a first event may be comes after it.
        if self.first_event and (ev[0] != 0x3A or 10 in ev):
            self.first_event = False
            self.error_first = _is_error(ev, self.spelt)

    def _message_event(self, ev: bytes) -> None:
        """Anthropic's lifecycle: what a terminal frame must close."""
        name = D.event_name(ev)
        if name == b"content_block_delta":
            # The usual event: nothing to follow.
            return
        if name == b"message_start":
            self.started = True
        elif name == b"content_block_start":
            body = event_json(ev)
            try:
                start = _block_start.decode(body) if body else _BlockStart()
            except (msgspec.DecodeError, msgspec.ValidationError):
                start = _BlockStart()
            blocks = self.blocks
            if blocks is None:
                blocks = self.blocks = {}
            blocks[start.index] = start.content_block.type
        elif name == b"content_block_stop" and self.blocks:
            body = event_json(ev)
            try:
                self.blocks.pop(_block_start.decode(body).index if body else -1, None)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.blocks.clear()
        elif name == b"message_delta":
            self.delta_seen = True
        elif name == b"message_stop":
            self.done_seen = True
        elif name == b"error":
            # Anthropic's streamed error ends the stream.
            self.done_seen = True
            self.error_first = not self.content_events

    def _response_event(self, ev: bytes) -> None:
        """OpenAI Responses' lifecycle: the response a terminal frame must end."""
        self.last_event = ev
        name = D.event_name(ev)
        if name.endswith(b".delta"):
            # The usual event.
            return
        if name == b"response.created":
            self.started = True
            self.head_event = ev
        elif name in _ENDS:
            self.done_seen = True
            if name == b"response.failed" and not self.content_events:
                self.error_first = True
        elif name == b"error":
            self.done_seen = True
            self.error_first = not self.content_events


def _is_error(ev: bytes, spelt: bool) -> bool:
    """An `{"error": ...}` event, Anthropic's or Responses' `error` (`spelt`: in any
    spelling)."""
    if ev.startswith((b'data: {"error"', b'data:{"error"')) or D.event_name(ev) == b"error":
        return True
    doc = D.parsed(ev) if spelt else None
    return isinstance(doc, dict) and "error" in doc


def event_json(event: bytes) -> bytes | None:
    """The JSON text of a single-line `data:` event, or None."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            body = line[5:].strip()
            if body.startswith(b"{"):
                return body
    return None

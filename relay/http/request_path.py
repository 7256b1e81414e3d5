"""The path a request really names: what the upstream will route on, not the bytes sent.

llama-server (cpp-httplib) percent-decodes the path before it matches its routes, so
`/v1/chat/%63ompletions` is chat. Every rule that depends on the path (slots, internal and
admin endpoints, the stall frame's shape) must see the same name the upstream will. The
normalised form errs towards matching: percent-decoding of every octet, repeated slashes
folded, dot segments removed, a trailing slash dropped. The target sent upstream is not
changed; only the relay's decisions use this.

What a path is, is written here once, for that view (`normalize`) and for the check that
keeps a client under an upstream's path prefix (`dot_segment_in`, `upstream_url`), both
erring towards what some server somewhere reads:
- `origin_form`: an absolute-form target (`http://host/p?q`, the scheme in any case) is its
  path and query; `path_part`: the path, still encoded, up to the first `?`;
- `segments`: separated by `/` and by `\\` (IIS, and servers that read it as `/`), overlong
  UTF-8 forms of `.`, `/`, `\\` read as those (old IIS and Tomcat did);
- `dot_kind`: `.` or `..` (a `Dot`) before any `;` (a path parameter, dropped by Tomcat and
  Jetty: `..;` is `..` there) or NUL.
"""

from __future__ import annotations

import enum
import re
from typing import overload
from urllib.parse import unquote_to_bytes

# Longer names are truncated where the relay echoes or stores them.
MAX_PATH_CHARS = 2048
# The percent-decoding rounds `dot_segment_in` follows (a path still changing: refused).
MAX_DECODES = 8

# The scheme and authority of an absolute-form target.
_ABSOLUTE = re.compile(rb"[Hh][Tt][Tt][Pp][Ss]?://[^/?#]*")
_SEPARATOR = re.compile(rb"[/\\]")
# Never valid UTF-8, so in no real name; decoders that accepted them made `.`, `/`, `\` of them.
_OVERLONG = {
    b"\xc0\xae": b".",
    b"\xe0\x80\xae": b".",
    b"\xc0\xaf": b"/",
    b"\xe0\x80\xaf": b"/",
    b"\xc1\x9c": b"\\",
    b"\xe0\x81\x9c": b"\\",
}
_OVERLONG_FORM = re.compile(b"|".join(re.escape(k) for k in _OVERLONG))
_PARAMETER = re.compile(rb"[;\x00]")


class Dot(enum.IntEnum):
    """What a path segment is as a dot segment: none, `.` (this one) or `..` (the parent)."""

    NONE = 0
    CURRENT = 1
    PARENT = 2


def origin_form(target: bytes) -> bytes:
    """`target` in origin form: an absolute-form target's path and query (`/` for an empty
    path); any other target as it is."""
    m = _ABSOLUTE.match(target)
    if m is None:
        return target
    rest = target[m.end() :]
    return rest if rest[:1] == b"/" else b"/" + rest


def path_part(target: bytes) -> bytes:
    """The path of a request target as sent (still encoded): its origin form up to `?`."""
    return origin_form(target).split(b"?", 1)[0]


def segments(path: bytes) -> list[bytes]:
    """The segments of a path (decoded as far as the caller wants): split at `/` and `\\`."""
    if not path.isascii():
        path = _OVERLONG_FORM.sub(lambda m: _OVERLONG[m.group()], path)
    return _SEPARATOR.split(path)


def dot_kind(seg: bytes) -> Dot:
    """The dot segment `seg` is; a `;` parameter or a NUL and what follows it are not looked
    at (`..;x` is `..`)."""
    if seg[:1] != b".":
        return Dot.NONE
    name = _PARAMETER.split(seg, 1)[0]
    if name == b"..":
        return Dot.PARENT
    return Dot.CURRENT if name == b"." else Dot.NONE


def dot_segment_in(path: bytes) -> bool:
    """Whether a server could read a dot segment in `path` (a request path as sent): in its
    bytes, or in what any number of percent-decoding rounds makes of them (`%2e%2e`, `..%2f`,
    `%252e%252e`: some servers decode twice), up to MAX_DECODES; a path that is still
    changing after that many rounds counts as one. The usual path has nothing to decode
    and no dot: it is told at once."""
    if path.isascii() and 46 not in path and 37 not in path:
        return False
    for _ in range(MAX_DECODES + 1):
        if any(dot_kind(seg) is not Dot.NONE for seg in segments(path)):
            return True
        decoded = unquote_to_bytes(path)
        if decoded == path:
            return False
        path = decoded
    return True


def normalize(target: bytes) -> str:
    """The normalised path of a request target (query and fragment dropped), decoded once
    as the upstream decodes it."""
    raw = path_part(target).split(b"#", 1)[0]
    out: list[bytes] = []
    for seg in segments(unquote_to_bytes(raw)):
        if not seg:
            continue
        # A segment that does not start with a dot is a name: kept without asking `dot_kind`.
        if seg[:1] != b".":
            out.append(seg)
            continue
        kind = dot_kind(seg)
        if kind is Dot.PARENT:
            if out:
                out.pop()
        elif kind is Dot.NONE:
            out.append(seg)
    return "/" + b"/".join(out).decode("latin-1")


# Target -> its bounded normalised path, for the targets seen often: up to `_SEEN_MAX`
# entries (then all are forgotten at once), of targets up to `_SEEN_TARGET` bytes.
_SEEN: dict[bytes, str] = {}
_SEEN_MAX = 512
_SEEN_TARGET = 256


def route_path(target: bytes) -> str:
    """`bounded(normalize(target), MAX_PATH_CHARS)`, remembered for short targets: a client
    names the same few endpoints again and again."""
    path = _SEEN.get(target)
    if path is None:
        path = bounded(normalize(target), MAX_PATH_CHARS)
        if len(target) <= _SEEN_TARGET:
            if len(_SEEN) >= _SEEN_MAX:
                _SEEN.clear()
            _SEEN[target] = path
    return path


@overload
def bounded(text: str, limit: int = ...) -> str: ...
@overload
def bounded(text: None, limit: int = ...) -> None: ...
def bounded(text: str | None, limit: int = 256) -> str | None:
    """`text` cut to `limit` characters (with a marker) for errors, rows and log lines."""
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"...[{len(text) - limit} more]"

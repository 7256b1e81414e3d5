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
- `dot_kind`: `.` or `..` before any `;` (a path parameter, dropped by Tomcat and Jetty:
  `..;` is `..` there) or NUL.
"""

from __future__ import annotations

import re
from typing import overload
from urllib.parse import unquote_to_bytes

MAX_PATH_CHARS = 2048  # longer names are truncated where the relay echoes or stores them
MAX_DECODES = 8  # percent-decoding rounds `dot_segment_in` follows (a path still changing: refused)

_ABSOLUTE = re.compile(rb"[Hh][Tt][Tt][Pp][Ss]?://[^/?#]*")  # scheme and authority
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


def dot_kind(seg: bytes) -> int:
    """2 for a `..` segment, 1 for `.`, else 0; a `;` parameter or a NUL and what follows it
    are not looked at (`..;x` is `..`)."""
    if seg[:1] != b".":
        return 0
    name = _PARAMETER.split(seg, 1)[0]
    return len(name) if name in (b".", b"..") else 0


def dot_segment_in(path: bytes) -> bool:
    """Whether a server could read a dot segment in `path` (a request path as sent): in its
    bytes, or in what any number of percent-decoding rounds makes of them (`%2e%2e`, `..%2f`,
    `%252e%252e`: some servers decode twice), up to MAX_DECODES; a path that is still
    changing after that many rounds counts as one."""
    if path.isascii() and b"." not in path and b"%" not in path:
        return False  # the usual path: nothing to decode, no dot
    for _ in range(MAX_DECODES + 1):
        if any(dot_kind(seg) for seg in segments(path)):
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
        kind = dot_kind(seg)
        if kind == 2:
            if out:
                out.pop()
        elif kind == 0:
            out.append(seg)
    return "/" + b"/".join(out).decode("latin-1")


_SEEN: dict[bytes, str] = {}  # target -> bounded normalised path, for the targets seen often
_SEEN_MAX = 512  # entries kept (then forgotten all at once)
_SEEN_TARGET = 256  # longer targets are not kept


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

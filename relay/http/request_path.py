"""The path a request really names: what the upstream will route on, not the bytes sent.

llama-server (cpp-httplib) percent-decodes the path before it matches its routes, so
`/v1/chat/%63ompletions` is chat. Every rule that depends on the path (slots, internal and
admin endpoints, the stall frame's shape) must see the same name the upstream will. The
normalised form errs towards matching: percent-decoding of every octet, repeated slashes
folded, dot segments removed, a trailing slash dropped. The target sent upstream is not
changed; only the relay's decisions use this.
"""

from __future__ import annotations

from typing import overload
from urllib.parse import unquote_to_bytes

MAX_PATH_CHARS = 2048  # longer names are truncated where the relay echoes or stores them


def normalize(target: bytes) -> str:
    """The normalised path of a request target (query and fragment dropped)."""
    raw = target.split(b"?", 1)[0].split(b"#", 1)[0]
    if raw.startswith((b"http://", b"https://")):  # absolute-form: keep the path part
        slash = raw.find(b"/", raw.find(b"//") + 2)
        raw = raw[slash:] if slash >= 0 else b"/"
    decoded = unquote_to_bytes(raw).decode("latin-1")
    out: list[str] = []
    for seg in decoded.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if out:
                out.pop()
            continue
        out.append(seg)
    return "/" + "/".join(out)


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

"""Header fields as received, and the lookups every rule uses.

A request's headers come from h11, a response's from `response_head`; both are kept as
`HeaderList`s: the (name as sent, value) pairs in order, with their lower-case names beside
them, so a lookup is a C scan of those names, not a `lower()` per name per lookup.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from itertools import compress
from operator import not_
from typing import Protocol

import msgspec

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

# One header field: (name as sent, value).
Header = tuple[bytes, bytes]
Headers = list[Header]
# Headers given to read only: any sequence of fields (a HeaderList, a list, a tuple).
HeaderPairs = Sequence[Header]


class HeaderList(list[Header]):
    """Headers as received ((name as sent, value) pairs, in order) with their lower-case names
    beside them in `lows` (h11 made them for a request, `response_head` for a response), so
    the relay's lookups are C scans of `lows`, not a lower() per name per lookup."""

    __slots__ = ("lows",)
    lows: list[bytes]


class H11Headers(Protocol):
    """What `request_headers` reads of h11's headers of a request (`h11.Request.headers`)."""

    def raw_items(self) -> list[Header]: ...


def header_list(pairs: Iterable[Header], lows: list[bytes]) -> HeaderList:
    """A HeaderList of `pairs` with `lows` (a plain function: no Python __init__ to run)."""
    out = HeaderList(pairs)
    out.lows = lows
    return out


class RequestHead(msgspec.Struct, frozen=True, gc=False):
    """A request's head as the relay reads it: h11's fields for an `h11.Request`
    (`request_head`), or made whole from the bytes (`usual_head`, no h11 event). (Not
    tracked by the collector: its headers hold bytes only.)"""

    method: bytes
    target: bytes
    http_version: bytes
    headers: HeaderList


class H11Request(Protocol):
    """What `request_head` reads of an `h11.Request`."""

    @property
    def method(self) -> bytes: ...
    @property
    def target(self) -> bytes: ...
    @property
    def http_version(self) -> bytes: ...
    @property
    def headers(self) -> H11Headers: ...


def request_head(ev: H11Request) -> RequestHead:
    """The RequestHead of a request h11 read."""
    return RequestHead(ev.method, ev.target, ev.http_version, request_headers(ev.headers))


def request_headers(h11_headers: H11Headers) -> HeaderList:
    """The HeaderList of an h11 request's headers. h11 keeps each field as (name as sent,
    lower-case name, value) in `_full_items`: read there when it is, else made here."""
    full: list[tuple[bytes, bytes, bytes]] | None = getattr(h11_headers, "_full_items", None)
    if full is None:
        full = [(k, k.lower(), v) for k, v in h11_headers.raw_items()]
    return header_list([(raw, v) for raw, _, v in full], [low for _, low, _ in full])


# `name: value` of one field, joined in C (mapped over a head's fields: no Python loop).
header_line = b": ".join


def kept(headers: HeaderPairs, lows: list[bytes], drop: AbstractSet[bytes]) -> Iterator[Header]:
    """The fields whose lower-case name (`lows`) is not in `drop`, in order, chosen in C."""
    return compress(headers, map(not_, map(drop.__contains__, lows)))


def lower_names(headers: HeaderPairs) -> list[bytes]:
    """The headers' lower-case names in order: a HeaderList's own, else made here."""
    if type(headers) is HeaderList:
        return headers.lows
    return [k.lower() for k, _ in headers]


def values_of(headers: HeaderPairs, lows: list[bytes], name: bytes) -> list[bytes]:
    """Every value of the header `name` (lower case); `lows`: `lower_names(headers)`. The
    usual head names it once or not at all: found by index, not by a loop."""
    n = lows.count(name)
    if n <= 1:
        return [headers[lows.index(name)][1]] if n else []
    return [v for (_, v), low in zip(headers, lows) if low == name]


def connection_tokens(headers: HeaderPairs) -> set[bytes]:
    """The header names a `Connection` header lists (hop-by-hop for this one message)."""
    return {
        t.strip().lower()
        for value in values_of(headers, lower_names(headers), b"connection")
        for t in value.split(b",")
        if t.strip()
    }


def get(headers: HeaderPairs, name: bytes) -> bytes | None:
    """First value of a header (name given in lower case)."""
    lows = lower_names(headers)
    return headers[lows.index(name)][1] if name in lows else None


def has_token(headers: HeaderPairs, name: bytes, token: bytes) -> bool:
    """Whether a comma-separated header (e.g. Connection) lists `token`."""
    return any(
        t.strip().lower() == token
        for v in values_of(headers, lower_names(headers), name)
        for t in v.split(b",")
    )

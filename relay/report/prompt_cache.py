"""The prompt cache's hit ratio of stored rows, per pool: the prompt tokens its members were
sent, the part of them they reused from their cache (`cached_tokens`), and cached / prompt.
Pure.

Only the rows of a pool count (`pool` set: the fleet's dispatcher names the pool the serving
upstream was chosen from). A row that names no cached figure (the upstream said none, or its
tokens were counted, reserved or untrusted) counts its prompt, not as cached: the ratio is
of every prompt token the pool was sent. A row's figures are held to what a count can be, as
the relay holds the upstream's (stream.usage): the prompt from 0 to MAX_TOKENS, the cached
part from 0 up to the prompt, else none of it cached (another tool may write the table).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypedDict

from relay.stream.usage import MAX_TOKENS, cached_within

# What the figures are, as every text form says it beside them.
LEGEND = (
    "prompt cache: cached / prompt tokens of the requests of a pool; a request whose row "
    "names no cached figure counts its prompt, not as cached"
)


class Hits(TypedDict):
    """A pool's figures (or a group's, or the total's): its rows, their prompt tokens, the
    cached part, and cached / prompt (None: no prompt token)."""

    requests: int
    prompt_tokens: int | float
    cached_tokens: int | float
    hit_ratio: float | None


class PoolHits(Hits):
    pool: str


def _figures(row: Mapping[str, object]) -> tuple[int | float, int | float]:
    """A row's (prompt, cached) as the ratio counts them."""
    prompt = row.get("prompt_tokens")
    p = min(max(prompt, 0), MAX_TOKENS) if isinstance(prompt, (int, float)) else 0
    cached = row.get("cached_tokens")
    c = cached_within(cached, p) if isinstance(cached, (int, float)) else None
    return p, c or 0


def hits(rows: Iterable[Mapping[str, object]]) -> Hits:
    """The figures of the rows that have a pool, whichever it is."""
    n = 0
    prompt: int | float = 0
    cached: int | float = 0
    for row in rows:
        if row.get("pool") is None:
            continue
        p, c = _figures(row)
        n, prompt, cached = n + 1, prompt + p, cached + c
    return {
        "requests": n,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_ratio": cached / prompt if prompt > 0 else None,
    }


def per_pool(rows: Iterable[Mapping[str, object]]) -> list[PoolHits]:
    """Each pool's figures, ordered by name."""
    members: dict[str, list[Mapping[str, object]]] = {}
    for row in rows:
        pool = row.get("pool")
        if isinstance(pool, str):
            members.setdefault(pool, []).append(row)
    return [{"pool": name, **hits(members[name])} for name in sorted(members)]


def percent(ratio: float | None) -> str:
    """A hit ratio as the text forms print it."""
    return "-" if ratio is None else f"{ratio * 100:.1f}%"

"""The simulator's slots and their prompt caches, as llama-server keeps them: pure rules.

Each `Slot` keeps the tokens its KV cache holds: the last prompt it processed and the reply it
decoded (all of the reply but its last token, which llama-server samples and never decodes).
A new generation takes a free slot by `choose`, llama-server's ``get_available_slot``: the
free slot whose cache shares the largest fraction of the new prompt (its longest common
prefix over the prompt's length) when that fraction is above the similarity threshold
(``--slot-prompt-similarity``, 0.1 by default, 0 turns it off); else the least recently used
free slot (of equally old ones the last, so a fresh server's first pick is its last slot).
`reuse` is what the slot then spares: the common prefix, but never the whole prompt
(llama-server evaluates at least the prompt's last token). No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(eq=False, slots=True)
class Slot:
    """One slot: its id, what its cache holds, whether a generation holds it, when it was last
    released (a tick of its SimState, -1 never), and the last task it took (-1 none)."""

    id: int
    tokens: list[int] = field(default_factory=list)
    busy: bool = False
    last_used: int = -1
    task: int = -1


class SlotView(NamedTuple):
    """What /slots shows of one slot (endpoints.slots_body): the task it runs or ran last
    (`task` -1: none yet), the tokens its cache holds, that task's prompt figures while it
    runs, its token limit (-1 none) and the tokens it generated so far."""

    id: int
    busy: bool
    task: int
    n_tokens: int
    processed: int
    cached: int
    remain: int
    decoded: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def reuse(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """The prompt tokens a slot holding `cached` spares: the common prefix, at most all but
    the prompt's last token."""
    return min(common_prefix(cached, prompt), max(len(prompt) - 1, 0))


def choose(slots: Sequence[Slot], prompt: Sequence[int], similarity: float) -> Slot | None:
    """The free slot a prompt goes to (None when every slot is busy): by similarity above
    the threshold, else the least recently used."""
    free = [s for s in slots if not s.busy]
    if not free:
        return None
    if similarity != 0.0 and prompt:
        best: Slot | None = None
        best_sim = 0.0
        for s in free:
            if not s.tokens:
                continue
            sim = common_prefix(s.tokens, prompt) / len(prompt)
            if sim > best_sim and sim > similarity:
                best, best_sim = s, sim
        if best is not None:
            return best
    lru = free[0]
    for s in free[1:]:
        if s.last_used <= lru.last_used:
            lru = s
    return lru

"""Which key's waiting request a freed slot serves: priority classes, then fair turns.

Pure: the queue (`proxy.slots`) keeps one line of waiting requests per key (requests without a
key share one line), and asks here which line is served next:

1. **Priority**: the line of the highest class (`[[key]].priority`) first.
2. **No starvation**: a line that has waited `aging_s` or more for a turn (since its oldest
   request came, or since its last turn, whichever is later) takes turns as if it were of the
   highest class among the lines waiting (not above it: a flood's own line always has an old
   request, and must not jump ahead of fresh requests of its own class). Its start is the
   virtual time (3.) and its oldest request old, so it takes the next turn but for a line as
   early and older, then waits again. A steady flood of a higher class thus delays a lower
   one's request by at most `aging_s` plus the turns of the lines it then shares them with,
   and gives the lower class a turn every `aging_s`; a lower class's backlog that is being
   served (not starved) never goes ahead of a higher class, however long it has queued.
3. **Fair turns within a class**: start-time fair queuing (Goyal, Vin and Cheng, 1996). The
   queue keeps a virtual time; each line a virtual start (its next request's) and finish (its
   last request's): a line that gets waiting requests starts at the later of its finish and
   the virtual time, the line with the lowest start is served, and serving moves the virtual
   time to that start and the line's finish to start + 1 / `weight`. Two keys of one weight
   with requests waiting take turns 1:1 however many each has queued; weights 2 and 1 take
   2:1. A key that was idle starts at the virtual time: it cannot bank turns while idle, and
   its first request is served next (a request served at once, with a free slot, counts as a
   turn too: `charged`). Nor while it waited for a higher class: a line's start is taken at
   the virtual time at least (`activated`) whenever a freed slot looks at it, so a key of a
   lower class that waited through a higher class's run takes turns with the keys of its
   own class afterwards, not a run of turns ahead of them.
4. Ties go to the line whose oldest request came first.

Within a line, requests are first come first served, but for prompt-cache affinity
(`policy.affinity.pick_waiting`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class Line(msgspec.Struct, frozen=True, gc=False):
    """A line as the choice sees it: its class, its virtual start, when its oldest request
    (one the freed slot may take) was queued, and when its wait for a turn began (`since`:
    the later of that and its last turn; None: `oldest_at`)."""

    rank: int
    start: float
    oldest_at: float
    since: float | None = None


def pick_line(lines: Sequence[Line], now: float, aging_s: float) -> int | None:
    """The index of the line served next, None when there is none."""
    best: int | None = None
    best_key: tuple[int, float, float] | None = None
    top = max((line.rank for line in lines), default=0)
    for i, line in enumerate(lines):
        since = line.oldest_at if line.since is None else line.since
        rank = top if now - since >= aging_s else line.rank
        key = (-rank, line.start, line.oldest_at)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def activated(finish: float, vtime: float) -> float:
    """The virtual start of a line that gets waiting requests again."""
    return max(finish, vtime)


def charged(start: float, weight: int) -> float:
    """The line's virtual finish once its request that started at `start` is served."""
    return start + 1.0 / weight

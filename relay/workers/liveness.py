"""The parent's rules for its workers' lives, without a loop or a process: when a worker that
does not answer is lost (`Hearing`, `Awake`), how long a restart waits (`Restarts`), and when
a relay none of whose workers serves gives up (`Vacancy`). The clock is the caller's
(`time.monotonic()`); relay.workers.parent applies the verdicts.

A worker is judged on the asks it does not answer: the parent asks each serving worker for
its figures once a second, and any frame from the worker counts as an answer. The silence
counts from the first ask it has not answered, never from before the parent's own loop last
stalled: frames a parent did not run to read are not a worker's silence.
"""

from __future__ import annotations

# A restart after a worker that served waits nothing; each quick loss after it, this, doubled
# up to `RESTART_CAP_S`; a worker that served `RESTART_RESET_S` resets the doubling.
RESTART_FIRST_S = 1.0
RESTART_CAP_S = 30.0
RESTART_RESET_S = 30.0
# Past this many doublings the wait is the cap already.
_STREAK_MAX = 16


class Hearing:
    """What the parent heard of one worker: its last frame, and the first ask it has sent
    since then (None: every ask is answered)."""

    __slots__ = ("asked_at", "heard_at")

    def __init__(self, now: float) -> None:
        self.heard_at = now
        self.asked_at: float | None = None

    def heard(self, now: float) -> None:
        self.heard_at = now
        self.asked_at = None

    def asked(self, now: float) -> None:
        if self.asked_at is None:
            self.asked_at = now

    def silent_s(self, now: float, awake_since: float) -> float:
        """How long an ask has gone unanswered while the parent ran (`Awake.since`)."""
        if self.asked_at is None:
            return 0.0
        return max(0.0, now - max(self.asked_at, awake_since))


class Awake:
    """The parent's own loop, as a timer of period `period` sees it: `since`, when it last
    came back from a stall (a tick later than `slack`), before which no silence counts."""

    __slots__ = ("_last", "since")

    def __init__(self, now: float) -> None:
        self.since = self._last = now

    def tick(self, now: float, period: float, slack: float) -> bool:
        """One tick of the timer, at `now`; True when the loop had stalled before it."""
        stalled = now - self._last - period > slack
        if stalled:
            self.since = now
        self._last = now
        return stalled


def stall_slack(timeout_s: float) -> float:
    """A tick this much late is the parent's stall: a quarter of the workers' bound, so that
    a worker is lost only after at least three quarters of it in which the parent read."""
    return timeout_s / 4


class Restarts:
    """One worker slot's restarts. A worker that served and was lost is replaced at once;
    one lost within `RESTART_FIRST_S` of its start, or before it served, or each one after
    it until a worker serves `RESTART_RESET_S`, waits `RESTART_FIRST_S` doubled each time, up
    to `RESTART_CAP_S`."""

    __slots__ = ("streak",)

    def __init__(self) -> None:
        self.streak = 0

    def lost(self, lived_s: float, served: bool) -> float:
        """A worker lost after `lived_s`: the wait before its replacement starts."""
        if served and lived_s >= RESTART_RESET_S:
            self.streak = 0
        elif not served or lived_s < RESTART_FIRST_S:
            self.streak = max(self.streak, 1)
        return self._next()

    def failed(self) -> float:
        """A replacement could not even be started (no fork, no descriptor): the next wait."""
        self.streak = max(self.streak, 1)
        return self._next()

    def _next(self) -> float:
        wait = 0.0 if self.streak == 0 else RESTART_FIRST_S * 2.0 ** (self.streak - 1)
        self.streak = min(self.streak + 1, _STREAK_MAX)
        return min(wait, RESTART_CAP_S)


class Vacancy:
    """Whether any worker serves, over time: `since`, when the last one stopped serving."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None

    def seen(self, serving: bool, now: float) -> None:
        if serving:
            self.since = None
        elif self.since is None:
            self.since = now

    def empty_s(self, now: float, awake_since: float) -> float:
        """How long no worker has served while the parent ran (0: one serves)."""
        if self.since is None:
            return 0.0
        return max(0.0, now - max(self.since, awake_since))

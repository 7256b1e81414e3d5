"""Per-key limits that act now, not per day: requests at once, requests and tokens per minute.

Pure: the caller passes `now` (seconds; any clock that does not go back). A key's requests
count from their admission (the reservation taken, before any slot or upstream) to their
settlement:

- `max_concurrent`: the requests admitted and not settled (in flight plus queued) may not
  exceed it; the next is refused (`concurrent_requests`) until one settles.
- `requests_per_minute`, `tokens_per_minute`: a sliding window of the last 60 s over the
  key's admissions (not buckets: a burst at a minute's end and another at the next minute's
  start cannot both pass). A request is admitted when the requests admitted in the 60 s
  before it, and it, number at most `requests_per_minute`; and when their tokens, and its
  own, come to at most `tokens_per_minute`. A request's tokens are its reservation (the
  budgets' estimate, `policy.budget`) until it settles, then what it was charged, still
  counted at its admission time; a request no upstream served is charged nothing and leaves
  the window, as it leaves the day's budget. A refusal says when enough of the window will
  have left it (`resets_at`).

The check and the count happen in one synchronous step (`admit`), so N concurrent requests
against a limit of k admit exactly k in one process; with workers the parent admits every
keyed request (relay.workers), so the limits stay exact across them.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 60.0


class Admitted:
    """One admitted request, as the minute window holds it: when, and its tokens (reserved,
    then charged). `live` until it settles; `counts` unless it settled uncharged."""

    __slots__ = ("at", "counts", "live", "tokens")

    def __init__(self, at: float, tokens: int) -> None:
        self.at = at
        self.tokens = tokens
        self.live = True
        self.counts = True


class Refusal:
    """A limit a request met: its name, what the key holds of it already, what the request
    asked of it, the limit, and when it will have room (`resets_at`, on the caller's
    clock)."""

    __slots__ = ("limit", "limit_value", "requested", "resets_at", "used")

    def __init__(
        self, limit: str, used: int, requested: int, limit_value: int, resets_at: float
    ) -> None:
        self.limit = limit
        self.used = used
        self.requested = requested
        self.limit_value = limit_value
        self.resets_at = resets_at


# When a refusal for requests at once is retried: no settlement time can be known.
CONCURRENT_RETRY_S = 1.0


class KeyLimits:
    """One key's limits that act now (0: no limit) and what it holds of them."""

    __slots__ = (
        "events",
        "live",
        "max_concurrent",
        "rpm",
        "tpm",
        "window_requests",
        "window_tokens",
    )

    def __init__(self, max_concurrent: int = 0, rpm: int = 0, tpm: int = 0) -> None:
        self.max_concurrent = max_concurrent
        self.rpm = rpm
        self.tpm = tpm
        # Requests admitted and not settled.
        self.live = 0
        # The admissions of the last WINDOW_S (oldest first), those that count, and their
        # tokens summed.
        self.events: deque[Admitted] = deque()
        self.window_requests = 0
        self.window_tokens = 0

    @property
    def limits(self) -> bool:
        return bool(self.max_concurrent or self.rpm or self.tpm)

    def set(self, max_concurrent: int, rpm: int, tpm: int) -> None:
        """New limits (a reload): what is held stays."""
        self.max_concurrent, self.rpm, self.tpm = max_concurrent, rpm, tpm

    def _prune(self, now: float) -> None:
        events = self.events
        edge = now - WINDOW_S
        while events and events[0].at <= edge:
            gone = events.popleft()
            self.window_tokens -= gone.tokens
            self.window_requests -= gone.counts

    def check(self, tokens: int, now: float) -> Refusal | None:
        """Whether a request reserving `tokens` may be admitted now (nothing changes)."""
        if self.max_concurrent and self.live + 1 > self.max_concurrent:
            return Refusal(
                "concurrent_requests",
                self.live,
                1,
                self.max_concurrent,
                now + CONCURRENT_RETRY_S,
            )
        if not (self.rpm or self.tpm):
            return None
        self._prune(now)
        if self.rpm and self.window_requests + 1 > self.rpm:
            return Refusal(
                "minute_requests",
                self.window_requests,
                1,
                self.rpm,
                self._requests_room_at(now),
            )
        if self.tpm and self.window_tokens + tokens > self.tpm:
            return Refusal(
                "minute_tokens",
                self.window_tokens,
                tokens,
                self.tpm,
                self._room_at(tokens, now),
            )
        return None

    def _requests_room_at(self, now: float) -> float:
        """When all but rpm - 1 of the counted requests have left the window."""
        over = self.window_requests - self.rpm + 1
        for e in self.events:
            over -= e.counts
            if over <= 0:
                return e.at + WINDOW_S
        return now + WINDOW_S

    def _room_at(self, tokens: int, now: float) -> float:
        """When the window's tokens plus `tokens` fit the limit (a request larger than the
        limit never fits: a window from now)."""
        if tokens > self.tpm:
            return now + WINDOW_S
        left = self.window_tokens
        for e in self.events:
            left -= e.tokens
            if left + tokens <= self.tpm:
                return e.at + WINDOW_S
        return now + WINDOW_S

    def admit(self, tokens: int, now: float) -> Admitted:
        """Count an admitted request (after `check` said it may be)."""
        self.live += 1
        event = Admitted(now, tokens)
        if self.rpm or self.tpm:
            self.events.append(event)
            self.window_requests += 1
            self.window_tokens += tokens
        return event

    def settle(self, event: Admitted, requests: int, tokens: int, now: float) -> None:
        """The request settled, charged `requests` (1 when an upstream served it, else 0)
        and `tokens` (once; later calls do nothing)."""
        if not event.live:
            return
        event.live = False
        self.live -= 1
        self._prune(now)
        if self.events and event.at > now - WINDOW_S and event.at >= self.events[0].at:
            # Still in the window: its reservation becomes what it was charged.
            self.window_tokens += tokens - event.tokens
            if not requests:
                self.window_requests -= 1
        event.tokens = tokens
        event.counts = bool(requests)

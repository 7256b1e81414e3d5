"""Per-key budgets over UTC calendar windows, reserved before a stream and settled after.

Pure: the caller passes `now` (unix seconds). A reservation takes one request and an estimate
of tokens; used + reserved may never exceed a limit, so N concurrent requests against a limit
of k admit exactly k (the check and the reservation happen in one synchronous step). The
limits that act now (requests at once, per minute: `policy.limits`) are checked and taken in
the same step, before the day and month windows.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TypedDict

from relay.config import KeyConfig
from relay.policy.limits import Admitted, KeyLimits, Refusal


class Period(enum.StrEnum):
    """The UTC calendar period of a budget window: its kind, as limits, figures and the
    stores name it (`daily_tokens`, `usage(...)["daily"]`)."""

    DAY = "daily"
    MONTH = "monthly"


class WindowUsage(TypedDict):
    """One window's figures (`Budgets.usage`): used, and reserved by requests in flight."""

    requests: int
    tokens: int
    reserved_requests: int
    reserved_tokens: int


def window_bounds(kind: str, now: float) -> tuple[float, float]:
    """[start, end) of the UTC day or month (`kind`: a Period) holding `now`."""
    t = datetime.fromtimestamp(now, UTC)
    if kind == Period.DAY:
        start = t.replace(hour=0, minute=0, second=0, microsecond=0)
        end = datetime.fromtimestamp(start.timestamp() + 86400, UTC)
    else:
        start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = (
            start.replace(year=start.year + 1, month=1)
            if start.month == 12
            else start.replace(month=start.month + 1)
        )
    return start.timestamp(), end.timestamp()


@dataclass
class _Window:
    """One key's window of one period: its limits (0: none), its bounds, the requests and
    tokens used and reserved in it, and the reload that created it (`born`, a
    `Budgets.generation`)."""

    kind: Period
    req_limit: int
    tok_limit: int
    start: float = 0.0
    end: float = 0.0
    used_req: int = 0
    used_tok: int = 0
    res_req: int = 0
    res_tok: int = 0
    born: int = 0

    def roll(self, now: float) -> None:
        """Move to the period holding `now`, used figures at zero; the reservations of
        requests in flight carry over."""
        if not self.start <= now < self.end:
            self.start, self.end = window_bounds(self.kind, now)
            self.used_req = self.used_tok = 0


class BudgetExceeded(Exception):
    """A reservation refused: the `limit` it met (`daily_tokens`, ...), what was used and
    reserved of it already (`used`), what this request would have reserved of it
    (`requested`: 1 request, or its token estimate), the limit's value, and when its window
    resets."""

    def __init__(
        self,
        limit: str,
        used: int,
        requested: int,
        limit_value: int,
        resets_at: float,
        now: float,
    ) -> None:
        what = "budget" if limit.startswith(("daily", "monthly")) else "limit"
        super().__init__(
            f"{limit} {what} exceeded: {used} used + {requested} requested > {limit_value}"
        )
        self.limit = limit
        self.used = used
        self.requested = requested
        self.limit_value = limit_value
        self.resets_at = resets_at
        self.retry_after = max(1, math.ceil(resets_at - now))

    def details(self) -> dict[str, str | int]:
        """The refusal's `details` as answered to the client (`resets_at` in ISO 8601)."""
        iso = datetime.fromtimestamp(self.resets_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "limit": self.limit,
            "used": self.used,
            "requested": self.requested,
            "limit_value": self.limit_value,
            "resets_at": iso,
        }

    @classmethod
    def of(cls, refusal: Refusal, now: float) -> BudgetExceeded:
        """A limit that acts now, refused (`policy.limits`)."""
        return cls(
            refusal.limit,
            refusal.used,
            refusal.requested,
            refusal.limit_value,
            refusal.resets_at,
            now,
        )


@dataclass
class Reservation:
    """What one request holds of its key's windows. `empty`: it holds nothing (any more,
    or from the start when no window applied); `windows`: those it holds, kept here since a
    reload may replace a key's list, with the start of each when it was taken (`starts`);
    `gen`: `Budgets.generation` then; `spent`: `Budgets.spend` ran."""

    key_id: str
    tokens: int
    empty: bool = False
    starts: tuple[float, ...] = ()
    windows: tuple[_Window, ...] = ()
    gen: int = 0
    admitted_at: float = 0.0
    spent: bool = False
    # The limits that act now it counts in, and its place in them (`policy.limits`).
    now: KeyLimits | None = None
    event: Admitted | None = None


@dataclass
class _KeyBudget:
    windows: list[_Window] = field(default_factory=list)
    now: KeyLimits = field(default_factory=KeyLimits)

    @property
    def limited(self) -> bool:
        """Whether any limit applies (a request of the key is then admitted and held)."""
        return bool(self.windows) or self.now.limits


def _limits(k: KeyConfig) -> list[tuple[Period, int, int]]:
    """The key's (period, request limit, token limit) of each period it limits."""
    return [
        (kind, r, t)
        for kind, r, t in (
            (Period.DAY, k.requests_per_day, k.tokens_per_day),
            (Period.MONTH, k.requests_per_month, k.tokens_per_month),
        )
        if r or t
    ]


def _now_limits(k: KeyConfig) -> KeyLimits:
    return KeyLimits(k.max_concurrent, k.requests_per_minute, k.tokens_per_minute)


class Budgets:
    """Every key's windows. `generation` counts the reloads, so the windows a later one
    creates are told apart; `_late` holds what settled since `stage`."""

    def __init__(self, keys: list[KeyConfig]) -> None:
        self.generation = 0
        self._late: list[tuple[Reservation, int, int]] | None = None
        self.keys: dict[str, _KeyBudget] = {
            k.id: _KeyBudget([_Window(kind, r, t) for kind, r, t in _limits(k)], _now_limits(k))
            for k in keys
        }

    def stage(self) -> None:
        """A reload's new windows are to be rebuilt from the rows of the requests settled
        until now (read while the relay goes on): those settling from now until `reload`
        are kept, to be charged to the new windows then (their rows were not among those
        rows). `unstage`: the reload was refused."""
        self._late = []

    def unstage(self) -> None:
        """The reload `stage` prepared was refused: nothing is kept for it."""
        self._late = None

    def reload(
        self,
        keys: list[KeyConfig],
        rebuilt: dict[tuple[str, str], tuple[int, int]] | None = None,
        now: float = 0.0,
    ) -> list[tuple[str, str]]:
        """New keys and limits; a window kept across the reload keeps its used and reserved
        figures (only its limits change). Returns the (key, kind) windows that are new: their
        used figures are to be rebuilt from the rows (`rebuilt`, read at `stage`, or
        `restore`); requests in flight then are charged to them when they settle (their rows
        were not among those rows), and so are those settled since `stage`."""
        self.generation += 1
        fresh: list[tuple[str, str]] = []
        table: dict[str, _KeyBudget] = {}
        for k in keys:
            old = {w.kind: w for w in self.keys.get(k.id, _KeyBudget()).windows}
            ws = []
            for kind, r, t in _limits(k):
                w = old.get(kind)
                if w is None:
                    w = _Window(kind, r, t, born=self.generation)
                    fresh.append((k.id, kind))
                w.req_limit, w.tok_limit = r, t
                ws.append(w)
            limits = self.keys.get(k.id, _KeyBudget()).now
            limits.set(k.max_concurrent, k.requests_per_minute, k.tokens_per_minute)
            table[k.id] = _KeyBudget(ws, limits)
        self.keys = table
        for (key_id, named), (requests, tokens) in (rebuilt or {}).items():
            self.restore(key_id, named, requests, tokens, now)
        late, self._late = self._late or [], None
        for res, requests, tokens in late:
            self._charge_newer(res, requests, tokens, now, born=self.generation)
        return fresh

    def fresh_windows(self, keys: list[KeyConfig]) -> list[tuple[str, str]]:
        """The (key, kind) windows `reload(keys)` would create (nothing changes)."""
        return [
            (k.id, kind)
            for k in keys
            for kind, _, _ in _limits(k)
            if kind not in self.windows_of(k.id)
        ]

    def restore(self, key_id: str, kind: str, requests: int, tokens: int, now: float) -> None:
        """Set a window's used figures (rebuilt from the request rows after a restart)."""
        for w in self.keys[key_id].windows:
            if w.kind == kind:
                w.roll(now)
                w.used_req, w.used_tok = requests, tokens

    def windows_of(self, key_id: str) -> list[str]:
        """The periods (`Period`) the key's windows cover, in order."""
        return [w.kind for w in self.keys.get(key_id, _KeyBudget()).windows]

    def limits_tokens(self, key_id: str) -> bool:
        """Whether a token limit applies to the key (then no request may be unbounded)."""
        kb = self.keys.get(key_id, _KeyBudget())
        return any(w.tok_limit for w in kb.windows) or bool(kb.now.tpm)

    def limited(self, key_id: str) -> bool:
        """Whether any limit applies to the key."""
        kb = self.keys.get(key_id)
        return kb is not None and kb.limited

    def reserve(self, key_id: str, tokens: int, now: float) -> Reservation:
        """Check every limit and reserve in all of them, or raise BudgetExceeded."""
        kb = self.keys.get(key_id)
        if kb is None or not kb.limited:
            # No limits: nothing to hold (a reload adding some charges it when it settles).
            return Reservation(key_id, 0, empty=True, gen=self.generation, admitted_at=now)
        limits = kb.now
        refusal = limits.check(tokens, now) if limits.limits else None
        if refusal is not None:
            raise BudgetExceeded.of(refusal, now)
        for w in kb.windows:
            w.roll(now)
            if w.req_limit and w.used_req + w.res_req + 1 > w.req_limit:
                raise BudgetExceeded(
                    f"{w.kind}_requests", w.used_req + w.res_req, 1, w.req_limit, w.end, now
                )
            if w.tok_limit and w.used_tok + w.res_tok + tokens > w.tok_limit:
                raise BudgetExceeded(
                    f"{w.kind}_tokens", w.used_tok + w.res_tok, tokens, w.tok_limit, w.end, now
                )
        for w in kb.windows:
            w.res_req += 1
            w.res_tok += tokens
        return Reservation(
            key_id,
            tokens,
            starts=tuple(w.start for w in kb.windows),
            windows=tuple(kb.windows),
            gen=self.generation,
            admitted_at=now,
            now=limits if limits.limits else None,
            event=limits.admit(tokens, now) if limits.limits else None,
        )

    def spend(self, res: Reservation, requests: int, tokens: int, now: float) -> None:
        """Replace the reservation with what was used (once; later calls do nothing)."""
        if res.spent:
            return
        res.spent = True
        if res.now is not None and res.event is not None:
            res.now.settle(res.event, requests, tokens, now)
        if not res.empty:
            res.empty = True
            # Usage counts in the window the request was admitted in, as its row does (its
            # ts is the admission time).
            for w, start in zip(res.windows, res.starts):
                w.roll(now)
                w.res_req -= 1
                w.res_tok -= res.tokens
                if w.start == start:
                    w.used_req += requests
                    w.used_tok += tokens
        self._charge_newer(res, requests, tokens, now)
        if self._late is not None:
            self._late.append((res, requests, tokens))

    def _charge_newer(
        self, res: Reservation, requests: int, tokens: int, now: float, born: int | None = None
    ) -> None:
        """Windows a reload created after the request was admitted were rebuilt from the rows
        committed then, which did not hold this request's: it is charged to them now (in the
        window holding its admission time, as its row will count). `born`: only those of
        that reload."""
        kb = self.keys.get(res.key_id)
        if kb is None:
            return
        for w in kb.windows:
            if w.born > res.gen and born in (None, w.born):
                w.roll(now)
                if w.start <= res.admitted_at < w.end:
                    w.used_req += requests
                    w.used_tok += tokens

    def usage(self, key_id: str, now: float) -> dict[str, WindowUsage]:
        """The key's figures now, by period."""
        out: dict[str, WindowUsage] = {}
        for w in self.keys.get(key_id, _KeyBudget()).windows:
            w.roll(now)
            out[w.kind] = {
                "requests": w.used_req,
                "tokens": w.used_tok,
                "reserved_requests": w.res_req,
                "reserved_tokens": w.res_tok,
            }
        return out

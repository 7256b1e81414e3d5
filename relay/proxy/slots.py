"""Slots: `parallel` per upstream, and the queues of the pools that share them.

An upstream's `SlotPool` counts the requests it holds (`in_flight`, at most `parallel`). A
request asks the relay's `Board` for a slot of one of its pool's members (`policy.routing`:
the upstreams listing its model, one or more). It takes a free one at once, the member chosen
by `policy.affinity.choose` when more than one has room, or it waits in its pool's queue,
bounded by the members' `queue` summed. A request whose conversation lives on a busy member
within the load bound waits for that member, even while another has room, for at most
`home_wait_s` from its arrival (`policy.affinity.waits_for_home`; "auto": twice what the
move's re-read would take at the pool's pace, `policy.affinity.home_wait`); its hold over, it
takes any member's slot. A slot is held until the client has drained the
response or gone; `Slot.release` gives it back exactly once however many exit paths call it,
and a freed slot passes straight to a waiting request (`policy.affinity.pick_waiting`: the
oldest whose conversation lives on that member, unless the oldest overall has waited
`affinity_wait_s`), so a pool of one upstream is served first come, first served.

A served answer's figures (`Reuse`) teach the board's prefix table where each conversation's
prompt is cached and how long it is (`policy.affinity.learn`), and its pool's prefill pace
(`policy.affinity.Pace`); a member found down is forgotten whole. A member
that is down hands no freed slot to a waiting request: its slots wait for it to come back
(`kick`), or for the request's other members.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from relay.config import BalanceConfig, KeyConfig
from relay.observe.metrics import Registry
from relay.policy.affinity import (
    NO_WANT,
    Learnt,
    Member,
    Pace,
    PrefixTable,
    Reuse,
    Waiting,
    Want,
    Why,
    choose,
    home_wait,
    learn,
    pick_waiting,
    waits_for_home,
)
from relay.policy.fair import Line as FairLine
from relay.policy.fair import activated, charged, pick_line
from relay.policy.routing import Pool
from relay.store.admissions import AdmissionId

# The aging bound of slots that belong to no board (`SlotPool.acquire` alone).
AGING_S = BalanceConfig().aging_s


class Busy(Exception):
    """No slot: the queue is full, or none came free within the wait bound (`position`: the
    request's place among its key's waiting requests when it was queued; 0: not queued)."""

    def __init__(self, reason: str, position: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.position = position


class SlotsClosed(Exception):
    """The relay is shutting down: no slot will be handed out any more."""


class SlotLease(Protocol):
    """One slot held by a request: on `member`; `release` gives it back, at most once however
    often it is called, with what the member's answer said of its prompt cache when it
    served."""

    @property
    def member(self) -> str: ...

    @property
    def position(self) -> int: ...

    def release(self, reuse: Reuse | None = None) -> None: ...


class Slots(Protocol):
    """An upstream's slots as its gauges and a reload see them: the process's own
    `SlotPool`, or in a worker process its share of the parent's (relay.workers)."""

    @property
    def in_flight(self) -> int: ...

    @property
    def queued(self) -> int: ...

    def close(self) -> None: ...

    def resize(self, parallel: int, queue: int) -> None: ...


class Balancer(Protocol):
    """Where the proxy takes its slots: the process's own `Board`, or in a worker process
    the parent's, through the worker's link (relay.workers)."""

    async def acquire(
        self,
        pool: Pool,
        want: Want,
        timeout: float,
        exclude: frozenset[str] = frozenset(),
        admission: AdmissionId | None = None,
        key: str | None = None,
    ) -> SlotLease:
        """A slot of one of `pool`'s members but `exclude` within `timeout` (Busy,
        SlotsClosed), in the line of `key` (`policy.fair`). `admission`: the request's
        admission record, by which a worker finds the slot asked for with it."""
        ...

    def ahead(self, admission: AdmissionId, pool: Pool, want: Want, key: str | None = None) -> None:
        """The slot a keyed request will ask for once admitted (a worker asks for both in one
        message); nothing to do in one process."""
        ...


class Usable(Protocol):
    """What the slots read of an upstream's health: whether a freed slot may go to a waiting
    request."""

    def usable(self) -> bool: ...


class Slot:
    __slots__ = ("board", "fingerprint", "key", "pool", "position", "released", "slots", "units")

    def __init__(
        self, slots: SlotPool, board: Board | None = None, fingerprint: tuple[int, ...] = (),
        units: int = 0, key: str | None = None, position: int = 0, pool: str = "",
    ) -> None:  # fmt: skip
        self.slots = slots
        # The pool it was taken for (its figures count there).
        self.pool = pool
        self.board = board
        self.fingerprint = fingerprint
        # The prefix units the member was believed to hold when it was chosen.
        self.units = units
        self.key = key
        # Its place among its key's waiting requests when it was queued (0: not queued).
        self.position = position
        self.released = False
        if board is not None and key is not None:
            board.held_by_key[key] = board.held_by_key.get(key, 0) + 1

    @property
    def member(self) -> str:
        return self.slots.name

    def release(self, reuse: Reuse | None = None) -> None:
        if not self.released:
            self.released = True
            board = self.board
            if board is not None:
                if reuse is not None and self.fingerprint:
                    board.learnt(self, reuse)
                if self.key is not None:
                    board.held_by_key[self.key] -= 1
            self.slots._free()


class _Waiter:
    """A request in a pool's queue, in its key's line. `counted`: the member whose `waiting`
    counts it (the one its conversation lives on, or its only member); `shown`, for a request
    that waits for no member in particular, the member whose `queued` counts it instead: the
    one with the most room left in its `queue` when it came."""

    __slots__ = (
        "at",
        "counted",
        "exclude",
        "fut",
        "gone",
        "home_until",
        "line",
        "passed_at",
        "position",
        "preferred",
        "shown",
    )

    def __init__(
        self, line: _Line, fut: asyncio.Future[SlotPool], exclude: frozenset[str],
        preferred: SlotPool | None, counted: SlotPool | None, at: float, home_until: float = 0.0,
        shown: SlotPool | None = None,
    ) -> None:  # fmt: skip
        self.line = line
        self.fut = fut
        self.exclude = exclude
        self.preferred = preferred
        self.counted = counted
        self.shown = shown
        self.at = at
        # Until then it takes a slot of its preferred member only (`policy.affinity`'s
        # `waits_for_home`).
        self.home_until = home_until
        self.position = line.live + 1
        # When a younger request of its line first took a freed slot before it (affinity).
        self.passed_at: float | None = None
        self.gone = False

    def takes(self, member: SlotPool, now: float) -> bool:
        """Whether a freed slot of `member` may go to it now."""
        if member.name in self.exclude:
            return False
        return self.home_until <= now or self.preferred is member


class _Line:
    """One key's waiting requests in one pool's queue (`policy.fair`): in arrival order, and
    by the member each prefers; its class, weight, and virtual start and finish. Entries that
    left are skipped where they are met (and dropped whole when none is left)."""

    __slots__ = (
        "finish",
        "key",
        "live",
        "order",
        "preferring",
        "queue",
        "rank",
        "start",
        "turn_at",
        "weight",
    )

    def __init__(self, queue: _Queue, key: str | None, rank: int, weight: int) -> None:
        self.queue = queue
        self.key = key
        self.rank = rank
        self.weight = weight
        self.order: deque[_Waiter] = deque()
        self.preferring: dict[str, deque[_Waiter]] = {}
        self.live = 0
        self.start = 0.0
        self.finish = 0.0
        # When it last took a turn (the aging bound counts from the later of this and its
        # oldest request's arrival).
        self.turn_at = 0.0

    def oldest_for(self, member: SlotPool, now: float) -> _Waiter | None:
        order = self.order
        while order and order[0].gone:
            order.popleft()
        for w in order:
            if not w.gone and w.takes(member, now):
                return w
        return None

    def preferring_head(self, member: SlotPool) -> _Waiter | None:
        waiting = self.preferring.get(member.name)
        while waiting and waiting[0].gone:
            waiting.popleft()
        return waiting[0] if waiting else None


class _Queue:
    """One pool's waiting requests, one line per key, and the virtual time of its turns."""

    __slots__ = ("active", "lines", "live", "members", "name", "vtime")

    def __init__(self, name: str, members: tuple[SlotPool, ...]) -> None:
        self.name = name
        self.members = members
        self.lines: dict[str | None, _Line] = {}
        # The lines with requests waiting.
        self.active: dict[str | None, _Line] = {}
        self.live = 0
        self.vtime = 0.0

    @property
    def bound(self) -> int:
        return sum(m.queue for m in self.members)

    def line(self, key: str | None, rank: int, weight: int) -> _Line:
        line = self.lines.get(key)
        if line is None:
            line = self.lines[key] = _Line(self, key, rank, weight)
        line.rank, line.weight = rank, weight
        return line

    def add(self, w: _Waiter) -> None:
        line = w.line
        if not line.live:
            line.start = activated(line.finish, self.vtime)
            self.active[line.key] = line
        line.order.append(w)
        if w.preferred is not None:
            line.preferring.setdefault(w.preferred.name, deque()).append(w)
        if w.counted is not None:
            w.counted.waiting += 1
        elif w.shown is not None:
            w.shown.others += 1
        line.live += 1
        self.live += 1

    def leave(self, w: _Waiter) -> None:
        if w.gone:
            return
        w.gone = True
        if w.counted is not None:
            w.counted.waiting -= 1
        elif w.shown is not None:
            w.shown.others -= 1
        line = w.line
        line.live -= 1
        self.live -= 1
        if not line.live:
            line.order.clear()
            line.preferring.clear()
            del self.active[line.key]

    def served(self, line: _Line, now: float) -> None:
        """`line`'s turn is taken: a waiting request of it took a freed slot."""
        self.vtime = max(self.vtime, line.start)
        line.finish = charged(line.start, line.weight)
        line.start = line.finish
        line.turn_at = now

    def served_at_once(self, line: _Line, now: float) -> None:
        """A request of `line` took a free slot without waiting: a turn all the same, which
        moves the virtual time as a turn taken from the queue does (so no line banks turns
        while nobody waits)."""
        start = activated(line.finish, self.vtime)
        self.vtime = start
        line.finish = charged(start, line.weight)
        line.turn_at = now

    def fail_all(self, exc: BaseException) -> None:
        for line in list(self.active.values()):
            for w in list(line.order):
                if not w.gone:
                    self.leave(w)
                    if not w.fut.done():
                        w.fut.set_exception(exc)


class SlotPool:
    """One upstream's slots: `parallel` of them, `queue` requests waiting at most (summed
    over a pool's members), and the queues of the pools it serves."""

    def __init__(
        self, parallel: int, queue: int, name: str = "", health: Usable | None = None
    ) -> None:
        self.name = name
        self.parallel = parallel
        self.queue = queue
        self.in_flight = 0
        self.closed = False
        self.health = health
        # The waiting requests whose conversation lives on it (or whose only member it is),
        # and, of those that wait for no member in particular, the ones counted on it: its
        # `queued` is both, so that a pool's members' `queued` sum to its queue.
        self.waiting = 0
        self.others = 0
        # The queues of the pools it is a member of (a freed slot looks in each).
        self.queues: list[_Queue] = []
        self.board: Board | None = None
        self._alone: _Queue | None = None

    @property
    def queued(self) -> int:
        return self.waiting + self.others

    def usable(self) -> bool:
        return self.health is None or self.health.usable()

    def close(self) -> None:
        """No slot from now on: every waiter of its pools is told at once (the relay is
        draining)."""
        self.closed = True
        for q in self.queues:
            q.fail_all(SlotsClosed())

    def resize(self, parallel: int, queue: int) -> None:
        """New bounds (a config reload): waiters take slots that the new bound frees; held
        slots above a lower bound are simply not handed on when released."""
        self.parallel, self.queue = parallel, queue
        self.kick()

    def kick(self) -> None:
        """Free slots go to waiting requests (a new bound, a member back up)."""
        while self.in_flight < self.parallel and self.usable():
            w = _next_waiter(self)
            if w is None:
                return
            self.in_flight += 1
            w.fut.set_result(self)

    def _free(self) -> None:
        if self.in_flight <= self.parallel and self.usable():
            w = _next_waiter(self)
            if w is not None:
                # The slot moves on: in_flight is unchanged.
                w.fut.set_result(self)
                return
        self.in_flight -= 1

    async def acquire(self, timeout: float, admission: AdmissionId | None = None) -> Slot:
        """A slot of this upstream alone, within `timeout` (Busy, SlotsClosed): its own pool
        of one, as a `Board` gives it."""
        if self._alone is None:
            self._alone = _Queue(self.name, (self,))
            self.queues.append(self._alone)
        return await _take(self.board, self._alone, NO_WANT, timeout, frozenset())


def _next_waiter(member: SlotPool) -> _Waiter | None:
    """The waiting request a free slot of `member` goes to (it leaves its queue), or None:
    in each queue the member serves, the line whose turn it is (`policy.fair.pick_line`), and
    in it the oldest request or one whose conversation lives on the member
    (`policy.affinity.pick_waiting`); of several queues, the one whose line comes first."""
    board = member.board
    now = time.monotonic()
    aging = board.aging_s if board is not None else AGING_S
    best: tuple[_Queue, _Line, _Waiter] | None = None
    best_view: FairLine | None = None
    for q in member.queues:
        if not q.live:
            continue
        lines: list[_Line] = []
        views: list[FairLine] = []
        heads: list[_Waiter] = []
        for line in q.active.values():
            head = line.oldest_for(member, now)
            if head is not None:
                # Passed over while a higher class was served, it banked no turns.
                line.start = activated(line.start, q.vtime)
                lines.append(line)
                heads.append(head)
                views.append(FairLine(line.rank, line.start, head.at, max(head.at, line.turn_at)))
        i = pick_line(views, now, aging)
        if i is None:
            continue
        if best_view is not None and pick_line([best_view, views[i]], now, aging) == 0:
            continue
        best, best_view = (q, lines[i], heads[i]), views[i]
    if best is None:
        return None
    q, line, head = best
    w = _affine(line, head, member, now, board)
    q.leave(w)
    q.served(line, now)
    if board is not None:
        board.handed(w, q, member)
    return w


def _affine(
    line: _Line, head: _Waiter, member: SlotPool, now: float, board: Board | None
) -> _Waiter:
    """Within a line: its oldest request, or the oldest whose conversation lives on `member`
    unless the oldest has been passed over for the affinity bound already. The bound counts
    from the first time a younger request took a slot before it (not from its arrival: in a
    queue whose waits are seconds, every request would be past a fraction of a second, and
    no conversation would wait for its member)."""
    preferring = line.preferring_head(member)
    if preferring is None or preferring is head:
        return head
    bound = board.wait_bound if board is not None else 0.0
    since = now if head.passed_at is None else head.passed_at
    views = (Waiting(since, None), Waiting(preferring.at, member.name))
    if pick_waiting(views, member.name, now, bound) != 1:
        return head
    if head.passed_at is None:
        head.passed_at = now
    return preferring


def _hold_ended(q: _Queue, w: _Waiter) -> None:
    """A waiting request's hold for its conversation's member ran out: the members' free
    slots go to the waiting requests that may now take them, it among them."""
    if w.gone or w.fut.done():
        return
    # Over now, whatever the clock reads: a loop timer may fire a little early.
    w.home_until = 0.0
    for m in q.members:
        if m.in_flight < m.parallel and not m.closed:
            m.kick()


class Board:
    """The relay's slots: each upstream's `SlotPool` (by name, as `members` gives them), each
    pool's queue, and the prefix table that keeps a conversation on the member caching it.
    In a relay with workers, the parent's (relay.workers)."""

    def __init__(
        self,
        balance: BalanceConfig | None = None,
        members: Callable[[str], SlotPool | None] | None = None,
        keys: Sequence[KeyConfig] = (),
    ) -> None:
        balance = balance or BalanceConfig()
        self.table = PrefixTable(balance.prefix_entries)
        self.configure(balance, keys)
        self.members = members or (lambda _name: None)
        self._queues: dict[tuple[str, tuple[int, ...]], _Queue] = {}
        # Each pool's queue, as requests name it (cleared by a reload: `rebind`).
        self._by_pool: dict[Pool, _Queue] = {}
        # Per pool: decisions by why, answers that missed the prefix expected.
        self.routed: dict[str, dict[Why, int]] = {}
        self.missed: dict[str, int] = {}
        # Per key: the slots its requests hold.
        self.held_by_key: dict[str, int] = {}
        # Per pool: its members' prefill pace, from their answers (`home_wait_s = "auto"`).
        self.paces: dict[str, Pace] = {}

    def configure(self, balance: BalanceConfig, keys: Sequence[KeyConfig] = ()) -> None:
        """The `[balance]` settings and the keys' classes and weights (at start and at a
        reload); the table keeps what it knows."""
        self.affinity = balance.affinity
        self.epsilon = balance.epsilon
        self.wait_bound = balance.affinity_wait_s
        self.home_wait = balance.home_wait_s
        self.aging_s = balance.aging_s
        self.table.max_entries = balance.prefix_entries
        self.ranks = {k.id: (k.rank, k.weight) for k in keys}

    def adopt(self, slots: SlotPool) -> None:
        """An upstream's slots (at start, and each added by a reload) learn from this board."""
        slots.board = self

    def forget_member(self, name: str) -> None:
        """An upstream went down, or a reload removed it: it holds no prompt any more, and
        the requests holding for it take a slot of any member now."""
        self.table.forget_member(name)
        # Gathered first: a hold's end can hand out slots, and so change the lines.
        held = [
            (q, w)
            for q in self._queues.values()
            for line in q.active.values()
            for w in line.preferring.get(name, ())
            if w.home_until
        ]
        for q, w in held:
            _hold_ended(q, w)

    def queue(self, name: str, members: tuple[SlotPool, ...]) -> _Queue:
        """The queue of the pool `name` made of these members (the same objects: an upstream
        a reload replaced makes a new pool)."""
        key = (name, tuple(id(m) for m in members))
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = _Queue(name, members)
            for m in members:
                m.queues.append(q)
        return q

    def rebind(self) -> None:
        """The upstreams changed (a reload): pools are looked up again, and queues of members
        no longer current are dropped once no request waits in them."""
        self._by_pool.clear()
        for key, q in list(self._queues.items()):
            if q.live or all(self.members(m.name) is m for m in q.members):
                continue
            del self._queues[key]
            for m in q.members:
                if q in m.queues:
                    m.queues.remove(q)

    async def acquire(
        self,
        pool: Pool,
        want: Want,
        timeout: float,
        exclude: frozenset[str] = frozenset(),
        admission: AdmissionId | None = None,
        key: str | None = None,
    ) -> Slot:
        q = self._by_pool.get(pool)
        if q is None:
            members = []
            for name in pool.members:
                m = self.members(name)
                if m is None:
                    raise Busy(f"upstream {name} is gone (a reload removed it)")
                members.append(m)
            q = self._by_pool[pool] = self.queue(pool.name, tuple(members))
        return await _take(self, q, want, timeout, exclude, key)

    def ahead(self, admission: AdmissionId, pool: Pool, want: Want, key: str | None = None) -> None:
        pass

    def chosen(self, q: _Queue, eligible: Sequence[SlotPool], want: Want) -> tuple[SlotPool, int]:
        """The member with room a request takes at once (`policy.affinity.choose`), and the
        prefix units it is believed to hold."""
        fp = want.fingerprint if self.affinity else ()
        view = [Member(m.name, m.in_flight, m.parallel - m.in_flight) for m in eligible]
        names = {m.name for m in eligible}
        choice = choose(self.table, view, names, fp, want.first_key or 0, self.epsilon)
        assert choice is not None
        counts = self.routed.setdefault(q.name, {})
        counts[choice.why] = counts.get(choice.why, 0) + 1
        member = next(m for m in eligible if m.name == choice.member)
        return member, choice.reused_units

    def holds_for_home(self, eligible: Sequence[SlotPool], want: Want, pool: str) -> bool:
        """Whether a request of `pool` that could take a free slot now waits for the member
        its conversation lives on instead (`policy.affinity.waits_for_home`)."""
        return self._hold(eligible, want, pool) > 0

    def _hold(self, eligible: Sequence[SlotPool], want: Want, pool: str) -> float:
        """How long a request of `pool` waits for the member its conversation lives on (0:
        it does not): `home_wait_s`, or with "auto" `policy.affinity.home_wait` of the
        prefix that member holds at the pool's pace."""
        if not self.affinity or not want.fingerprint:
            return 0.0
        fixed = self.wait_bound
        found = self.table.longest_holder(want.fingerprint, [m.name for m in eligible])
        if found is None:
            return 0.0
        home = next(m for m in eligible if m.name == found[0])
        if home.in_flight < home.parallel or not home.usable():
            return 0.0
        view = [Member(m.name, m.in_flight + m.waiting, m.parallel - m.in_flight) for m in eligible]
        if not waits_for_home(view, home.name, self.epsilon):
            return 0.0
        if self.home_wait != "auto":
            return self.home_wait
        pace = self.paces.get(pool)
        if pace is None:
            return fixed
        return home_wait(self.table.tokens_at(want.fingerprint, found[1]), pace, fixed)

    def hold_until(
        self, eligible: Sequence[SlotPool], want: Want, now: float, timeout: float, pool: str
    ) -> float:
        """Until when a request of `pool` that waits takes only a slot of its conversation's
        member: for `_hold` from its arrival while that member is within the load bound,
        whether or not another member has room; 0 for one with no home, or whose home is
        over the bound, whom `policy.affinity.pick_waiting` orders. At most half of the
        request's own wait (`timeout`): the rest is for a slot of any member, so that a hold
        above the pool's timeout never turns a free slot into a 503."""
        hold = self._hold(eligible, want, pool)
        if hold <= 0:
            return 0.0
        return now + min(hold, timeout / 2)

    def preferred(self, eligible: Sequence[SlotPool], want: Want) -> SlotPool | None:
        """The member a waiting request's conversation lives on, if any."""
        if not self.affinity or not want.fingerprint:
            return None
        found = self.table.longest_holder(want.fingerprint, [m.name for m in eligible])
        if found is None:
            return None
        return next(m for m in eligible if m.name == found[0])

    def units_on(self, member: SlotPool, fingerprint: tuple[int, ...]) -> int:
        if not fingerprint:
            return 0
        found = self.table.longest_holder(fingerprint, (member.name,))
        return found[1] if found is not None else 0

    def handed(self, w: _Waiter, q: _Queue, member: SlotPool) -> None:
        """A waiting request takes a freed slot of `member`: counted as its pool's decision."""
        if len(q.members) > 1:
            why = Why.AFFINITY if w.preferred is member else Why.WAITED
            counts = self.routed.setdefault(q.name, {})
            counts[why] = counts.get(why, 0) + 1

    def rank_of(self, key: str | None) -> tuple[int, int]:
        """A key's priority class and weight (`[[key]]`); a request without a key: 0 and 1."""
        if key is None:
            return 0, 1
        return self.ranks.get(key, (0, 1))

    def waiting_by_key(self) -> dict[str, int]:
        """The requests of each key waiting in any queue."""
        out: dict[str, int] = {}
        for q in self._queues.values():
            for key, line in q.active.items():
                if key is not None:
                    out[key] = out.get(key, 0) + line.live
        return out

    def figures(self, registry: Registry, pools: list[Pool]) -> None:
        """The pools' live figures into `registry` (for the relay's own views): members, the
        requests waiting, the decisions and the misses."""
        waiting: dict[str, int] = {}
        for q in self._queues.values():
            waiting[q.name] = waiting.get(q.name, 0) + q.live
        for pool in pools:
            figures = registry.pool(pool.name)
            figures.members = pool.members
            figures.waiting = waiting.get(pool.name, 0)
            figures.routed = {str(why): n for why, n in self.routed.get(pool.name, {}).items()}
            figures.misses = self.missed.get(pool.name, 0)

    def learnt(self, slot: Slot, reuse: Reuse) -> None:
        """A served answer: what it says of the member's prompt cache (`policy.affinity`)."""
        if not self.affinity:
            return
        pace = self.paces.get(slot.pool)
        if pace is None:
            pace = self.paces[slot.pool] = Pace()
        pace.learn(reuse)
        if learn(self.table, slot.member, slot.fingerprint, slot.units, reuse) is Learnt.MISSED:
            self.missed[slot.pool] = self.missed.get(slot.pool, 0) + 1


def _rank(board: Board | None, key: str | None) -> tuple[int, int]:
    return board.rank_of(key) if board is not None else (0, 1)


def _free(
    board: Board | None, q: _Queue, want: Want, exclude: frozenset[str], timeout: float
) -> tuple[Sequence[SlotPool], SlotPool | None, int]:
    """The members a request may have, and the one with a free slot it takes now with the
    prefix units that member is believed to hold; None: it waits, for any free slot when
    every member was busy, or for its conversation's member (`Board.holds_for_home`) when
    `eligible` has a free slot."""
    members = q.members
    if len(members) == 1 and not exclude:
        # One upstream, the usual pool: no choice to make.
        only = members[0]
        if only.closed:
            raise SlotsClosed()
        return members, (only if only.in_flight < only.parallel else None), 0
    eligible = [m for m in members if m.name not in exclude]
    if any(m.closed for m in eligible):
        raise SlotsClosed()
    free = [m for m in eligible if m.in_flight < m.parallel]
    if not free:
        return eligible, None, 0
    if len(eligible) == 1 or board is None:
        return eligible, free[0], 0
    if timeout > 0 and q.live < q.bound and board.holds_for_home(eligible, want, q.name):
        return eligible, None, 0
    member, units = board.chosen(q, eligible, want)
    return eligible, member, units


async def _take(
    board: Board | None, q: _Queue, want: Want, timeout: float, exclude: frozenset[str],
    key: str | None = None,
) -> Slot:  # fmt: skip
    """A slot of one of `q`'s members but `exclude`: a free one at once (a turn of its key's
    line all the same), else a wait in the line of `key`."""
    eligible, member, units = _free(board, q, want, exclude, timeout)
    if member is not None:
        member.in_flight += 1
        if key is not None:
            # (Requests without a key share one line: no turns to count between them.)
            q.served_at_once(q.line(key, *_rank(board, key)), time.monotonic())
        return Slot(member, board, want.fingerprint, units, key, 0, q.name)
    line = q.line(key, *_rank(board, key))
    bound = q.bound
    if q.live >= bound or timeout <= 0 or not eligible:
        raise Busy("queue full" if bound else "no free slot")
    preferred = board.preferred(eligible, want) if board is not None else None
    counted = preferred or (eligible[0] if len(eligible) == 1 else None)
    shown = None if counted else max(eligible, key=lambda m: m.queue - m.queued)
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[SlotPool] = loop.create_future()
    now = time.monotonic()
    until = board.hold_until(eligible, want, now, timeout, q.name) if board is not None else 0.0
    w = _Waiter(line, fut, exclude, preferred, counted, now, until, shown)
    q.add(w)
    # Its hold ended, a slot some member kept free for another's home is its own.
    expiry = loop.call_later(until - now, _hold_ended, q, w) if until else None
    try:
        member = await asyncio.wait_for(asyncio.shield(fut), timeout)
    except TimeoutError:
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            # Granted just as the wait ran out.
            member = fut.result()
        else:
            fut.cancel()
            q.leave(w)
            raise Busy(f"no slot free within {timeout}s", w.position) from None
    except asyncio.CancelledError:
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            # Granted, but the caller is gone: it is passed on.
            fut.result()._free()
        else:
            fut.cancel()
            q.leave(w)
        raise
    finally:
        if expiry is not None:
            expiry.cancel()
    units = board.units_on(member, want.fingerprint) if board is not None else 0
    return Slot(member, board, want.fingerprint, units, key, w.position, q.name)

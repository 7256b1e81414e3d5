"""Where a request goes in a pool, and which waiting request a freed slot takes: pure rules.

A request's fingerprint is an ordered tuple of cumulative 64-bit hashes, one per prefix unit
(unit k's hash covers units 0..k), so two requests share a prefix of k units exactly when
their first k hashes are equal.

- `PrefixTable` maps a prefix hash to the members believed to hold it in their prompt
  cache. A served request records its member for every hash of its fingerprint, not only
  the last: the turns of one conversation share their hashes, so the table grows by the new
  units only, and a branch (an edited or regenerated turn) or a system prompt shared by many
  conversations is still found at the unit where it diverges. The holders of a hash are a
  bit mask over the members the table has seen; up to 8 members the masks are Python's
  cached small ints, so an entry costs its OrderedDict slot and link and its key. Measured
  with tracemalloc on CPython 3.11, 100 000 entries of random 64-bit keys: 105 bytes of
  table per entry, plus the key's int (sys.getsizeof 36, 40 as allocated) once the request
  that brought it is gone: about 145 bytes per entry, 14.5 MB at the default bound. The
  bound is an LRU over entries, least recently served first. A served turn's prompt length
  in tokens is kept at its last entry, while that entry is (about 85 bytes a turn).
- `choose` picks among the eligible members with a free slot: the member holding the longest
  prefix (the head and the first message at least: `SHORTEST_PREFIX`), unless taking the
  request would put it over the bounded-load capacity of Mirrokni, Thorup and
  Zadimoghaddam ("Consistent Hashing with Bounded Loads"):
  `ceil((1 + ε) × (total load + 1) / N)` over the N eligible members. Over it, the next
  longest holder within it; else the request is placed as a new conversation is: the least
  loaded member, ties broken by rendezvous (highest random weight) hashing of `first_key`
  with each member's name, with blake2b so that every relay and worker agrees.
- `prefix_was_there` reads an answer's reuse figures: the prefix was there unless the
  reported reuse is under half of what was expected (the tokens an earlier answer gave for
  that prefix, else the fingerprint's share of units).
- `pick_waiting`: a freed slot on member M goes to the oldest waiting request whose
  conversation lives on M, unless the oldest overall has waited `bound` seconds or more since
  its `enqueued_at`, in which case it goes first. The queue (`proxy.slots`) gives as the
  oldest's `enqueued_at` the time it was first passed over: a request is then never passed
  over for longer than `bound`, and affinity adds at most `bound` to any request's wait
  beyond FIFO order.
- `waits_for_home`: a request whose conversation lives on a member with no free slot waits
  for that member, within the load bound, rather than taking another member's free slot at
  once; the queue holds it for its home for at most `home_wait` seconds from its arrival,
  then it takes any member's slot.
- `home_wait`: how long that hold lasts, by default from what the move would cost. A turn that
  moves makes its new member read again the prefix its home holds: it waits that long on its
  own prefill, and the member is busy that long for the requests waiting behind it. So a
  request holds for its home for twice the prefill time of the prefix it would re-read
  (`HOLD_FACTOR`): the prefix's tokens (what the answer to the turn that left it there
  reported, `PrefixTable.tokens_at`) times the pool's pace (`Pace`, seconds of prefill per
  token, from llama-server's `timings.prompt_ms` over the tokens it processed). Where
  either is unknown, the fixed bound the caller gives.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections import OrderedDict
from collections.abc import Collection, Sequence

import msgspec

from relay.policy.prefix import fingerprint, first_key
from relay.stream.dialect import Api

DEFAULT_EPSILON = 0.25
DEFAULT_MAX_ENTRIES = 100_000
DEFAULT_WAIT_BOUND = 0.5
# A request holds for its home for this many times the prefill time of what a move re-reads.
HOLD_FACTOR = 2.0
# An answer teaches the pace only when it processed at least this many tokens: below that,
# fixed costs (the first token's decode, the connection) outweigh the prefill.
PACE_MIN_TOKENS = 64
# Each answer moves the pace this share of the way to its own (an exponential average).
PACE_WEIGHT = 0.2
# No prefill takes a second a token: a figure past it is no measurement (an upstream's
# timings are not trusted blindly).
PACE_MAX_S = 1.0
# Under this share of the expected reuse, an answer says the prefix was not in the cache.
DEFAULT_REUSE_RATIO = 0.5
# A prefix keeps a conversation on a member once it covers the head and the first message
# (what `first_key` covers). The head alone, the system prompt and tools every conversation of
# an agent shares, is held by whichever member served any of them: it would pull each new
# conversation there rather than to the least loaded, and relays whose tables saw it on other
# members would place one new conversation apart.
SHORTEST_PREFIX = 2
_MASK64 = (1 << 64) - 1
# A float product such as 1.1 × 10 is 11.000000000000002: the capacity's ceiling ignores
# what is left over below this.
_CEIL_SLACK = 1e-9


class Why(enum.StrEnum):
    """Why a member was chosen (for rows and metrics)."""

    # The member holding the longest prefix, within the load bound.
    AFFINITY = "affinity"
    # The longest holder was over the bound; a holder of a shorter prefix was not.
    SHORTER_PREFIX = "shorter_prefix"
    # Every holder was over the bound: placed as a new conversation.
    OVERLOADED_FALLBACK = "overloaded_fallback"
    # No eligible member with a free slot holds any prefix of the request.
    NEW = "new"
    # A waiting request took a freed slot of a member its conversation does not live on (or
    # it has none): the oldest, or the one waiting past the bound.
    WAITED = "waited"


class Want(msgspec.Struct, frozen=True, gc=False):
    """What a request asks of a pool: its fingerprint (`policy.prefix`) and the key a new
    conversation is placed by; empty for a pool of one member, or a body of no known shape."""

    fingerprint: tuple[int, ...] = ()
    first_key: int | None = None


NO_WANT = Want()


def want_of(api: Api, body: bytes) -> Want:
    """What a request body asks of a pool of several members: the fingerprint of what the
    model reads (`policy.prefix`), read from the JSON body whole; NO_WANT for a body that is
    no JSON (it goes where a new conversation goes)."""
    try:
        doc = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return NO_WANT
    fp = fingerprint(api, doc)
    return Want(fp, first_key(fp)) if fp else NO_WANT


class Reuse(msgspec.Struct, frozen=True, gc=False):
    """What a member's answer said of its prompt cache: the whole prompt and the part it
    reused, each None when the answer did not say. Given only for an answer that served (the
    member read the prompt)."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # llama-server's `timings.prompt_ms`: the time it took to read the part not reused.
    prompt_ms: float | None = None


class Learnt(enum.Enum):
    """What a served answer taught the table."""

    # The prefix expected was there, or nothing was expected, or the answer did not say.
    HELD = enum.auto()
    # The answer showed the expected prefix was not in the member's cache (it restarted,
    # evicted it, or another conversation took its slot).
    MISSED = enum.auto()


class Member(msgspec.Struct, frozen=True, gc=False):
    """One pool member as the proxy sees it now: its in-flight count and free slots."""

    name: str
    load: int
    free: int


class Choice(msgspec.Struct, frozen=True, gc=False):
    """The member chosen, why, and how many prefix units it is believed to hold (0 when
    none), which `prefix_was_there` later checks against the answer."""

    member: str
    why: Why
    reused_units: int


class Waiting(msgspec.Struct, frozen=True, gc=False):
    """A request in the pool's queue: when it was queued, and the member holding its
    conversation (None for a conversation seen nowhere)."""

    enqueued_at: float
    preferred: str | None


def capacity(total_load: int, members: int, eps: float) -> int:
    """The most requests one member may hold once this one is placed:
    ceil((1 + ε) × (total load + 1) / N)."""
    return math.ceil((1 + eps) * (total_load + 1) / members - _CEIL_SLACK)


def rendezvous_weight(first_key: int, name: str) -> int:
    """The stable weight of `name` for `first_key` (the highest weight wins a tie)."""
    data = (first_key & _MASK64).to_bytes(8, "big") + name.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _least_loaded(free: Sequence[Member], first_key: int) -> str:
    low = min(m.load for m in free)
    tied = [m.name for m in free if m.load == low]
    if len(tied) == 1:
        return tied[0]
    return max(tied, key=lambda name: (rendezvous_weight(first_key, name), name))


class PrefixTable:
    """Prefix hash -> members believed to hold it, bounded by an LRU over entries."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[int, int] = OrderedDict()
        # The prompt tokens an answer reported, at the last hash of its request's fingerprint
        # (while the table holds that hash): what a later turn found there would re-read.
        self._tokens: dict[int, int] = {}
        self._bits: dict[str, int] = {}
        self._names: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _bit(self, member: str) -> int:
        bit = self._bits.get(member)
        if bit is None:
            # The lowest bit no member holds, so that a removed member's bit is reused.
            index = 0
            while (1 << index) in self._names:
                index += 1
            bit = 1 << index
            self._bits[member] = bit
            self._names[bit] = member
        return bit

    def mask(self, members: Collection[str]) -> int:
        bits = self._bits
        out = 0
        for name in members:
            out |= bits.get(name, 0)
        return out

    def record(self, member: str, fingerprint: Sequence[int], tokens: int | None = None) -> None:
        """`member` served a request with this fingerprint: it now holds every prefix, the
        whole of it `tokens` long when the answer said."""
        bit = self._bit(member)
        entries = self._entries
        # Shortest first, so the longest prefix is the most recently used.
        for h in fingerprint:
            held = entries.get(h)
            if held is None:
                entries[h] = bit
            else:
                entries[h] = held | bit
                entries.move_to_end(h)
        if tokens is not None and tokens > 0 and fingerprint:
            self._tokens[fingerprint[-1]] = tokens
        while len(entries) > self.max_entries:
            gone, _held = entries.popitem(last=False)
            self._tokens.pop(gone, None)

    def tokens_at(self, fingerprint: Sequence[int], units: int) -> int | None:
        """The prompt tokens of the longest prefix of `fingerprint`, at most `units` long,
        that an answer reported (None: none did)."""
        tokens = self._tokens
        if not tokens:
            return None
        for k in range(min(units, len(fingerprint)) - 1, -1, -1):
            found = tokens.get(fingerprint[k])
            if found is not None:
                return found
        return None

    def holders(self, fingerprint: Sequence[int], among: int) -> list[tuple[int, int]]:
        """(prefix units, members' mask) for each length at which some member of the mask
        `among` first appears, longest first, from `SHORTEST_PREFIX` units on."""
        entries = self._entries
        out: list[tuple[int, int]] = []
        left = among
        shortest = min(SHORTEST_PREFIX, max(len(fingerprint), 1))
        for k in range(len(fingerprint) - 1, shortest - 2, -1):
            held = entries.get(fingerprint[k])
            if held is not None and held & left:
                out.append((k + 1, held & left))
                left &= ~held
                if not left:
                    break
        return out

    def longest_holder(
        self, fingerprint: Sequence[int], eligible: Collection[str]
    ) -> tuple[str, int] | None:
        """The member holding the longest prefix among `eligible`, and its length in units
        (several at one length: the first the table saw)."""
        found = self.holders(fingerprint, self.mask(eligible))
        if not found:
            return None
        units, mask = found[0]
        return self._names[mask & -mask], units

    def names(self, mask: int) -> list[str]:
        return [name for bit, name in self._names.items() if mask & bit]

    def forget(self, member: str, fingerprint: Sequence[int]) -> None:
        """`member` is no longer believed to hold any prefix of this fingerprint."""
        bit = self._bits.get(member)
        if bit is None:
            return
        entries = self._entries
        for h in fingerprint:
            held = entries.get(h)
            if held is not None and held & bit:
                if held == bit:
                    del entries[h]
                    self._tokens.pop(h, None)
                else:
                    entries[h] = held & ~bit

    def forget_member(self, member: str) -> None:
        """`member` restarted or left the pool: it holds nothing, and its bit is freed."""
        bit = self._bits.pop(member, None)
        if bit is None:
            return
        del self._names[bit]
        entries = self._entries
        # One pass over the table: a restart or a removal is rare.
        for h in [h for h, held in entries.items() if held & bit]:
            held = entries[h] & ~bit
            if held:
                entries[h] = held
            else:
                del entries[h]
                self._tokens.pop(h, None)


def choose(
    table: PrefixTable,
    members: Sequence[Member],
    eligible: Collection[str],
    fingerprint: Sequence[int],
    first_key: int,
    eps: float = DEFAULT_EPSILON,
) -> Choice | None:
    """The member to send this request to, or None when no eligible member has a free
    slot. The load bound counts the eligible members (a down member takes no share)."""
    pool = [m for m in members if m.name in eligible]
    free = [m for m in pool if m.free > 0]
    if not free:
        return None
    cap = capacity(sum(m.load for m in pool), len(pool), eps)
    by_name = {m.name: m for m in free}
    seen_over = False
    for units, mask in table.holders(fingerprint, table.mask(by_name)):
        fits = [by_name[n] for n in table.names(mask) if by_name[n].load + 1 <= cap]
        if fits:
            why = Why.SHORTER_PREFIX if seen_over else Why.AFFINITY
            return Choice(_least_loaded(fits, first_key), why, units)
        seen_over = True
    why = Why.OVERLOADED_FALLBACK if seen_over else Why.NEW
    return Choice(_least_loaded(free, first_key), why, 0)


def prefix_was_there(
    expected_units: int,
    fingerprint_units: int,
    cached_tokens: int,
    prompt_tokens: int,
    ratio: float = DEFAULT_REUSE_RATIO,
    expected_tokens: int | None = None,
) -> bool:
    """Whether an answer shows the expected prefix was in the member's cache.

    `prompt_tokens` is the whole prompt (llama-server's `timings.cache_n + prompt_n`,
    OpenAI's `usage.prompt_tokens`); `cached_tokens` is what it reused. Where an earlier
    answer said how long the expected prefix is (`expected_tokens`: the prompt of the turn
    that left it, `PrefixTable.tokens_at`), the prefix was there unless under `ratio` of
    that was reused. Else units stand in for tokens: the expected share of the prompt is
    `expected_units / fingerprint_units`, and the prefix was there unless the reported
    share `cached_tokens / prompt_tokens` is under `ratio` of it. (By shares alone, a turn
    that adds one long message, a tool's output, would read as a miss with all of its
    history reused.) Nothing expected, or no prompt reported, is no evidence: True.
    """
    if expected_units <= 0 or fingerprint_units <= 0 or prompt_tokens <= 0:
        return True
    if expected_tokens is not None and expected_tokens > 0:
        return cached_tokens >= ratio * min(expected_tokens, prompt_tokens)
    expected = min(expected_units, fingerprint_units) / fingerprint_units
    return cached_tokens / prompt_tokens >= ratio * expected


def learn(
    table: PrefixTable, member: str, fingerprint: Sequence[int], expected_units: int, reuse: Reuse
) -> Learnt:
    """A served answer of `member` to a request with this fingerprint, expected to find
    `expected_units` of it cached. An answer showing the prefix was not there forgets the
    member for that prefix (`MISSED`, counted per pool: what an operator watches when members
    restart or evict); the member then holds the whole prompt, which it just read, and is
    recorded for every unit of it. What makes a lasting difference is a member found down or
    gone: it is forgotten whole (`PrefixTable.forget_member`)."""
    learnt = Learnt.HELD
    prompt, cached = reuse.prompt_tokens, reuse.cached_tokens
    if prompt is not None and cached is not None:
        expected_tokens = table.tokens_at(fingerprint, expected_units)
        units = len(fingerprint)
        if not prefix_was_there(
            expected_units, units, cached, prompt, expected_tokens=expected_tokens
        ):
            table.forget(member, fingerprint)
            learnt = Learnt.MISSED
    if fingerprint:
        table.record(member, fingerprint, prompt)
    return learnt


def waits_for_home(members: Sequence[Member], home: str, eps: float = DEFAULT_EPSILON) -> bool:
    """Whether a request whose conversation lives on `home`, which has no free slot, waits
    for it (at most `home_wait`) rather than taking another member's free slot: it
    does unless the home's load, the requests it holds and those already waiting for it,
    would then be over the bounded-load capacity of the pool's load summed the same way.
    Moved, a turn makes its new member read the whole conversation again, which costs more
    than a short wait once a conversation is a few thousand tokens long; the bound keeps a
    busy home from holding a request while the pool has room."""
    pool = {m.name: m for m in members}
    at_home = pool.get(home)
    if at_home is None or at_home.free > 0:
        return False
    cap = capacity(sum(m.load for m in members), len(members), eps)
    return at_home.load + 1 <= cap


class Pace:
    """A pool's prefill pace, seconds per prompt token read, learnt from its answers' own
    timings (an exponential average); None until an answer said."""

    __slots__ = ("per_token",)

    def __init__(self) -> None:
        self.per_token: float | None = None

    def learn(self, reuse: Reuse) -> None:
        prompt, ms = reuse.prompt_tokens, reuse.prompt_ms
        if prompt is None or ms is None or ms <= 0:
            return
        processed = prompt - (reuse.cached_tokens or 0)
        if processed < PACE_MIN_TOKENS:
            return
        seen = ms / 1000 / processed
        if not seen <= PACE_MAX_S:
            return
        last = self.per_token
        self.per_token = seen if last is None else last + PACE_WEIGHT * (seen - last)


def home_wait(tokens: int | None, pace: Pace, fixed: float) -> float:
    """How long a request holds for its home: `HOLD_FACTOR` times the prefill time of the
    `tokens` a move would re-read at the pool's pace; `fixed` where either is unknown."""
    if tokens is None or pace.per_token is None:
        return fixed
    return HOLD_FACTOR * tokens * pace.per_token


def pick_waiting(
    queue: Sequence[Waiting], member: str, now: float, bound: float = DEFAULT_WAIT_BOUND
) -> int | None:
    """The index in `queue` (oldest first) of the request a freed slot on `member` takes:
    the oldest overall once it has waited `bound` seconds or more, else the oldest whose
    conversation lives on `member`, else the oldest. None when the queue is empty."""
    if not queue:
        return None
    if now - queue[0].enqueued_at >= bound:
        return 0
    for i, waiting in enumerate(queue):
        if waiting.preferred == member:
            return i
    return 0

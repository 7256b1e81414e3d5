"""relay/proxy/slots.py's Board without sockets: a pool's members, its one queue, where a
request goes and which waiting request a freed slot takes."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from relay.config import BalanceConfig, KeyConfig
from relay.observe.metrics import Registry
from relay.policy.affinity import NO_WANT, Reuse, Want, Why
from relay.policy.prefix import fingerprint, first_key
from relay.policy.routing import Pool
from relay.proxy.slots import Board, Busy, Slot, SlotPool, SlotsClosed
from relay.stream.dialect import Api


class Health:
    def __init__(self) -> None:
        self.up = True

    def usable(self) -> bool:
        return self.up


def board_of(*specs: tuple[str, int, int], **balance: object) -> tuple[Board, dict[str, SlotPool]]:
    members: dict[str, SlotPool] = {}
    board = Board(BalanceConfig(**balance), members.get)  # type: ignore[arg-type]
    for name, parallel, queue in specs:
        slots = members[name] = SlotPool(parallel, queue, name, Health())
        board.adopt(slots)
    return board, members


def conversation(*turns: str, system: str = "You are terse.") -> Want:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    fp = fingerprint(Api.CHAT, {"messages": messages})
    return Want(fp, first_key(fp))


POOL = Pool("tiny", ("a", "b"))


async def home_a_busy(**balance: object) -> tuple[Board, dict[str, SlotPool], Slot]:
    """Members a and b of one slot each (`home_wait_s` 30 s unless `balance` says), the
    conversation "lives on a" recorded on a, and a turn of it holding a's slot."""
    board, m = board_of(("a", 1, 8), ("b", 1, 8), **{"home_wait_s": 30.0, **balance})
    board.table.record("a", conversation("lives on a").fingerprint)
    turn = await board.acquire(POOL, conversation("lives on a", "x", "y"), 1.0)
    assert turn.member == "a"
    return board, m, turn


async def test_a_follow_up_turn_goes_where_its_prefix_is_cached():
    board, m = board_of(("a", 2, 8), ("b", 2, 8))
    first = conversation("hello")
    slot = await board.acquire(POOL, first, 1.0)
    home = slot.member
    slot.release(Reuse(100, 0))
    # The other member is idle, this one too: the follow-up goes home all the same.
    again = await board.acquire(POOL, conversation("hello", "hi", "more"), 1.0)
    assert again.member == home
    assert board.routed["tiny"]
    again.release(Reuse(150, 100))
    assert m["a"].in_flight == m["b"].in_flight == 0


async def test_new_conversations_spread_and_each_keeps_its_member():
    board, _m = board_of(("a", 4, 8), ("b", 4, 8))
    homes = {}
    held = []
    for i in range(4):
        s = await board.acquire(POOL, conversation(f"question {i}"), 1.0)
        homes[i] = s.member
        held.append(s)
    # The least loaded each time: two each.
    assert sorted(homes.values()) == ["a", "a", "b", "b"]
    for s in held:
        s.release(Reuse(50, 0))
    for i in range(4):
        s = await board.acquire(POOL, conversation(f"question {i}", "answer", "next"), 1.0)
        assert s.member == homes[i]
        s.release(Reuse(80, 50))


async def test_the_load_bound_sends_a_conversation_away_from_a_busy_home():
    board, _m = board_of(("a", 8, 8), ("b", 8, 8), epsilon=0.0)
    c = conversation("hot")
    s = await board.acquire(POOL, c, 1.0)
    home = s.member
    s.release(Reuse(10, 0))
    # Three of its turns at once: the home takes its share, the load bound sends one away.
    held = [await board.acquire(POOL, conversation("hot", "x", str(i)), 1.0) for i in range(3)]
    members = [h.member for h in held]
    assert members.count(home) == 2 and len(set(members)) == 2
    for h in held:
        h.release()


async def test_without_affinity_the_least_loaded_member_is_chosen():
    board, _m = board_of(("a", 4, 8), ("b", 4, 8), affinity=False)
    c = conversation("hello")
    s1 = await board.acquire(POOL, c, 1.0)
    s1.release(Reuse(10, 0))
    hold = await board.acquire(POOL, conversation("other"), 1.0)
    follow = await board.acquire(POOL, conversation("hello", "hi", "again"), 1.0)
    # Not sent home: the member the other conversation does not load.
    assert follow.member != hold.member
    hold.release()
    follow.release()


async def test_a_full_pool_queues_in_one_queue_bounded_by_the_members_queues():
    board, m = board_of(("a", 1, 1), ("b", 1, 2))
    held = [await board.acquire(POOL, NO_WANT, 1.0) for _ in range(2)]
    waiting = [asyncio.create_task(board.acquire(POOL, NO_WANT, 5.0)) for _ in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(Busy, match="queue full"):
        await board.acquire(POOL, NO_WANT, 5.0)
    # Each freed slot passes to the oldest waiter, on whichever member freed.
    held[1].release()
    got = await asyncio.wait_for(waiting[0], 1)
    assert got.member == held[1].member
    held[0].release()
    assert (await asyncio.wait_for(waiting[1], 1)).member == held[0].member
    for t in waiting[2:]:
        t.cancel()
    await asyncio.gather(*waiting[2:], return_exceptions=True)
    assert m["a"].in_flight + m["b"].in_flight == 2
    assert m["a"].queued == m["b"].queued == 0


async def test_a_freed_slot_prefers_a_waiter_whose_conversation_lives_there_until_the_bound():
    board, m = board_of(("a", 1, 8), ("b", 1, 8), affinity_wait_s=30.0)
    s = await board.acquire(POOL, conversation("lives here"), 1.0)
    home = s.member
    other = "b" if home == "a" else "a"
    s.release(Reuse(10, 0))
    at_home = await board.acquire(POOL, conversation("lives here", "x", "y"), 1.0)
    elsewhere = await board.acquire(POOL, NO_WANT, 1.0)
    assert (at_home.member, elsewhere.member) == (home, other)
    stranger = conversation("a stranger", system="Another prompt.")
    older = asyncio.create_task(board.acquire(POOL, stranger, 5.0))
    await asyncio.sleep(0)
    newer = asyncio.create_task(board.acquire(POOL, conversation("lives here", "x", "z"), 5.0))
    await asyncio.sleep(0)
    # The one whose conversation lives at home is counted there; the stranger, waiting for
    # any member, on the one with the most room left in its queue (both alike: the first,
    # a). The members' counts sum to the queue.
    assert (m[home].queued, m[other].queued) == (1 + (home == "a"), int(other == "a"))
    assert (m[home].waiting, m[other].waiting) == (1, 0)
    # Home frees: the newer waiter's conversation lives there, it goes first.
    at_home.release()
    assert (await asyncio.wait_for(newer, 1)).member == home
    assert not older.done()
    elsewhere.release()
    assert (await asyncio.wait_for(older, 1)).member == other


async def test_a_waiter_past_the_bound_is_never_passed_over():
    board, _m = board_of(("a", 1, 8), ("b", 1, 8), affinity_wait_s=0.0)
    on_a = conversation("lives on a")
    s = await board.acquire(POOL, on_a, 1.0)
    home = s.member
    s.release(Reuse(10, 0))
    held = [await board.acquire(POOL, NO_WANT, 1.0) for _ in range(2)]
    older = asyncio.create_task(board.acquire(POOL, NO_WANT, 5.0))
    await asyncio.sleep(0)
    newer = asyncio.create_task(board.acquire(POOL, conversation("lives on a", "x", "y"), 5.0))
    await asyncio.sleep(0)
    next(h for h in held if h.member == home).release()
    # A bound of 0: the oldest has waited long enough.
    assert (await asyncio.wait_for(older, 1)).member == home
    assert not newer.done()
    newer.cancel()
    await asyncio.gather(newer, return_exceptions=True)


async def test_the_bound_counts_from_the_first_time_a_request_is_passed_over():
    """A queue whose waits are long: the oldest has waited past the bound but was never passed
    over, so the first freed slot of a member still goes to the one whose conversation lives
    there; from then on the oldest waits at most the bound."""
    board, _m = board_of(("a", 1, 8), ("b", 1, 8), affinity_wait_s=0.2)
    s = await board.acquire(POOL, conversation("lives here"), 1.0)
    home = s.member
    s.release(Reuse(10, 0))
    held = [await board.acquire(POOL, NO_WANT, 1.0) for _ in range(2)]
    older = asyncio.create_task(board.acquire(POOL, NO_WANT, 5.0))
    await asyncio.sleep(0)
    homed = [
        asyncio.create_task(board.acquire(POOL, conversation("lives here", "x", str(i)), 5.0))
        for i in range(2)
    ]
    await asyncio.sleep(0.3)  # the oldest has waited past the bound, passed over by no one
    at_home = next(h for h in held if h.member == home)
    held.remove(at_home)
    at_home.release()
    first = await asyncio.wait_for(homed[0], 1)
    assert first.member == home and not older.done()
    # Passed over once: past the bound from then, the next freed slot is the oldest's.
    await asyncio.sleep(0.25)
    first.release()
    assert (await asyncio.wait_for(older, 1)).member == home and not homed[1].done()
    homed[1].cancel()
    await asyncio.gather(homed[1], return_exceptions=True)
    held[0].release()


async def _homed(board: Board, text: str) -> str:
    """A conversation served once: the member it now lives on."""
    s = await board.acquire(POOL, conversation(text), 1.0)
    s.release(Reuse(10, 0))
    return s.member


async def test_a_busy_home_is_waited_for_while_another_member_is_free():
    board, m = board_of(("a", 1, 8), ("b", 1, 8), home_wait_s=30.0)
    home = await _homed(board, "lives here")
    other = "b" if home == "a" else "a"
    turn = await board.acquire(POOL, conversation("lives here", "x", "y"), 1.0)
    assert turn.member == home
    # Its next turn finds its home busy and the other member free: it waits for home.
    follow = asyncio.create_task(board.acquire(POOL, conversation("lives here", "x", "z"), 5.0))
    await asyncio.sleep(0)
    assert not follow.done() and m[other].in_flight == 0 and m[home].queued == 1
    # A request of no conversation takes the free slot meanwhile.
    stranger = await board.acquire(POOL, NO_WANT, 1.0)
    assert stranger.member == other
    turn.release()
    assert (await asyncio.wait_for(follow, 1)).member == home
    assert board.routed["tiny"][Why.AFFINITY] >= 1
    stranger.release()


async def test_a_hold_for_home_ends_at_the_bound():
    bound = 0.2
    board, m = board_of(("a", 1, 8), ("b", 1, 8), home_wait_s=bound)
    home = await _homed(board, "lives here")
    other = "b" if home == "a" else "a"
    turn = await board.acquire(POOL, conversation("lives here", "x", "y"), 1.0)
    t0 = time.monotonic()
    follow = await asyncio.wait_for(
        board.acquire(POOL, conversation("lives here", "x", "z"), 5.0), 5
    )
    # The home never freed: once the bound ran out, the free member's slot was its own (a
    # loop timer fires up to its clock's step early: uvloop's is a millisecond).
    assert follow.member == other and time.monotonic() - t0 >= bound - 0.002
    assert m[home].queued == 0
    turn.release()
    follow.release()


async def test_an_auto_hold_lasts_twice_the_re_read_the_answers_measured():
    # The fixed bound says 30 s: with "auto" the answers' own figures set the hold instead.
    board, m = board_of(("a", 1, 8), ("b", 1, 8), affinity_wait_s=30.0)
    first = await board.acquire(POOL, conversation("lives here"), 1.0)
    home = first.member
    other = "b" if home == "a" else "a"
    assert (
        board.hold_until([m["a"], m["b"]], conversation("lives here", "x"), 0.0, 60.0, "tiny") == 0
    )
    # 1500 prompt tokens read in 150 ms: 0.1 ms a token; re-reading them elsewhere would
    # take 0.15 s, so a later turn holds for its home 0.3 s.
    first.release(Reuse(1500, 0, 150.0))
    turn = await board.acquire(POOL, conversation("lives here", "x", "y"), 1.0)
    assert turn.member == home
    follow = conversation("lives here", "x", "z")
    assert board.hold_until([m["a"], m["b"]], follow, 100.0, 60.0, "tiny") == pytest.approx(100.3)
    # At most half of the request's own wait, whatever the figures.
    assert board.hold_until([m["a"], m["b"]], follow, 100.0, 0.4, "tiny") == pytest.approx(100.2)
    t0 = time.monotonic()
    moved = await asyncio.wait_for(board.acquire(POOL, follow, 30.0), 10)
    assert moved.member == other and time.monotonic() - t0 >= 0.3 - 0.002
    # A number is a fixed hold, the figures aside.
    board.configure(BalanceConfig(home_wait_s=2.5))
    assert board.hold_until([m["a"], m["b"]], follow, 100.0, 60.0, "tiny") == pytest.approx(102.5)
    moved.release()
    turn.release()


async def test_a_hold_for_home_takes_at_most_half_of_the_requests_wait():
    # The bound (30 s) is above this request's wait (2 s): it holds for a for half of its
    # wait, then takes b's slot, free all along, instead of running out and being refused.
    board, m, turn = await home_a_busy()
    t0 = time.monotonic()
    follow = await asyncio.wait_for(
        board.acquire(POOL, conversation("lives on a", "x", "z"), 2.0), 10
    )
    waited = time.monotonic() - t0
    assert follow.member == "b"
    # The hold's own timer (a loop timer may fire up to a clock tick early).
    assert waited >= 1.0 - 0.05
    assert m["a"].in_flight == m["b"].in_flight == 1
    turn.release()
    follow.release()


async def test_a_home_over_the_load_bound_is_not_waited_for():
    # Home a has one slot, b four: with a's one held, a second there is over
    # ceil(1 x (1 + 1) / 2) = 1, so the follow-up takes b at once.
    board, _m = board_of(("a", 1, 8), ("b", 4, 8), epsilon=0.0, home_wait_s=30.0)
    board.table.record("a", conversation("lives on a").fingerprint)
    turn = await board.acquire(POOL, conversation("lives on a", "x", "y"), 1.0)
    assert turn.member == "a"
    follow = await asyncio.wait_for(
        board.acquire(POOL, conversation("lives on a", "x", "z"), 5.0), 1
    )
    assert follow.member == "b"
    turn.release()
    follow.release()


async def test_a_freed_slot_skips_a_request_held_for_another_home():
    board, m, on_a = await home_a_busy()
    # b has room: the follow-up is held for a.
    held = asyncio.create_task(board.acquire(POOL, conversation("lives on a", "x", "z"), 5.0))
    await asyncio.sleep(0)
    on_b = await board.acquire(POOL, NO_WANT, 1.0)
    stranger = asyncio.create_task(board.acquire(POOL, NO_WANT, 5.0))
    await asyncio.sleep(0)
    # b frees: the older request still waits for a, the younger one takes b.
    on_b.release()
    assert (await asyncio.wait_for(stranger, 1)).member == "b"
    assert not held.done()
    on_a.release()
    assert (await asyncio.wait_for(held, 1)).member == "a"
    assert m["a"].queued == m["b"].queued == 0


async def test_with_every_member_busy_a_request_still_waits_for_its_home():
    board, _m, on_a = await home_a_busy(epsilon=0.0)
    on_b = await board.acquire(POOL, NO_WANT, 1.0)
    # Held for a: a's load with it, 2, is within ceil(1 x (2 + 1) / 2) = 2.
    waiting = asyncio.create_task(board.acquire(POOL, conversation("lives on a", "x", "z"), 5.0))
    await asyncio.sleep(0)
    on_b.release()
    await asyncio.sleep(0)
    assert not waiting.done()
    on_a.release()
    assert (await asyncio.wait_for(waiting, 1)).member == "a"


async def test_with_every_member_busy_a_home_over_the_bound_is_not_waited_for():
    board, _m, on_a = await home_a_busy(epsilon=0.0)
    on_b = await board.acquire(POOL, NO_WANT, 1.0)
    first = asyncio.create_task(board.acquire(POOL, conversation("lives on a", "x", "z"), 5.0))
    await asyncio.sleep(0)
    # a holds one and has one waiting for it: 3 would be over ceil(1 x (3 + 1) / 2) = 2.
    second = asyncio.create_task(board.acquire(POOL, conversation("lives on a", "x", "w"), 5.0))
    await asyncio.sleep(0)
    on_b.release()
    assert (await asyncio.wait_for(second, 1)).member == "b"
    assert not first.done()
    on_a.release()
    assert (await asyncio.wait_for(first, 1)).member == "a"


async def test_an_excluded_member_is_neither_given_nor_waited_for():
    board, m = board_of(("a", 1, 8), ("b", 1, 8))
    s = await board.acquire(POOL, NO_WANT, 1.0, exclude=frozenset({"a"}))
    assert s.member == "b"
    waiting = asyncio.create_task(board.acquire(POOL, NO_WANT, 5.0, exclude=frozenset({"a"})))
    await asyncio.sleep(0)
    # a is free, but excluded: the waiter waits for b.
    assert not waiting.done() and m["a"].in_flight == 0
    s.release()
    assert (await asyncio.wait_for(waiting, 1)).member == "b"


async def test_a_hold_for_a_home_found_down_ends_at_once():
    board, m, turn = await home_a_busy()
    held = asyncio.create_task(board.acquire(POOL, conversation("lives on a", "x", "z"), 50.0))
    await asyncio.sleep(0)
    assert not held.done() and m["b"].in_flight == 0
    # What the App does when it finds a down (relay/app.py), as a reload that removes it.
    m["a"].health.up = False  # type: ignore[union-attr]
    board.forget_member("a")
    assert (await asyncio.wait_for(held, 1)).member == "b"
    turn.release()


async def test_a_down_member_hands_no_slot_on_until_it_is_back():
    board, m = board_of(("a", 1, 8), ("b", 1, 8))
    sa = await board.acquire(POOL, NO_WANT, 1.0)
    sb = await board.acquire(POOL, NO_WANT, 1.0)
    waiting = asyncio.create_task(board.acquire(POOL, NO_WANT, 5.0))
    await asyncio.sleep(0)
    down = m[sa.member]
    down.health.up = False  # type: ignore[union-attr]
    sa.release()
    await asyncio.sleep(0)
    assert not waiting.done() and down.in_flight == 0
    down.health.up = True  # type: ignore[union-attr]
    down.kick()
    assert (await asyncio.wait_for(waiting, 1)).member == down.name
    sb.release()


async def test_an_answer_that_missed_is_counted_and_a_member_down_is_forgotten():
    board, _m = board_of(("a", 2, 8), ("b", 2, 8))
    c = conversation("remember me")
    s = await board.acquire(POOL, c, 1.0)
    home = s.member
    s.release(Reuse(100, 0))
    s = await board.acquire(POOL, conversation("remember me", "ok", "next"), 1.0)
    assert s.member == home and s.units > 0
    # The member's answer: nothing of it was cached (it restarted).
    s.release(Reuse(200, 0))
    assert board.missed == {"tiny": 1}
    board.forget_member(home)
    assert board.table.longest_holder(c.fingerprint, [home]) is None


async def test_closing_tells_every_waiter_of_the_pool():
    board, m = board_of(("a", 1, 8), ("b", 1, 8))
    held = [await board.acquire(POOL, NO_WANT, 1.0) for _ in range(2)]
    waiting = asyncio.create_task(board.acquire(POOL, NO_WANT, 5.0))
    await asyncio.sleep(0)
    m["a"].close()
    with pytest.raises(SlotsClosed):
        await asyncio.wait_for(waiting, 1)
    with pytest.raises(SlotsClosed):
        await board.acquire(POOL, NO_WANT, 1.0)
    for h in held:
        h.release()


async def test_a_wait_that_runs_out_leaves_the_queue():
    board, m = board_of(("a", 1, 8), ("b", 1, 8))
    held = [await board.acquire(POOL, NO_WANT, 1.0) for _ in range(2)]
    with pytest.raises(Busy, match="within"):
        await board.acquire(POOL, conversation("late"), 0.01)
    registry = Registry()
    board.figures(registry, [POOL])
    assert registry.pools["tiny"].waiting == 0 and m["a"].queued == m["b"].queued == 0
    for h in held:
        h.release()
    assert m["a"].in_flight == m["b"].in_flight == 0


# ---- fair share between keys ----------------------------------------------------------------
def keyed_board(*keys: KeyConfig, aging_s: float = 60.0) -> tuple[Board, SlotPool]:
    members: dict[str, SlotPool] = {}
    board = Board(BalanceConfig(aging_s=aging_s), members.get, keys)
    slots = members["a"] = SlotPool(2, 1000, "a", Health())
    board.adopt(slots)
    return board, slots


def key(name: str, **kw: object) -> KeyConfig:
    return KeyConfig(id=name, sha256="0" * 64, **kw)  # type: ignore[arg-type]


ALONE = Pool("a", ("a",))


async def _drain_order(held: list, tasks: dict, turns: int) -> list[str]:
    """Release slots one at a time: the keys of the requests each freed slot goes to."""
    order = []
    pending = {t: name for name, ts in tasks.items() for t in ts}
    for _ in range(turns):
        held.pop(0).release()
        done, _ = await asyncio.wait(pending, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        (t,) = done
        order.append(pending.pop(t))
        held.append(t.result())
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return order


async def test_a_flood_of_one_key_does_not_hold_back_another():
    board, slots = keyed_board(key("batch"), key("person"))
    held = [await board.acquire(ALONE, NO_WANT, 5.0, key="batch") for _ in range(2)]
    flood = [
        asyncio.create_task(board.acquire(ALONE, NO_WANT, 30.0, key="batch")) for _ in range(50)
    ]
    await asyncio.sleep(0)
    person = [asyncio.create_task(board.acquire(ALONE, NO_WANT, 30.0, key="person"))]
    await asyncio.sleep(0)
    assert board.waiting_by_key() == {"batch": 50, "person": 1}
    # The first freed slot goes to the person, though 50 of the batch came before it.
    held.pop(0).release()
    got = await asyncio.wait_for(person[0], 1)
    assert got.position == 1 and not any(t.done() for t in flood)
    for t in flood:
        t.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    got.release()
    held[0].release()
    assert slots.in_flight == 0 and board.held_by_key == {"batch": 0, "person": 0}


async def test_two_keys_of_one_class_take_turns_and_weights_share():
    for weights, expect in (((1, 1), 1.0), ((2, 1), 2.0)):
        board, _ = keyed_board(key("x", weight=weights[0]), key("y", weight=weights[1]), key("z"))
        held = [await board.acquire(ALONE, NO_WANT, 5.0, key="z") for _ in range(2)]
        tasks = {
            n: [asyncio.create_task(board.acquire(ALONE, NO_WANT, 30.0, key=n)) for _ in range(30)]
            for n in ("x", "y")
        }
        await asyncio.sleep(0)
        order = await _drain_order(held, tasks, 24)
        assert order.count("x") / order.count("y") == pytest.approx(expect, rel=0.15)
        if expect == 1.0:
            # Strictly alternating once both wait.
            assert all(a != b for a, b in itertools.pairwise(order))


async def test_a_higher_class_goes_first_and_a_lower_one_ages_in():
    board, _ = keyed_board(key("chat", priority="high"), key("bulk", priority="low"), aging_s=0.2)
    held = [await board.acquire(ALONE, NO_WANT, 5.0, key="bulk") for _ in range(2)]
    bulk = asyncio.create_task(board.acquire(ALONE, NO_WANT, 30.0, key="bulk"))
    await asyncio.sleep(0)
    chat = asyncio.create_task(board.acquire(ALONE, NO_WANT, 30.0, key="chat"))
    await asyncio.sleep(0)
    held.pop(0).release()
    held.append(await asyncio.wait_for(chat, 1))
    assert not bulk.done()
    # Past the aging bound the low class takes turns with the high one: its turn, level
    # with a fresh high request's, goes to the older request; then the high one's.
    await asyncio.sleep(0.25)
    fresh = [asyncio.create_task(board.acquire(ALONE, NO_WANT, 30.0, key="chat")) for _ in range(2)]
    await asyncio.sleep(0)
    held.pop(0).release()
    aged = await asyncio.wait_for(bulk, 1)
    assert aged.key == "bulk" and not any(f.done() for f in fresh)
    held.pop(0).release()
    held.append(await asyncio.wait_for(fresh[0], 1))
    held.pop(0).release()
    held.append(await asyncio.wait_for(fresh[1], 1))
    aged.release()
    for h in held:
        h.release()

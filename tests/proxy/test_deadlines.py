"""relay/proxy/deadlines.py with a fake loop clock: many stall guards on one loop timer."""

from __future__ import annotations

import gc
import random
import weakref

from relay.proxy.deadlines import Deadlines, Due
from relay.stream.stall import StallPolicy
from tests.support.fake_loop import FakeLoop


class Call(Due):
    """A deadline's owner that calls `fn` when it fires."""

    __slots__ = ("__weakref__", "fn")

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def fire(self) -> None:
        self.fn()


def test_each_deadline_fires_at_its_own_time_in_order():
    loop = FakeLoop()
    d = Deadlines(loop)
    fired = []
    for when in (5.0, 1.0, 3.0, 2.5):
        d.add(when, Call(lambda w=when: fired.append((w, loop.now))))
    loop.run_until(10.0)
    assert fired == [(1.0, 1.0), (2.5, 2.5), (3.0, 3.0), (5.0, 5.0)]
    assert len(d) == 0


def test_one_loop_timer_for_many_deadlines():
    loop = FakeLoop()
    d = Deadlines(loop)
    for i in range(1000):
        d.add(100.0 + i, Call(lambda: None))
    assert len(loop.armed()) == 1 and loop.armed()[0].when == 100.0
    d.add(50.0, Call(lambda: None))  # an earlier one re-arms the single timer
    assert len(loop.armed()) == 1 and loop.armed()[0].when == 50.0


def test_cancelled_deadline_never_fires_and_the_heap_stays_bounded():
    loop = FakeLoop()
    d = Deadlines(loop)
    fired = []
    keep = Call(lambda: fired.append("kept"))
    d.add(1000.0, keep)
    for i in range(10000):  # a churn of short streams: each cancels its guard
        short = Call(lambda: fired.append("cancelled"))
        d.add(500.0 + i * 0.001, short)
        d.cancel(short)
    assert len(d._heap) <= len(d) * 3 // 2 + 65
    loop.run_until(2000.0)
    assert fired == ["kept"]
    d.cancel(keep)  # (cancelling a fired one is harmless)


def test_an_owner_has_one_deadline_a_new_one_replaces_it():
    loop = FakeLoop()
    d = Deadlines(loop)
    fired = []
    owner = Call(lambda: fired.append(loop.now))
    d.add(5.0, owner)
    d.add(2.0, owner)  # earlier
    d.add(3.0, owner)  # then later again
    assert len(d) == 1
    loop.run_until(10.0)
    assert fired == [3.0] and len(d) == 0 and owner.deadline is None


def test_a_cancelled_deadline_keeps_nothing_of_its_owner():
    """A stream that ends cancels its deadlines: the entries left in the heap until a rebuild
    must not keep the stream's objects alive meanwhile."""
    loop = FakeLoop()
    d = Deadlines(loop)
    owner = Call(lambda: None)
    gone = weakref.ref(owner)
    d.add(300.0, owner)
    d.cancel(owner)
    del owner
    gc.collect()
    assert gone() is None and len(d._heap) == 1 and len(d) == 0


def test_a_callback_adding_a_later_deadline_is_fired_later_not_now():
    loop = FakeLoop()
    d = Deadlines(loop)
    fired = []

    def again():
        fired.append(loop.now)
        if loop.now < 5.0:
            d.add(loop.now + 2.0, owner)

    owner = Call(again)
    d.add(1.0, owner)
    d.add(2.0, Call(lambda: fired.append(("other", loop.now))))
    loop.run_until(100.0)
    assert fired == [1.0, ("other", 2.0), 3.0, 5.0]


def test_an_earlier_deadline_left_after_a_firing_is_not_skipped():
    # a callback adds a deadline later than one already waiting: the waiting one still fires
    loop = FakeLoop()
    d = Deadlines(loop)
    fired = []
    d.add(1.0, Call(lambda: d.add(10.0, Call(lambda: fired.append(("late", loop.now))))))
    d.add(4.0, Call(lambda: fired.append(("waiting", loop.now))))
    loop.run_until(20.0)
    assert fired == [("waiting", 4.0), ("late", 10.0)]


def test_a_timer_firing_a_tick_early_still_fires_the_deadline():
    loop = FakeLoop()
    d = Deadlines(loop)
    fired = []
    d.add(1.0, Call(lambda: fired.append(loop.now)))
    loop.armed()[0].when = 0.9995  # uvloop rounds to whole ms
    loop.run_until(0.9995)
    assert fired == [0.9995]


def test_a_failing_callback_does_not_stop_the_others():
    loop = FakeLoop()
    d = Deadlines(loop)
    fired = []
    d.add(1.0, Call(lambda: 1 / 0))
    d.add(1.0, Call(lambda: fired.append(1)))
    d.add(2.0, Call(lambda: fired.append(2)))
    loop.run_until(3.0)
    assert fired == [1, 2] and len(loop.errors) == 1
    assert isinstance(loop.errors[0]["exception"], ZeroDivisionError)


class Guard(Due):
    """An exchange's stall guard as proxy.exchange arms it: lazily re-armed from the last
    read, tripped once `StallPolicy.due` says so."""

    def __init__(self, loop, d: Deadlines, policy: StallPolicy, reads: list[float]) -> None:
        super().__init__()
        self.loop, self.d, self.policy = loop, d, policy
        self.head_at = self.last_read = loop.now
        self.reads = reads  # loop times at which the upstream sends a byte
        self.tripped: tuple[str, float] | None = None
        self.arm()

    def arm(self) -> None:
        self.d.add(self.policy.next_check(self.head_at, self.last_read), self)

    def fire(self) -> None:
        now = self.loop.now
        self.last_read = max([self.last_read] + [r for r in self.reads if r <= now])
        reason = self.policy.due(now, self.head_at, self.last_read)
        if reason is None:
            self.arm()
        else:
            self.tripped = (reason, now)


def test_every_one_of_many_idle_streams_trips_on_time():
    """2000 streams, each going quiet at its own moment: each guard trips exactly idle_s after
    its last read (or total_s after its head), on one loop timer."""
    rnd = random.Random(15)
    loop = FakeLoop()
    d = Deadlines(loop)
    policy = StallPolicy(idle_s=30.0, total_s=600.0, read_s=0.0)
    guards = []
    for i in range(2000):
        # (times in 1/128 s: sums are exact, so "due" is not decided by a rounding error)
        loop.now = i / 128  # streams start about 8 ms apart
        reads = sorted(
            loop.now + rnd.randrange(0, 128 * 100) / 128 for _ in range(rnd.randrange(0, 40))
        )
        guards.append(Guard(loop, d, policy, reads))
    assert len(loop.armed()) == 1
    loop.run_until(5000.0)
    for g in guards:
        last = g.head_at  # the read before the first gap over idle_s (a read exactly at the
        for r in g.reads:  # deadline is seen by the check: not a stall)
            if r - last > policy.idle_s:
                break
            last = r
        want = min(last + policy.idle_s, g.head_at + policy.total_s)
        reason = "idle" if last + policy.idle_s <= g.head_at + policy.total_s else "total"
        assert g.tripped == (reason, want)
    assert len(d) == 0 and not loop.armed()


def test_a_due_deadline_fires_after_two_passes_of_the_ready_queue():
    """Its timer hands over to the ready queue twice before the owner fires: one pass lets the
    loop poll for I/O (libuv polls between the two), the other lets what the poll read run."""
    loop = FakeLoop()
    d = Deadlines(loop)
    fired = []
    d.add(1.0, Call(lambda: fired.append(loop.now)))
    [timer] = loop.armed()
    loop.now = 1.0
    timer.fired = True
    timer.fn()
    assert fired == [] and len(loop.ready) == 1
    loop.run_ready_once()
    assert fired == [] and len(loop.ready) == 1
    loop.run_ready_once()
    assert fired == [1.0] and loop.ready == []


def test_a_deadline_cancelled_while_it_waits_for_the_poll_does_not_fire():
    loop = FakeLoop()
    d = Deadlines(loop)
    fired = []
    owner = Call(lambda: fired.append("fired"))
    d.add(1.0, owner)
    [timer] = loop.armed()
    loop.now = 1.0
    timer.fired = True
    timer.fn()
    loop.run_ready_once()
    # What the poll read cancels it (a stream that ended).
    d.cancel(owner)
    loop.run_ready_once()
    assert fired == [] and len(d) == 0

"""relay/proxy/slots.py without sockets: a slot is released once however often `release` runs."""

from __future__ import annotations

import asyncio

from relay.proxy.slots import SlotPool
from tests.support.helpers import wait_for


async def test_a_slot_released_twice_frees_one_slot():
    pool = SlotPool(parallel=1, queue=8)
    slot = await pool.acquire(timeout=1)
    assert pool.in_flight == 1
    slot.release()
    slot.release()  # a second exit path releasing the same slot
    assert (pool.in_flight, pool.queued) == (0, 0)
    second = await pool.acquire(timeout=1)  # free: at once
    assert (pool.in_flight, pool.queued) == (1, 0)
    third = asyncio.create_task(pool.acquire(timeout=5))
    await wait_for(lambda: pool.queued == 1 or third.done())
    assert not third.done()  # the one slot is the second's: the third waits
    assert (pool.in_flight, pool.queued) == (1, 1)
    second.release()
    last = await asyncio.wait_for(third, 1)  # the freed slot passes to the waiter
    assert (pool.in_flight, pool.queued) == (1, 0)
    last.release()
    last.release()
    second.release()
    assert (pool.in_flight, pool.queued) == (0, 0)

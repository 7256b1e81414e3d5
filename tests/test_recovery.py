"""An upstream marked down serves again as soon as it answers: one request at a time tries
it while down (half-open), and the probe runs more often while it is down."""

import asyncio

from relay.health import DOWN, READY, Health
from relay.sim import Simulator
from tests import httpc
from tests.conftest import closed_port, wait_for

CHAT = "/v1/chat/completions"


def test_half_open_lets_one_request_try_at_a_time():
    h = Health()
    assert h.may_try() and h.may_try()  # not down: everyone
    h.connect_failed("refused")
    assert h.may_try()  # the trial
    assert not h.may_try()  # the others fail fast meanwhile
    h.trial_over()
    assert h.may_try()
    h.trial_over()
    h.answered()
    assert h.probe == READY and h.may_try() and h.may_try()
    assert h.probe_delay(5.0, 0.5) == 5.0
    h.probed(None, "no answer")
    assert h.probe == DOWN and h.probe_delay(5.0, 0.5) == 0.5


async def test_down_upstream_serves_within_a_second_of_answering(make_relay):
    port = closed_port()
    app = await make_relay(url=f"http://127.0.0.1:{port}", health_interval_s=5.0)
    up = app.upstreams["llm"]
    first = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
    assert first.status == 502 and up.health.probe == DOWN
    loop = asyncio.get_running_loop()
    results: list[tuple[float, int]] = []
    sim = Simulator(port=port)

    async def client():
        while not results or results[-1][1] != 200:
            resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
            results.append((loop.time(), resp.status))
            await asyncio.sleep(0.02)

    running = asyncio.create_task(client())
    await wait_for(lambda: len(results) >= 5)  # failing fast while nothing listens
    assert {s for _, s in results} == {502}
    await sim.start()
    back_at = loop.time()
    try:
        await asyncio.wait_for(running, 5)
        served_at = results[-1][0]
        print(f"recovery {served_at - back_at:.3f}s")
        assert served_at - back_at < 1.0, f"served {served_at - back_at:.2f}s after it was back"
        assert up.health.probe == READY
    finally:
        await sim.stop()


async def test_down_upstream_is_seen_back_by_the_probe_without_requests(make_relay):
    port = closed_port()
    app = await make_relay(url=f"http://127.0.0.1:{port}", health_interval_s=5.0)
    up = app.upstreams["llm"]
    await wait_for(lambda: up.health.probe == DOWN)
    sim = Simulator(port=port)
    await sim.start()
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await wait_for(lambda: up.health.probe == READY, timeout=3)
        assert loop.time() - t0 < 1.0
    finally:
        await sim.stop()

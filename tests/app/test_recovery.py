"""An upstream marked down serves again within a second of answering: requests fail fast
while it is down, and the probe runs every down_probe_interval_s (0.5 s) meanwhile."""

import asyncio

from relay.proxy.health import DOWN, READY, Health
from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.helpers import closed_port, release, wait_for

CHAT = "/v1/chat/completions"


def test_probe_runs_more_often_while_down():
    h = Health()
    assert h.probe_delay(5.0, 0.5) == 5.0
    h.connect_failed("refused")
    assert h.probe == DOWN and h.probe_delay(5.0, 0.5) == 0.5
    h.probed(200)
    assert h.probe == READY and h.probe_delay(5.0, 0.5) == 5.0


async def test_down_upstream_serves_within_a_second_of_answering(make_relay):
    port = closed_port()
    first_sim = Simulator(port=release(port))
    await first_sim.start()
    app = await make_relay(url=f"http://127.0.0.1:{port}", health_interval_s=5.0)
    up = app.upstreams["llm"]
    assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))).status == 200
    await first_sim.stop()  # gone between two regular probes: a request finds out
    await wait_for(lambda: not first_sim.open_connections)
    down = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(3))
    assert down.status == 502 and up.health.probe == DOWN
    loop = asyncio.get_running_loop()
    results: list[tuple[float, int]] = []
    sim = Simulator(port=release(port))

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
    sim = Simulator(port=release(port))
    await sim.start()
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await wait_for(lambda: up.health.probe == READY, timeout=3)
        assert loop.time() - t0 < 1.0
    finally:
        await sim.stop()

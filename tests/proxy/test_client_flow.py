"""relay.proxy.client_flow.py without sockets: pause, resume, and a client stuck too long."""

from __future__ import annotations

from relay.proxy.client_flow import ClientFlow
from tests.support.fake_loop import FakeLoop


class Upstream:
    def __init__(self) -> None:
        self.calls = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")


def test_pause_then_resume():
    loop, up, stuck = FakeLoop(), Upstream(), []
    flow = ClientFlow(loop, 10.0, lambda: stuck.append(1))
    flow.pause(up)
    flow.pause(up)  # one timer however often the transport says so
    assert flow.paused and up.calls == ["pause", "pause"] and len(loop.timers) == 1
    assert loop.timers[0].delay == 10.0
    flow.resume(up)
    assert not flow.paused and up.calls[-1] == "resume" and loop.timers[0].cancelled
    assert stuck == []


def test_stuck_client_reported_once_the_timeout_passes():
    loop, stuck = FakeLoop(), []
    flow = ClientFlow(loop, 3.0, lambda: stuck.append(1))
    flow.pause(None)  # no upstream transport (the exchange already ended): nothing to pause
    loop.timers[0].fn()
    assert stuck == [1] and flow.timer is None


def test_cancel():
    loop = FakeLoop()
    flow = ClientFlow(loop, 3.0, lambda: None)
    flow.cancel()
    flow.pause(None)
    flow.cancel()
    assert loop.timers[0].cancelled and flow.timer is None

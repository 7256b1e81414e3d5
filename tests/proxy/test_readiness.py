"""The rules of upstream health and of what `GET /health` says, without sockets: an upstream
is `unknown` until seen; each change is told once, however many requests see it; the relay can
serve while one upstream can, and says why not in llama-server's own 503 shape."""

import json

import pytest

from relay.proxy.health import DOWN, LOADING, READY, SERVING, UNKNOWN, Change, Health, Seen
from relay.proxy.readiness import Why, health_answer, judge
from tests.support.fixtures import FIXTURES


def watched() -> tuple[Health, list[Change], list[str]]:
    h = Health()
    changes: list[Change] = []
    woken: list[str] = []
    h.on_change = changes.append
    h.on_down = lambda: woken.append("probe")
    return h, changes, woken


def test_unknown_until_seen_and_never_said_to_have_been_ready():
    h, changes, _ = watched()
    assert h.probe == UNKNOWN and h.state(0) == "unknown" and h.probed_at is None
    h.probed(None, "no answer to GET /health: Connection refused")
    assert changes == [
        Change(UNKNOWN, DOWN, Seen.PROBE, "no answer to GET /health: Connection refused", None)
    ]
    assert h.probe_status is None and h.probed_at is not None


def test_a_hundred_requests_finding_it_down_are_one_change_and_its_recovery_another():
    h, changes, woken = watched()
    h.probed(200)
    for _ in range(100):
        h.connect_failed("connect failed: Connection refused")
    assert h.probe == DOWN and h.last_error == "connect failed: Connection refused"
    assert woken == ["probe"]  # the probe is woken once
    for _ in range(100):
        h.answered()
    assert [(c.was, c.now, c.by, c.error) for c in changes] == [
        (UNKNOWN, READY, Seen.PROBE, ""),
        (READY, DOWN, Seen.REQUEST, "connect failed: Connection refused"),
        (DOWN, READY, Seen.REQUEST, ""),
    ]


def test_a_probe_that_sees_no_change_tells_nothing():
    h, changes, _ = watched()
    h.probed(200)
    h.probed(404)  # a server without /health: there
    h.probed(503)
    h.probed(503)
    h.answered()  # loading: a request's answer does not make it ready
    assert [(c.now, c.status) for c in changes] == [(READY, 200), (LOADING, 503)]
    assert h.probe == LOADING and h.probe_status == 503


def test_an_answer_makes_an_unknown_upstream_ready_and_requests_make_it_serving():
    h, changes, _ = watched()
    assert h.state(2) == SERVING  # not seen yet, but requests on it
    h.answered()
    assert h.probe == READY and changes == [Change(UNKNOWN, READY, Seen.REQUEST)]
    assert (h.state(0), h.state(1)) == (READY, SERVING)


@pytest.mark.parametrize(
    "probes, probing, draining, why",
    [
        ([READY], True, False, Why.OK),
        ([SERVING, DOWN], True, False, Why.OK),
        ([DOWN, READY], True, False, Why.OK),
        ([UNKNOWN], False, False, Why.OK),  # no probe: not down is enough
        ([UNKNOWN, DOWN], False, False, Why.OK),
        ([DOWN], False, False, Why.DOWN),  # a request found it down
        ([UNKNOWN], True, False, Why.NOT_PROBED),
        ([UNKNOWN, DOWN], True, False, Why.NOT_PROBED),
        ([LOADING, UNKNOWN, DOWN], True, False, Why.LOADING),
        ([LOADING], False, False, Why.LOADING),
        ([DOWN, DOWN], True, False, Why.DOWN),
        ([READY], True, True, Why.DRAINING),
    ],
)
def test_the_relay_can_serve_while_one_upstream_can(probes, probing, draining, why):
    assert judge(probes, probing, draining) is why


def captured(name: str) -> tuple[int, bytes]:
    """The status and body of a captured llama-server answer."""
    raw = (FIXTURES / name).read_bytes().partition(b"======== RESPONSE (raw bytes) ========\n")[2]
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_health_answers_in_llama_servers_shapes():
    # the pinned llama-server's answers, as captured: ready, and loading its model
    assert health_answer(Why.OK) == captured("health.http") == (200, b'{"status":"ok"}')
    assert health_answer(Why.LOADING) == captured("health_loading.http")
    for why in (Why.NOT_PROBED, Why.DOWN, Why.DRAINING):
        status, body = health_answer(why)
        error = json.loads(body)["error"]
        assert status == 503 and list(error) == ["message", "type", "code"]
        assert (error["type"], error["code"]) == ("unavailable_error", 503)
        assert error["message"] and error["message"] != "Loading model"

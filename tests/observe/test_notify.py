"""systemd's notification protocol (`observe.notify`): the datagram's bytes, the address
`$NOTIFY_SOCKET` names (a path, or `@` for an abstract name), the variable taken out of the
environment, nothing sent without it, and a socket nobody reads never raising."""

from __future__ import annotations

import os
import socket
import time

import pytest

from relay.observe.log import quiet
from relay.observe.notify import (
    SEND_TIMEOUT_S,
    STATUS_MAX_BYTES,
    Notifier,
    State,
    address,
    message,
    serving_status,
    status_line,
)
from tests.support.notify_socket import ManagerSocket

WAIT_S = 10.0


def test_the_address_a_path_an_abstract_name_or_none():
    assert address("/run/systemd/notify") == "/run/systemd/notify"
    assert address("@relay/notify") == "\0relay/notify"
    # a virtual machine's manager on its host, and what is no address at all
    assert address("vsock:2:9999") is None
    assert address("notify") is None


def test_the_datagram_of_each_state():
    assert message(State.READY, "serving", 5) == b"READY=1\nSTATUS=serving"
    assert message(State.STOPPING, "draining", 5) == b"STOPPING=1\nSTATUS=draining"
    # the clock goes with RELOADING only (Type=notify-reload orders reloads by it)
    assert message(State.RELOADING, "reloading x", 1234567) == (
        b"RELOADING=1\nMONOTONIC_USEC=1234567\nSTATUS=reloading x"
    )
    assert message(None, "start failed: in use", 5) == b"STATUS=start failed: in use"


def test_the_status_is_one_line_and_bounded():
    assert status_line("reload refused:\n  upstream[0].parallel:\tbad\n") == (
        "reload refused: upstream[0].parallel: bad"
    )
    # cut between characters, within the bound (systemd drops a datagram over 4096 bytes)
    long = status_line("é" * 5000)
    assert long == "é" * (STATUS_MAX_BYTES // 2)
    odd = status_line("x" + "é" * 5000)
    assert odd == "x" + "é" * ((STATUS_MAX_BYTES - 1) // 2)
    assert len(message(State.READY, "é" * 100000, 1)) < 4096


def test_the_serving_status():
    assert serving_status(["llm"], "127.0.0.1", 8080, 1) == (
        "serving 1 upstream (llm) on 127.0.0.1:8080"
    )
    assert serving_status(["a", "b"], "::", 8080, 4) == (
        "serving 2 upstreams (a, b) on [::]:8080 with 4 workers"
    )
    assert serving_status(["a"], "", 80, 1) == "serving 1 upstream (a) on *:80"


@pytest.fixture(params=["path", "abstract"])
def manager(request):
    m = ManagerSocket(request.param)
    yield m
    m.close()


async def test_notifications_reach_the_manager_and_the_variable_is_taken(manager):
    environ = {"NOTIFY_SOCKET": manager.env, "HOME": "/nonexistent"}
    log = quiet()
    notify = Notifier.from_environ(environ, log)
    # taken out: a child process started with this environment never inherits it
    assert environ == {"HOME": "/nonexistent"}
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notify.send(State.RELOADING, "reloading relay.toml")
    notify.send(State.READY, "serving 1 upstream (llm) on 127.0.0.1:8080; reloaded")
    notify.send(State.STOPPING, "draining: up to 30 s")
    # after STOPPING no state goes out (a reload ending mid-drain); a status still does
    notify.send(State.READY, "serving")
    notify.send(None, "still draining")
    notes = [await manager.next(WAIT_S) for _ in range(4)]
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert manager.pending() == []
    assert [n.state for n in notes] == ["RELOADING", "READY", "STOPPING", None]
    assert {n.pid for n in notes} == {os.getpid()}
    reloading = notes[0].fields
    assert set(reloading) == {"RELOADING", "MONOTONIC_USEC", "STATUS"}
    assert before <= int(reloading["MONOTONIC_USEC"]) <= after
    assert notes[1].fields == {
        "READY": "1",
        "STATUS": "serving 1 upstream (llm) on 127.0.0.1:8080; reloaded",
    }
    assert notes[3].fields == {"STATUS": "still draining"}
    assert log.lines == []


def test_without_the_variable_nothing_is_sent_or_logged():
    log = quiet()
    environ: dict[str, str] = {}
    notify = Notifier.from_environ(environ, log)
    assert notify.target is None
    notify.send(State.READY, "serving")
    assert environ == {} and log.lines == []


def test_an_unsupported_address_is_logged_and_taken_out():
    log = quiet()
    environ = {"NOTIFY_SOCKET": "vsock:2:9999"}
    notify = Notifier.from_environ(environ, log)
    notify.send(State.READY, "serving")
    assert environ == {} and notify.target is None
    assert [r["notify_socket"] for r in log.of("notify_unsupported")] == ["vsock:2:9999"]


def test_a_socket_nobody_binds_never_raises_and_is_logged_once(tmp_path):
    log = quiet()
    gone = ManagerSocket("abstract")
    gone.close()
    for env in (str(tmp_path / "none"), gone.env):
        log.lines = []
        notify = Notifier.from_environ({"NOTIFY_SOCKET": env}, log)
        notify.send(State.READY, "serving")
        notify.send(State.STOPPING, "draining")
        failed = log.of("notify_failed")
        assert len(failed) == 1 and failed[0]["state"] == "READY"
        assert "ConnectionRefused" in failed[0]["error"] or "FileNotFound" in failed[0]["error"]


def test_a_manager_that_reads_nothing_holds_a_send_no_longer_than_the_bound():
    # A datagram socket whose queue is full: the send sleeps SEND_TIMEOUT_S, then gives up.
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as full:
        name = f"relay-test-full-{time.monotonic_ns()}"
        full.bind("\0" + name)
        log = quiet()
        notify = Notifier.from_environ({"NOTIFY_SOCKET": "@" + name}, log)
        t0, cpu0 = time.monotonic(), time.process_time()
        while not log.of("notify_failed"):
            notify.send(None, "x" * 1000)
            assert time.monotonic() - t0 < 60, "the queue never filled"
        assert log.of("notify_failed")[0]["error"].startswith("BlockingIOError")
        # the last send waited, asleep: the CPU it took is a fraction of the wall time
        assert time.monotonic() - t0 >= SEND_TIMEOUT_S
        assert time.process_time() - cpu0 < (time.monotonic() - t0) / 2

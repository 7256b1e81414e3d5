"""store.pg_bound's Watchdog, directly, with a fake connection (a socket pair whose server end
never writes unless told): it severs a call that runs past its bound, not before, and it
disarms: a call that ended within its bound, returning or raising, keeps its connection after
the bound has passed."""

from __future__ import annotations

import contextlib
import socket
import time
import types

import pytest

from relay.store.pg_bound import Watchdog

# How long a blocked read waits before the test gives up on the watchdog (it fails then).
GIVE_UP_S = 30.0


class FakeConn:
    """What the Watchdog touches of a psycopg connection: `pgconn.socket`."""

    def __init__(self) -> None:
        self.ours, self.server = socket.socketpair()
        self.ours.settimeout(GIVE_UP_S)
        self.pgconn = types.SimpleNamespace(socket=self.ours.fileno())

    def answers(self) -> bool:
        """Whether the connection still carries a byte from the server: not severed."""
        try:
            self.server.send(b"a")
            return self.ours.recv(1) == b"a"
        except OSError:
            return False

    def shut(self) -> None:
        self.ours.close()
        self.server.close()


@pytest.fixture
def conns():
    made: list[FakeConn] = []

    def make() -> FakeConn:
        made.append(FakeConn())
        return made[-1]

    yield make
    for c in made:
        c.shut()


def test_a_call_past_its_bound_is_severed_not_before(conns):
    dog, conn = Watchdog(), conns()
    t0 = time.monotonic()
    with dog.within(conn, 0.3):
        got = conn.ours.recv(1)  # the server never answers
    waited = time.monotonic() - t0
    assert got == b""  # severed: as a reset by the server
    assert waited >= 0.3
    assert dog.severed == 1
    assert not conn.answers()


class Failed(Exception):
    pass


@pytest.mark.parametrize("ends", ["returning", "raising"])
def test_a_call_ended_within_its_bound_is_never_severed_later(conns, ends):
    dog, quick, later = Watchdog(), conns(), conns()
    expect = pytest.raises(Failed) if ends == "raising" else contextlib.nullcontext()
    with expect, dog.within(quick, 0.2):
        assert quick.answers()
        if ends == "raising":
            raise Failed
    # A later call, bound past the first one's deadline, waits until it is severed: by then
    # the watchdog has passed the first deadline, and would have severed that call with it.
    with dog.within(later, 0.5):
        assert later.ours.recv(1) == b""
    assert dog.severed == 1
    assert quick.answers()

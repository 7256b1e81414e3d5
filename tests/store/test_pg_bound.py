"""store.pg_bound without a server: a call blocked on a socket that never answers is cut off
at its deadline (the socket shut down: the call returns, the descriptor stays open for its
owner), a call that ends in time is left alone, and an asyncio call is never cancelled
(psycopg would then wait for the server to cancel it) but severed and closed once ended."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import types

import pytest

from relay.store.pg_bound import NoAnswer, Watchdog, bounded, sever
from tests.support.helpers import wait_for


class FakeConn:
    """What the bounds touch of a psycopg connection: `pgconn.socket` and `close()`."""

    def __init__(self) -> None:
        self.ours, self.server = socket.socketpair()  # the server's end never writes
        self.pgconn = types.SimpleNamespace(socket=self.ours.fileno())
        self.closed = False

    async def close(self) -> None:
        self.closed = True

    def shut(self) -> None:
        self.ours.close()
        self.server.close()


def test_sever_wakes_a_blocked_read_and_leaves_the_descriptor_open():
    conn = FakeConn()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(conn.ours.recv(10)))
    reader.start()
    sever(conn)
    reader.join(5)
    assert not reader.is_alive() and got == [b""]  # as a reset by the server
    assert conn.ours.fileno() >= 0  # still the connection's, closed by its owner
    conn.shut()
    sever(types.SimpleNamespace(pgconn=None))  # a closed connection: nothing to do


def test_the_watchdog_cuts_off_a_late_call_only():
    dog = Watchdog()
    slow, quick = FakeConn(), FakeConn()
    try:
        with dog.within(quick, 5.0):
            quick.server.send(b"x")
            assert quick.ours.recv(1) == b"x"  # answered in time: untouched
        t0 = time.monotonic()
        with dog.within(slow, 0.2):
            assert slow.ours.recv(1) == b""  # cut off
        assert 0.15 < time.monotonic() - t0 < 2.0
        assert dog.severed == 1
        quick.server.send(b"y")
        assert quick.ours.recv(1) == b"y"  # the call that ended in time kept its socket
    finally:
        slow.shut()
        quick.shut()


def test_a_cap_ends_calls_sooner_and_the_thread_stops_when_idle():
    dog = Watchdog()
    conn = FakeConn()
    try:
        t0 = time.monotonic()
        threading.Timer(0.1, dog.cap, (0.1,)).start()  # the store closes meanwhile
        with dog.within(conn, 60.0):
            assert conn.ours.recv(1) == b""
        assert time.monotonic() - t0 < 2.0
        end = time.monotonic() + 5
        while dog._thread is not None:
            assert time.monotonic() < end, "the watchdog thread did not stop"
            time.sleep(0.01)
    finally:
        conn.shut()


async def _read(conn: FakeConn) -> bytes:
    loop = asyncio.get_running_loop()
    conn.ours.setblocking(False)
    return await loop.sock_recv(conn.ours, 10)


async def test_bounded_severs_an_unanswered_call_and_closes_it_once_ended():
    conn = FakeConn()
    try:
        t0 = time.monotonic()
        with pytest.raises(NoAnswer):
            await bounded(conn, _read(conn), 0.2)
        assert 0.15 < time.monotonic() - t0 < 2.0
        await wait_for(lambda: conn.closed)  # the call ended (its socket shut down): closed
        answered = FakeConn()
        answered.server.send(b"ok")
        assert await bounded(answered, _read(answered), 5.0) == b"ok"
        assert not answered.closed
        answered.shut()
    finally:
        conn.shut()


async def test_a_cancelled_caller_severs_the_call_instead_of_cancelling_it():
    conn = FakeConn()
    inner: list[asyncio.Task] = []

    async def call() -> bytes:
        inner.append(asyncio.current_task())  # type: ignore[arg-type]
        return await _read(conn)

    try:
        outer = asyncio.ensure_future(bounded(conn, call(), 60.0))
        await wait_for(lambda: inner)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        assert await asyncio.wait_for(inner[0], 5) == b""  # ended, by the shutdown
        assert not inner[0].cancelled()
        await wait_for(lambda: conn.closed)
    finally:
        conn.shut()

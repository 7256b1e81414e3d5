"""A relay whose own loop was busy past the idle bound (a long collection, a slow callback) has
not read what its upstreams sent meanwhile: the stall guard must not take that for an upstream
that went quiet. uvloop runs due timers before it polls for I/O, so a guard that decided at
once would end a stream whose next bytes were already waiting in the socket.

Both upstreams below keep sending while the loop is blocked: one in a thread of its own (the
usual case, another process), and the simulator on the relay's own loop (the suite's case).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from tests.support import httpc
from tests.support.blocking_http import read_message
from tests.support.helpers import rows_of

IDLE_S = 0.3
# The loop is blocked for well over the idle bound: on a busy machine a wake-up only comes later.
BLOCK_S = 3 * IDLE_S
EVENTS = 200
GAP_S = 0.005


def _event(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i


class ThreadUpstream:
    """An SSE upstream in a thread: answers one request with EVENTS events GAP_S apart, then
    [DONE], whatever the relay's loop is doing."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            read_message(conn)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            for i in range(EVENTS):
                ev = _event(i)
                conn.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
                time.sleep(GAP_S)
            done = b"data: [DONE]\n\n"
            conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    def stop(self) -> None:
        self.sock.close()
        self.thread.join(5)


class _Blocker(asyncio.Protocol):
    """Blocks the loop BLOCK_S in the read callback of its own socket: in the loop's poll for
    I/O, as a slow read of any connection would (nothing on the loop runs meanwhile)."""

    def __init__(self) -> None:
        self.done = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        time.sleep(BLOCK_S)
        self.done.set_result(None)


async def _block_the_loop_while_it_reads() -> None:
    ours, theirs = socket.socketpair()
    transport, blocker = await asyncio.get_running_loop().connect_accepted_socket(_Blocker, ours)
    theirs.send(b"x")
    await asyncio.wait_for(blocker.done, 10)
    transport.close()
    theirs.close()


async def _stream_with_a_blocked_loop(port: int, body: dict) -> bytes:
    """Read the head and three content events, block the loop BLOCK_S, then read the rest (to
    the chunked body's end)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(httpc.build_request("POST", "/v1/chat/completions", body))
    for _ in range(3):
        await asyncio.wait_for(reader.readuntil(b'"content":'), 10)
    await _block_the_loop_while_it_reads()
    rest = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 20)
    writer.close()
    return rest


async def test_a_loop_busy_past_the_idle_bound_does_not_trip_a_sending_upstream(make_relay):
    up = ThreadUpstream()
    app = await make_relay(url=up.url, stream_idle_timeout_s=IDLE_S, stream_total_timeout_s=0)
    body = await _stream_with_a_blocked_loop(app.port, httpc.chat(5))
    up.stop()
    assert b"relay-stall-guard" not in body
    assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    [row] = await rows_of(app, 1)
    assert (row["status"], row["ok"], row["error_code"]) == (200, 1, None)
    assert row["completion_tokens"] == EVENTS
    assert app.log.of("stream_stall_guard_tripped") == []


async def test_the_simulator_on_the_same_loop_is_not_taken_for_stalled(make_relay, sim):
    app = await make_relay(stream_idle_timeout_s=IDLE_S, stream_total_timeout_s=0)
    body = await _stream_with_a_blocked_loop(app.port, httpc.chat(40, interval_ms=3))
    assert b"relay-stall-guard" not in body
    assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    [row] = await rows_of(app, 1)
    assert (row["ok"], row["error_code"], row["completion_tokens"]) == (1, None, 40)
    assert app.log.of("stream_stall_guard_tripped") == []


async def test_a_quiet_upstream_still_trips_after_a_blocked_loop(make_relay, sim):
    """The guard waits for one poll, not for the upstream: one that sends nothing is cut."""
    app = await make_relay(stream_idle_timeout_s=IDLE_S, stream_total_timeout_s=0)
    body = await _stream_with_a_blocked_loop(app.port, httpc.chat(20, stall_after=3))
    assert b"relay-stall-guard" in body
    [row] = await rows_of(app, 1)
    assert (row["error_code"], row["completion_tokens"]) == ("stream_stall_idle", 3)

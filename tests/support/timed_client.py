"""A streaming client in a process of its own, timing what it receives: `python -m
tests.support.timed_client PORT` asks 127.0.0.1:PORT for `/health` three times on a new
connection, then sends on it the request bytes given on stdin, and prints, as one JSON line,
the time just before that write and the arrival time of each content event (one time per read,
every content event of the read at it), in seconds of the system clock.

An arrival is the time the kernel stamped on the bytes as they reached the socket
(SO_TIMESTAMPNS), not the time this process woke to read them: the client's own scheduling,
which on a small machine adds a millisecond now and then, is not the relay's to answer for. A
read the kernel gave no stamp is timed when it returns. The `/health` exchanges first have the
relay accept the connection and serve on it before the clock starts, as a load generator's
pooled connection has it.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

from tests.support.blocking_http import read_message

HEALTH = b"GET /health HTTP/1.1\r\nHost: relay.test\r\n\r\n"
# Linux's SO_TIMESTAMPNS (and SCM_TIMESTAMPNS, the same number), which Python does not name.
SO_TIMESTAMPNS = 35
TIMESPEC = struct.Struct("qq")


def _answer(sock: socket.socket) -> None:
    """Read one response with a Content-Length body."""
    try:
        read_message(sock)
    except EOFError:
        raise SystemExit("the relay closed before answering /health in full") from None


def _received(sock: socket.socket) -> tuple[bytes, float]:
    """The next bytes and the time the kernel stamped on them."""
    data, ancillary, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(TIMESPEC.size))
    for level, kind, value in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            seconds, nanoseconds = TIMESPEC.unpack(value[: TIMESPEC.size])
            return data, seconds + nanoseconds / 1e9
    return data, time.time()


def main() -> int:
    port = int(sys.argv[1])
    request = sys.stdin.buffer.read()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Set before the /health exchanges: the kernel starts stamping a little after it is asked.
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.settimeout(10)
    for _ in range(3):
        sock.sendall(HEALTH)
        _answer(sock)
    t0 = time.time()
    sock.sendall(request)
    arrivals: list[float] = []
    buf = b""
    head_seen = False
    while b"[DONE]" not in buf:
        data, now = _received(sock)
        if not data:
            break
        buf += data
        if not head_seen:
            if b"\r\n\r\n" not in buf:
                continue
            head_seen = True
            data = buf[buf.index(b"\r\n\r\n") + 4 :]
        if b'"content":""' not in data:
            arrivals += [now] * data.count(b'"content":"')
    sock.close()
    print(json.dumps({"t0": t0, "arrivals": arrivals}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

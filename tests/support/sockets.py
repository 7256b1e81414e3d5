"""Clients that behave like real, awkward peers: a stream whose reader stalls, a client whose
window is tiny, a request from this machine's own non-loopback address."""

from __future__ import annotations

import asyncio
import socket

from tests.support import httpc
from tests.support.helpers import CHAT, wait_for

READ_SIZE = 256 * 1024  # the most one transport read hands over


async def open_stream(port: int, body: dict, rcvbuf: int | None = None):
    sock = socket.socket()
    if rcvbuf:  # a small receive window, so the relay feels a slow reader sooner
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(httpc.build_request("POST", "/v1/chat/completions", body))
    resp = await asyncio.wait_for(httpc.read_head(reader), 5)
    return reader, writer, resp


async def paused_stream(app, n: int = 60000):
    """A stream of `n` events (about 30 MB at 60000, more than the kernel's socket buffers on
    the way can absorb) whose client reads nothing, once the relay has paused for it: the
    reader, writer, response head, client connection and exchange."""
    reader, writer, resp = await open_stream(app.port, httpc.chat(n), rcvbuf=4096)
    assert resp.status == 200
    client = next(iter(app.clients))
    await wait_for(
        lambda: (
            client.exchange is not None
            and client.exchange.flow is not None
            and client.exchange.flow.paused
        )
    )
    return reader, writer, resp, client, client.exchange


async def slow_client(app, body: dict):
    """A client that sends `body` and reads only the response head.

    Its receive window is tiny and the relay's send buffer for this one connection is shrunk,
    so a ~60 KB response stays mostly in the relay's own write buffer: the kernel cannot hide
    an undrained client from the relay.
    """
    loop = asyncio.get_running_loop()
    before = set(app.clients)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", app.port))
    await wait_for(lambda: set(app.clients) - before)
    conn = (set(app.clients) - before).pop()
    conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    await loop.sock_sendall(sock, httpc.build_request("POST", CHAT, body))
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        byte = await asyncio.wait_for(loop.sock_recv(sock, 1), 5)
        assert byte, "relay closed before the head"
        head += byte
    feed = asyncio.StreamReader()
    feed.feed_data(head)
    return sock, conn, await httpc.read_head(feed)


def _own_address() -> str | None:
    """This machine's non-loopback IPv4 address, if it has one."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 9))  # no packet is sent: only the route is looked up
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


OWN = _own_address()


async def fetch_from(host: str, port: int, method: str, target: str, headers=None, body=None):
    """One request to the relay at `host` (e.g. OWN, to be a non-loopback peer), whole answer
    read; its Host names the address connected to, as curl's does."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if body is None and method == "POST":
            body = b"{}"
        writer.write(httpc.build_request(method, target, body, headers, host=f"{host}:{port}"))
        resp = await asyncio.wait_for(httpc.read_head(reader), 10)
        await asyncio.wait_for(httpc.read_body(reader, resp, method), 10)
        return resp
    finally:
        writer.close()

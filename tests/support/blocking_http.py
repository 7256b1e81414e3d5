"""HTTP/1.1 over a blocking socket, for peers that run outside the event loop (a thread, a
process of their own)."""

from __future__ import annotations

import socket


def read_message(sock: socket.socket) -> tuple[bytes, bytes]:
    """One message with a Content-Length body: its head and its body. EOFError if the peer
    closes before the end."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += _recv(sock)
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += _recv(sock)
    return head, body


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise EOFError("the peer closed within the message")
    return data

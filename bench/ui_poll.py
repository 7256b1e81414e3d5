"""Stand-in for an open operator page: GET /api/ui/state once a second, as the page's script
does (one keep-alive connection), until killed. Used by the `relay_ui` bench target."""

from __future__ import annotations

import argparse
import socket
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--interval", type=float, default=1.0)
    a = p.parse_args()
    req = (f"GET /api/ui/state HTTP/1.1\r\nHost: {a.host}:{a.port}\r\n\r\n").encode()
    sock = None
    polls = 0
    while True:
        try:
            if sock is None:
                sock = socket.create_connection((a.host, a.port), timeout=10)
            sock.sendall(req)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("closed")
                head += chunk
            top, _, body = head.partition(b"\r\n\r\n")
            length = int(
                next(
                    line.split(b":")[1]
                    for line in top.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
            )
            while len(body) < length:
                body += sock.recv(65536)
            polls += 1
            print(f"poll {polls} status {top.split()[1].decode()} bytes {length}", flush=True)
        except (OSError, ConnectionError, StopIteration):
            if sock is not None:
                sock.close()
            sock = None
        time.sleep(a.interval)


if __name__ == "__main__":
    main()

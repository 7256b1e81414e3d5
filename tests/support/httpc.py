"""A strict little HTTP/1.1 client over raw asyncio streams, for asserting exact bytes.

It keeps the raw response, and de-chunks strictly: a body that ends without its terminating
chunk is reported as `complete = False`, never papered over.
"""

from __future__ import annotations

import asyncio
import json

TIMEOUT = 10.0


class Response:
    def __init__(self, status: int, reason: str, headers: list[tuple[str, str]], raw_head: bytes):
        self.status = status
        self.reason = reason
        self.headers = headers
        self.raw_head = raw_head
        self.raw_body = b""  # body bytes as they came on the wire (chunk framing included)
        self.body = b""  # de-chunked
        self.complete = False  # the body ended as its framing says (not by a cut)

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    def json(self):
        return json.loads(self.body)

    def events(self) -> list[bytes]:
        return [e for e in self.body.split(b"\n\n") if e.strip(b"\n")]

    def data_events(self) -> list[dict | str]:
        out = []
        for ev in self.events():
            text = ev.strip(b"\n")
            if text.startswith(b"data: "):
                payload = text[6:]
                out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        return out


def build_request(
    method: str,
    path: str,
    body: bytes | dict | None = None,
    headers: dict | list | None = None,
    http: str = "1.1",
    host: str = "relay.test",
) -> bytes:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    items = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
    names = {k.lower() for k, _ in items}
    lines = [f"{method} {path} HTTP/{http}"]
    if "host" not in names:
        lines.append(f"Host: {host}")
    if body is not None and "content-length" not in names and "transfer-encoding" not in names:
        items.append(("Content-Length", str(len(body))))
        if "content-type" not in names:
            items.append(("Content-Type", "application/json"))
    lines += [f"{k}: {v}" for k, v in items]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def read_head(reader: asyncio.StreamReader) -> Response:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw[:-4].decode("latin-1").split("\r\n")
    _, status, *reason = lines[0].split(" ", 2)
    headers = []
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers.append((k, v.strip()))
    return Response(int(status), reason[0] if reason else "", headers, raw)


async def read_body(reader: asyncio.StreamReader, resp: Response, method: str = "POST") -> None:
    te = (resp.header("transfer-encoding") or "").lower()
    cl = resp.header("content-length")
    if method == "HEAD" or resp.status in (204, 304) or resp.status < 200:
        resp.complete = True
        return
    raw = bytearray()
    body = bytearray()
    if "chunked" in te:
        try:
            while True:
                line = await reader.readuntil(b"\r\n")
                raw += line
                size = int(line.split(b";")[0], 16)
                if size == 0:
                    while True:
                        trailer = await reader.readuntil(b"\r\n")
                        raw += trailer
                        if trailer == b"\r\n":
                            break
                    resp.complete = True
                    break
                try:
                    data = await reader.readexactly(size + 2)
                except asyncio.IncompleteReadError as exc:
                    raw += exc.partial
                    body += exc.partial[:size]  # the cut chunk's payload, as far as it came
                    break
                raw += data
                assert data[-2:] == b"\r\n", "chunk data not followed by CRLF"
                body += data[:-2]
        except asyncio.IncompleteReadError as exc:
            raw += exc.partial
    elif cl is not None:
        try:
            data = await reader.readexactly(int(cl))
            resp.complete = True
        except asyncio.IncompleteReadError as exc:
            data = exc.partial
        raw += data
        body += data
    else:
        data = await reader.read()
        raw += data
        body += data
        resp.complete = True
    resp.raw_body = bytes(raw)
    resp.body = bytes(body)


async def fetch(
    port: int,
    method: str,
    path: str,
    body=None,
    headers=None,
    http: str = "1.1",
    timeout: float = TIMEOUT,
    ssl=None,
) -> Response:
    """One request on a new connection (TLS with an `ssl` context); closed afterwards. Its
    Host names the address connected to, as curl's does (the relay's admin rule reads it)."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=ssl, server_hostname="localhost" if ssl else None
    )
    try:
        writer.write(build_request(method, path, body, headers, http, f"127.0.0.1:{port}"))
        resp = await asyncio.wait_for(read_head(reader), timeout)
        await asyncio.wait_for(read_body(reader, resp, method), timeout)
        return resp
    finally:
        writer.close()


async def exchange(
    reader, writer, method: str, path: str, body=None, headers=None, timeout: float = TIMEOUT
) -> Response:
    """One request on an open connection (keep-alive)."""
    writer.write(build_request(method, path, body, headers))
    resp = await asyncio.wait_for(read_head(reader), timeout)
    await asyncio.wait_for(read_body(reader, resp, method), timeout)
    return resp


def chat(tokens: int | None = None, stream: bool = True, model: str = "tiny", **sim) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi there"}], "stream": stream}
    if tokens is not None:
        body["max_tokens"] = tokens
    if sim:
        body["sim"] = sim
    return body


def sim_text(n: int) -> str:
    """The simulator's (and the tiny real model's) first n tokens, joined."""
    cycle = [" from", " a", " tiny", " llama", ".", " Hello"]
    return "Hello" + "".join(cycle[i % 6] for i in range(n - 1)) if n else ""

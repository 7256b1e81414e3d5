"""A raw client of the simulator (asyncio streams, exact bytes): requests, heads, chunks."""

from __future__ import annotations

import asyncio
import json

from relay.sim.server import Simulator

T = 5.0
SILENCE = 0.3
CHAT = {"messages": [{"role": "user", "content": "Hi there"}]}


def req_bytes(method: str, path: str, body=None, headers: tuple[str, ...] = ()) -> bytes:
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "User-Agent: test/1", "Accept: */*"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += list(headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer

    @classmethod
    async def connect(cls, sim: Simulator) -> Client:
        return cls(*await asyncio.open_connection("127.0.0.1", sim.port))

    async def send(self, method: str, path: str, body=None, headers: tuple[str, ...] = ()) -> None:
        self.w.write(req_bytes(method, path, body, headers))
        await self.w.drain()

    async def head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        raw = await asyncio.wait_for(self.r.readuntil(b"\r\n\r\n"), T)
        return parse_head(raw[:-4])

    async def chunk(self) -> bytes | None:
        """One chunk's payload (framing checked); None for the terminating chunk."""
        line = await asyncio.wait_for(self.r.readuntil(b"\r\n"), T)
        size = int(line[:-2], 16)
        data = await asyncio.wait_for(self.r.readexactly(size + 2), T)
        assert data[-2:] == b"\r\n", data[-20:]
        return data[:-2] if size else None

    async def chunks(self) -> list[bytes]:
        out = []
        while (c := await self.chunk()) is not None:
            out.append(c)
        return out

    async def body(self, headers) -> bytes:
        n = int(hval(headers, b"content-length"))
        return await asyncio.wait_for(self.r.readexactly(n), T)

    async def eof(self) -> bytes:
        """Read to EOF (a reset counts as EOF); returns what was read."""
        try:
            return await asyncio.wait_for(self.r.read(), T)
        except ConnectionResetError:
            return b""

    async def silent(self) -> bool:
        """True if nothing arrives for SILENCE seconds (the connection stays open and quiet)."""
        try:
            data = await asyncio.wait_for(self.r.read(1), SILENCE)
        except TimeoutError:
            return True
        raise AssertionError(f"unexpected bytes/EOF: {data!r}")

    def close(self) -> None:
        self.w.close()


def parse_head(raw: bytes):
    lines = raw.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    return status, [tuple(ln.split(b": ", 1)) for ln in lines[1:]]


def hval(headers, name: bytes) -> bytes | None:
    return next((v for k, v in headers if k.lower() == name), None)


def events(payload: bytes) -> list[bytes]:
    assert payload.endswith(b"\n\n"), payload[-30:]
    evs = [e + b"\n\n" for e in payload.split(b"\n\n") if e]
    assert b"".join(evs) == payload
    return evs


async def stream(sim, path, body):
    c = await Client.connect(sim)
    await c.send("POST", path, body)
    status, headers = await c.head()
    return c, status, headers


def parse_chunks(data: bytes, whole: bool = False) -> list[bytes]:
    """The payloads of a chunked body, each chunk's framing checked; `whole`: nothing may
    follow the last chunk."""
    out, pos = [], 0
    while True:
        nl = data.index(b"\r\n", pos)
        size = int(data[pos:nl], 16)
        if size == 0:
            if whole:
                assert data[nl:] == b"\r\n\r\n"
            else:
                assert data[nl : nl + 4] == b"\r\n\r\n"
            return out
        out.append(data[nl + 2 : nl + 2 + size])
        assert data[nl + 2 + size : nl + 4 + size] == b"\r\n"
        pos = nl + 4 + size

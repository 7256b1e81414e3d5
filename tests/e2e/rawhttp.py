"""Minimal HTTP/1.1 client over raw asyncio sockets (no HTTP library), for e2e tests.

It keeps what a relay cares about: raw chunk boundaries, headers as sent, and whether the
server closed the connection after the response.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

IO_TIMEOUT = 15.0


@dataclass
class RawResponse:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    chunks: list[bytes] | None = None  # chunk payloads when Transfer-Encoding: chunked
    closed: bool | None = None  # the server closed after the response (None: not checked)
    raw: bytes = b""
    _extra: dict[str, Any] = field(default_factory=dict)

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def json(self) -> Any:
        return json.loads(self.body)

    def sse_data(self, payload: bytes | None = None) -> list[str]:
        """``data:`` payloads of the SSE events in ``payload`` (default: whole body)."""
        text = (self.body if payload is None else payload).decode()
        out = []
        for event in text.replace("\r\n", "\n").split("\n\n"):
            lines = [ln[5:].lstrip(" ") for ln in event.split("\n") if ln.startswith("data:")]
            if lines:
                out.append("\n".join(lines))
        return out

    def sse_json(self) -> list[Any]:
        """Parsed JSON events, ``[DONE]`` excluded."""
        return [json.loads(d) for d in self.sse_data() if d != "[DONE]"]


def build_request(
    method: str, path: str, port: int, body: Any = None, headers: dict[str, str] | None = None
) -> bytes:
    if body is not None and not isinstance(body, (bytes, bytearray)):
        body = json.dumps(body).encode()
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "User-Agent: relay-e2e/1",
        "Accept: */*",
    ]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if body is not None:
        if not any(k.lower() == "content-type" for k in (headers or {})):
            lines.append("Content-Type: application/json")
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def read_head(reader: asyncio.StreamReader) -> tuple[int, str, list[tuple[str, str]], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
    lines = head.decode("latin-1").split("\r\n")
    _version, status, *reason = lines[0].split(" ", 2)
    headers = []
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers.append((k.strip().lower(), v.strip()))
    return int(status), (reason[0] if reason else ""), headers, head


async def read_response(reader: asyncio.StreamReader, *, method: str = "GET") -> RawResponse:
    """Read one response (the connection's fate is `closed_after`'s business)."""
    status, reason, headers, raw = await read_head(reader)
    hdr = dict(headers)
    chunks: list[bytes] | None = None
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        body = b""
    elif "chunked" in hdr.get("transfer-encoding", "").lower():
        chunks = []
        while True:
            line = await asyncio.wait_for(reader.readuntil(b"\r\n"), IO_TIMEOUT)
            raw += line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    t = await asyncio.wait_for(reader.readuntil(b"\r\n"), IO_TIMEOUT)
                    raw += t
                    if t == b"\r\n":
                        break
                break
            data = await asyncio.wait_for(reader.readexactly(size + 2), IO_TIMEOUT)
            raw += data
            assert data[-2:] == b"\r\n", "chunk not terminated by CRLF"
            chunks.append(data[:-2])
        body = b"".join(chunks)
    elif "content-length" in hdr:
        body = await asyncio.wait_for(reader.readexactly(int(hdr["content-length"])), IO_TIMEOUT)
        raw += body
    else:
        body = await asyncio.wait_for(reader.read(), IO_TIMEOUT)
        raw += body
    return RawResponse(status, reason, headers, body, chunks, None, raw)


async def closed_after(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int
) -> bool:
    """Whether the server closed the connection after the response just read.

    Decided by an event, not by a quiet spell: a second request (``GET /health``) on the same
    connection either gets an answer (the connection was kept) or EOF / a reset (it was
    closed; a server that closes with our probe unread resets). A server slow to close is
    still seen closing; waiting N seconds for an EOF instead made a slow close look "kept".
    """
    try:
        writer.write(build_request("GET", "/health", port))
        await writer.drain()
        first = await asyncio.wait_for(reader.read(1), IO_TIMEOUT)
    except (ConnectionError, OSError):
        return True
    except TimeoutError:
        raise AssertionError(f"neither an answer nor a close within {IO_TIMEOUT}s") from None
    return first == b""


async def request(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    check_close: bool = False,
) -> RawResponse:
    """One request on a fresh connection, closed afterwards.

    ``check_close``: record in ``RawResponse.closed`` whether the server closed the
    connection after the response (`closed_after`).
    """
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), IO_TIMEOUT)
    try:
        writer.write(build_request(method, path, port, body, headers))
        await writer.drain()
        resp = await read_response(reader, method=method)
        if check_close:
            resp.closed = await closed_after(reader, writer, port)
        return resp
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass

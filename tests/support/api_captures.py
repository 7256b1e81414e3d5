"""The pinned llama-server's captured /v1/messages and /v1/responses exchanges
(tests/support/captures/, written by tests/e2e/capture_apis.py): their bodies and chunks."""

from __future__ import annotations

from pathlib import Path

from tests.support.fakeup import response_of
from tests.support.sim_client import parse_chunks

CAPTURES = Path(__file__).resolve().parent / "captures"


def replay_parts(name: str) -> tuple[bytes, list[bytes]]:
    """The capture's head and its body: each chunk as it was framed on the wire, or the
    whole body as one part when it was not chunked."""
    raw = response_of((CAPTURES / name).read_bytes())
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"chunked" not in head.lower():
        return head + b"\r\n\r\n", [body]
    chunks, i = [], 0
    while i < len(body):
        nl = body.index(b"\r\n", i)
        end = nl + 2 + int(body[i:nl], 16) + 2
        chunks.append(body[i:end])
        i = end
    return head + b"\r\n\r\n", chunks


def body_of(name: str) -> bytes:
    """The capture's response body, de-chunked."""
    head, parts = replay_parts(name)
    if b"chunked" not in head.lower():
        return parts[0]
    return b"".join(parse_chunks(b"".join(parts), whole=True))

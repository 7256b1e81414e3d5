"""The messages between the parent and its workers: one Unix socket per worker (a socketpair
made before the worker starts), each message a 4-byte big-endian length and a msgpack array
`[kind, *fields]`.

Worker -> parent (`id`: the worker's own number for the exchange, echoed in the answer):
  ["ready", pid, index]     it serves
  ["slot", id, upstream, timeout_s]                 -> ["slot", id, "ok" | "busy" | "closed", why]
  ["unslot", id]            the waiter left (a granted slot is given back)
  ["free", id]              a granted slot is released
  ["admit", id, admission id, record values, prompt, completion, [upstream, timeout_s,
   slot id] | None]         (the slot asked for with it: answered as ["slot", slot id, ...])
                            -> ["admit", id, "ok" | "exceeded" | "timeout" | "not_durable",
                            details]   (a keyed request's reservation and admission record)
  ["row", record values, admission id | None, trend] a settled request's row (never awaited)
  ["down", upstream, error] / ["up", upstream]      what a request found: the parent's health
                            follows and every worker is told ("health")
  ["view", id, path, target]                        -> ["view", id, status, body, type, headers]
  ["figures", id, pickled Registry]                 the answer to the parent's ["figures", id]
  ["reloaded", id, error | None]                    the answer to ["reload", id, config]
Parent -> worker:
  ["config", config]        the first message: the configuration to run
  ["health", upstream, probe, error]                after every probe and every report
  ["figures", id]           "send your metrics" (pickled: both ends are this same program)
  ["reload", id, config]    switch to this configuration (already applied by the parent)
  ["drain"] / ["hurry"]     stop as SIGTERM does / end the drain now (a second signal)
"""

from __future__ import annotations

import asyncio
import struct

import msgspec

_LEN = struct.Struct(">I")
MAX_MESSAGE = 64 << 20  # a view of many upstreams and keys stays far below

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def frame(message: list) -> bytes:
    body = _encode(message)
    return _LEN.pack(len(body)) + body


class Outbox:
    """One end's messages to the other, written together once per loop pass: a request's
    slot release and its row (or many requests' messages on a busy loop) cost one write."""

    __slots__ = ("_parts", "_writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._parts: list[bytes] = []

    def send(self, message: list) -> None:
        if self._writer.is_closing():
            return
        if not self._parts:
            asyncio.get_running_loop().call_soon(self.flush)
        self._parts.append(frame(message))

    def flush(self) -> None:
        parts, self._parts = self._parts, []
        if parts and not self._writer.is_closing():
            self._writer.write(b"".join(parts))


async def read(reader: asyncio.StreamReader) -> list | None:
    """The next message, or None at the end of the stream (the other process is gone)."""
    try:
        head = await reader.readexactly(4)
        (n,) = _LEN.unpack(head)
        if n > MAX_MESSAGE:
            raise ValueError(f"message of {n} bytes")
        return _decode(await reader.readexactly(n))
    except asyncio.IncompleteReadError:
        return None

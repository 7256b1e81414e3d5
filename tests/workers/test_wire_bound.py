"""The bound on one message of the workers' wire (relay.workers.wire): the 4-byte length says
how much follows; a length over 64 MiB is refused before anything more is read, and a message
of exactly 64 MiB is read whole."""

from __future__ import annotations

import asyncio
import struct

import msgspec
import pytest

from relay.workers import wire

# 64 MiB: 64 << 20, worked out by hand.
BOUND = 67_108_864


def _figures_of(size: int) -> wire.Figures:
    """A message whose msgpack is `size` bytes: a `Figures` whose registry fills the rest."""
    probe = 1 << 20
    overhead = len(msgspec.msgpack.encode(wire.Figures(1, bytes(probe)))) - probe
    message = wire.Figures(1, bytes(size - overhead))
    assert len(msgspec.msgpack.encode(message)) == size
    return message


def test_the_bound_is_64_mib():
    assert wire.MAX_MESSAGE == BOUND


async def test_a_message_at_the_bound_is_read_whole():
    message = _figures_of(BOUND)
    reader = asyncio.StreamReader()
    reader.feed_data(wire.frame(message))
    reader.feed_eof()
    got = await asyncio.wait_for(wire.read(reader, wire.FROM_WORKER), 30)
    assert got == message
    assert await wire.read(reader, wire.FROM_WORKER) is None


async def test_a_length_over_the_bound_is_refused_before_its_body_is_read():
    reader = asyncio.StreamReader()
    # The length, then far fewer bytes than it says: none of them is waited for.
    reader.feed_data(struct.pack(">I", BOUND + 1) + msgspec.msgpack.encode(wire.Ready(1, 0)))
    reader.feed_eof()
    with pytest.raises(ValueError, match=f"message of {BOUND + 1} bytes"):
        await asyncio.wait_for(wire.read(reader, wire.FROM_WORKER), 30)


async def test_a_whole_message_one_byte_over_the_bound_is_refused():
    reader = asyncio.StreamReader()
    reader.feed_data(wire.frame(_figures_of(BOUND + 1)))
    reader.feed_eof()
    with pytest.raises(ValueError, match=f"message of {BOUND + 1} bytes"):
        await asyncio.wait_for(wire.read(reader, wire.FROM_WORKER), 30)

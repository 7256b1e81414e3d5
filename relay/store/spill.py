"""Rows that could not reach PostgreSQL, kept in a local file until they can.

One line per row: `<crc32 as 8 hex digits> <JSON array>\\n`, appended and fsync'd. A crash in
the middle of an append leaves a torn last line (no newline, or a checksum that does not
match): reading stops trusting the file there and the next open cuts it off, so only whole
rows are ever replayed. A complete line whose checksum fails (a damaged sector) is skipped
and counted. Replaying is safe to repeat: every row carries its globally unique row id and
the database ignores a row it already has (store.postgres), so a crash between the commit
and `clear()` replays the same rows again without duplicating them.

`encode` / `decode` are pure; `Spill` owns the file (and an exclusive lock on it: one relay
per spill file).
"""

from __future__ import annotations

import fcntl
import os
import zlib
from typing import NamedTuple

import msgspec

from relay.store.schema import Row

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(list)


class SpillLocked(OSError):
    """Another relay process uses this spill file."""


class Decoded(NamedTuple):
    """What a spill file's bytes hold."""

    rows: list[Row]
    # The length of the prefix of whole lines: a torn last line is not part of it.
    whole: int
    # Complete lines skipped because their checksum failed.
    damaged: int


def encode(rows: list[Row]) -> bytes:
    out = []
    for row in rows:
        payload = _enc.encode(list(row))
        out.append(b"%08x %s\n" % (zlib.crc32(payload), payload))
    return b"".join(out)


def decode(data: bytes) -> Decoded:
    """The rows of whole lines. A last line with no newline is torn: it is not a row and not
    part of the prefix."""
    rows: list[Row] = []
    bad = 0
    pos = 0
    while True:
        end = data.find(b"\n", pos)
        if end < 0:
            return Decoded(rows, pos, bad)
        line = data[pos:end]
        pos = end + 1
        if not line:
            continue
        row = _line(line)
        if row is None:
            bad += 1
        else:
            rows.append(row)


def _line(line: bytes) -> Row | None:
    crc, sep, payload = line.partition(b" ")
    if not sep or len(crc) != 8:
        return None
    try:
        if int(crc, 16) != zlib.crc32(payload):
            return None
        return tuple(_dec.decode(payload))
    except (ValueError, msgspec.DecodeError):
        return None


class Spill:
    """The spill file of one relay: `count` rows in it now, `damaged` lines skipped when it
    was opened."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.count = 0
        self.damaged = 0
        # The open, locked file; -1 while it is not open.
        self._fd = -1

    def open(self) -> list[Row]:
        """Lock the file, cut a torn tail, and return the rows it holds."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpillLocked(
                f"store.spill_path {self.path!r} is in use by another relay "
                "process (give each relay its own spill_path)"
            ) from None
        self._fd = fd
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0) if size else b""
        rows, good, self.damaged = decode(data)
        if good != size:
            os.ftruncate(fd, good)
            os.fsync(fd)
        self.count = len(rows)
        return rows

    def read(self) -> list[Row]:
        size = os.fstat(self._fd).st_size
        return decode(os.pread(self._fd, size, 0))[0] if size else []

    def append(self, rows: list[Row]) -> None:
        """Write the rows and fsync: once this returns they survive a crash."""
        data = encode(rows)
        off = os.fstat(self._fd).st_size
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, off)
            view, off = view[n:], off + n
        os.fsync(self._fd)
        self.count += len(rows)

    def clear(self) -> None:
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)
        self.count = 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

"""A service manager's notification socket, bound as systemd binds its own: AF_UNIX datagrams
read with the sender's credentials (SO_PASSCRED), at a path or at a Linux abstract name."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

# struct ucred: pid, uid, gid.
_UCRED = struct.Struct("iII")


@dataclass(frozen=True)
class Note:
    """One datagram: its assignments, and the process that sent it."""

    fields: dict[str, str]
    pid: int

    @property
    def state(self) -> str | None:
        """READY, RELOADING or STOPPING (whichever is `=1`), or None: a status alone."""
        on = [k for k in ("READY", "RELOADING", "STOPPING") if self.fields.get(k) == "1"]
        assert len(on) <= 1, self.fields
        return on[0] if on else None


class ManagerSocket:
    """Bound at `kind` "path" (a socket file in a short temporary folder: a socket path has a
    108-byte bound) or "abstract" (a unique `@name`); `env` is what `$NOTIFY_SOCKET` says;
    `seen`: every datagram read so far."""

    def __init__(self, kind: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._dir: tempfile.TemporaryDirectory | None = None
        if kind == "path":
            self._dir = tempfile.TemporaryDirectory(prefix="relay-notify-")
            self.env = str(Path(self._dir.name) / "notify")
            self.sock.bind(self.env)
        else:
            name = f"relay-test-{os.getpid()}-{uuid.uuid4().hex}"
            self.env = "@" + name
            self.sock.bind("\0" + name)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.setblocking(False)
        self.seen: list[Note] = []

    def _read(self) -> Note:
        data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(_UCRED.size))
        pid = 0
        for level, kind, cred in ancillary:
            if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS):
                pid = _UCRED.unpack(cred[: _UCRED.size])[0]
        fields = dict(line.split("=", 1) for line in data.decode().split("\n") if line)
        self.seen.append(Note(fields, pid))
        return self.seen[-1]

    async def next(self, timeout: float) -> Note:
        """The next datagram, waited for up to `timeout` seconds."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            try:
                return self._read()
            except BlockingIOError:
                pass
            readable = loop.create_future()
            loop.add_reader(self.sock, _set, readable)
            try:
                await asyncio.wait_for(readable, max(0.0, end - loop.time()))
            finally:
                loop.remove_reader(self.sock)

    def pending(self) -> list[Note]:
        """The datagrams already there, none waited for."""
        notes = []
        while True:
            try:
                notes.append(self._read())
            except BlockingIOError:
                return notes

    def close(self) -> None:
        self.sock.close()
        if self._dir is not None:
            self._dir.cleanup()


def _set(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)

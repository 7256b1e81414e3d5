"""systemd's notification protocol (sd_notify(3)) without libsystemd: `Type=notify` units.

A service manager that starts the relay with `Type=notify` (or `Type=notify-reload`) sets
`$NOTIFY_SOCKET` to an AF_UNIX datagram socket: a path (`/run/systemd/notify`), or a Linux
abstract name written with a leading `@`. Each notification is one datagram of
newline-separated assignments. `relay serve` sends `READY=1` once it serves (with `--workers
N`: once every worker serves), `RELOADING=1` with `MONOTONIC_USEC=` (what
`Type=notify-reload` needs, systemd 253 on; older ones ignore it) then `READY=1` around each
SIGHUP reload, applied or refused, and `STOPPING=1` when the drain begins; each with a
`STATUS=` line, which `systemctl status` shows.

Without `$NOTIFY_SOCKET` nothing is sent. The variable is taken out of the environment when
it is read, as sd_notify's `unset_environment` does: worker processes never inherit it, so
only the process the manager started notifies (`NotifyAccess=main`, the default, would
ignore any other). A notification that cannot be sent is logged once (`notify_failed`) and
never raised: the relay serves whether the manager hears it or not. `vsock:` addresses (a
virtual machine's manager on its host) are not spoken: logged at start, nothing sent.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import MutableMapping, Sequence
from enum import StrEnum

from relay.observe.log import Log

ENV = "NOTIFY_SOCKET"
# systemd reads a notification into a PIPE_BUF (4096 bytes) buffer and drops a longer one
# whole: the status line is cut well below it.
STATUS_MAX_BYTES = 1024
# A manager that takes no datagram for this long (its queue full) holds the relay's loop no
# longer: the kernel's send timeout (SO_SNDTIMEO, a struct timeval), slept, not polled.
SEND_TIMEOUT_S = 1
_SEND_TIMEOUT = struct.pack("@ll", SEND_TIMEOUT_S, 0)


class State(StrEnum):
    """What a notification tells the manager, sent as `<state>=1`."""

    READY = "READY"
    RELOADING = "RELOADING"
    STOPPING = "STOPPING"


def address(value: str) -> str | None:
    """The socket address `$NOTIFY_SOCKET` names: a path as it is, an abstract name (`@name`)
    with a NUL byte in place of the `@`; None for what is not an AF_UNIX address (`vsock:`)."""
    if value.startswith("/"):
        return value
    if value.startswith("@"):
        return "\0" + value[1:]
    return None


def status_line(text: str) -> str:
    """`text` as one `STATUS=` value: on one line (every run of whitespace, newlines included,
    one space) and at most `STATUS_MAX_BYTES` of UTF-8, cut between characters."""
    flat = " ".join(text.split()).encode("utf-8", "replace")
    return flat[:STATUS_MAX_BYTES].decode("utf-8", "ignore")


def message(state: State | None, status: str, monotonic_usec: int) -> bytes:
    """One notification: the state (None: the status alone), `MONOTONIC_USEC=` with
    `RELOADING=1` (the manager orders a reload by it), and the status line."""
    lines = [] if state is None else [f"{state}=1"]
    if state is State.RELOADING:
        lines.append(f"MONOTONIC_USEC={monotonic_usec}")
    lines.append(f"STATUS={status_line(status)}")
    return "\n".join(lines).encode()


def serving_status(upstreams: Sequence[str], host: str, port: int, workers: int) -> str:
    """What a serving relay says of itself: its upstreams, where it listens, its workers."""
    where = f"[{host}]" if ":" in host else host or "*"
    ups = f"{len(upstreams)} upstream{'' if len(upstreams) == 1 else 's'}"
    text = f"serving {ups} ({', '.join(upstreams)}) on {where}:{port}"
    return text if workers <= 1 else f"{text} with {workers} workers"


class Notifier:
    """The manager's notification socket, or none (then every `send` does nothing). Once
    `STOPPING=1` is sent, no other state is: a reload that ends during the drain does not
    tell the manager the relay is ready again."""

    def __init__(self, target: str | None, log: Log) -> None:
        self.target = target
        self.log = log
        self.stopping = False
        self._failed = False

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str], log: Log) -> Notifier:
        """The socket `environ` names, the variable taken out of it (no child inherits it)."""
        value = environ.pop(ENV, "")
        target = address(value) if value else None
        if value and target is None:
            log.event(
                "notify_unsupported",
                notify_socket=value,
                note="not an AF_UNIX socket (a path or @name): no notification is sent",
            )
        return cls(target, log)

    def send(self, state: State | None, status: str) -> None:
        """Tell the manager `state` (None: the status alone) and `status`; never raises."""
        if self.target is None or (self.stopping and state is not None):
            return
        if state is State.STOPPING:
            self.stopping = True
        data = message(state, status, time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _SEND_TIMEOUT)
                sock.sendto(data, self.target)
        except (OSError, ValueError) as exc:
            if not self._failed:
                self._failed = True
                self.log.event(
                    "notify_failed", state=state, error=f"{type(exc).__name__}: {exc}"[:300]
                )

"""Upstream state: ready / serving / loading / down, from a light /health probe and from
what requests see (a refused connect marks an upstream down at once).

While an upstream is down, requests fail fast (no connect timeout paid per request), and the
probe runs every `down_probe_interval_s` instead of `health_interval_s`: an upstream that
answers again serves within that interval, not after the next regular probe."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from relay.http.tls import describe
from relay.observe.metrics import UpstreamState

READY, SERVING, LOADING, DOWN = UpstreamState


class Health:
    def __init__(self) -> None:
        # READY (it answers), LOADING (503 on /health) or DOWN.
        self.probe = READY
        self.last_error = ""
        # Called when a request finds the upstream down (it wakes the probe), and when a
        # request got an answer from it while it was down.
        self.on_down: Callable[[], object] | None = None
        self.on_up: Callable[[], object] | None = None
        # Whether probes run (`health_interval_s` > 0): only then is a down upstream passed
        # by, since only a probe would see it come back.
        self.probing = False
        # Called after each change of `probe` (the slots hand a member's free slots on when
        # it is back, the pool's table forgets a member that went down).
        self.on_change: Callable[[], object] | None = None

    def usable(self) -> bool:
        """Whether requests may go to it now: not while probes know it is down."""
        return self.probe != DOWN or not self.probing

    def probe_delay(self, interval_s: float, down_interval_s: float) -> float:
        """Seconds until the next probe: sooner while down, to see it come back."""
        return min(interval_s, down_interval_s) if self.probe == DOWN else interval_s

    def state(self, in_flight: int) -> UpstreamState:
        if self.probe != READY:
            return self.probe
        return SERVING if in_flight else READY

    def probed(self, status: int | None, error: str = "") -> None:
        """One probe result: a status line, or None when no answer came."""
        was = self.probe
        if status is None:
            self.probe, self.last_error = DOWN, error
        elif status == 503:
            self.probe = LOADING
        else:
            # Any answer means the server is there (a server without /health gives 404).
            self.probe, self.last_error = READY, ""
        if self.probe != was and self.on_change is not None:
            self.on_change()

    def connect_failed(self, error: str) -> None:
        was, self.probe, self.last_error = self.probe, DOWN, error
        if was != DOWN:
            if self.on_change is not None:
                self.on_change()
            if self.on_down is not None:
                self.on_down()

    def answered(self) -> None:
        if self.probe == DOWN:
            self.probe, self.last_error = READY, ""
            if self.on_change is not None:
                self.on_change()
            if self.on_up is not None:
                self.on_up()


async def probe_once(
    host: str,
    port: int,
    host_header: bytes,
    timeout: float,
    tls: ssl.SSLContext | None = None,
    path: bytes = b"/health",
) -> tuple[int | None, str]:
    """GET /health (under the URL's path prefix; over TLS for an https upstream): (status
    code, ""), or (None, why) on connect failure / TLS failure / timeout / garbage."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                host, port, ssl=tls, server_hostname=host if tls is not None else None
            ),
            timeout,
        )
        writer.write(
            b"GET "
            + path
            + b" HTTP/1.1\r\nHost: "
            + host_header
            + b"\r\nUser-Agent: relay-health\r\nConnection: close\r\n\r\n"
        )
        line = await asyncio.wait_for(reader.readline(), timeout)
        parts = line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            return None, "no answer to GET /health"
        return int(parts[1]), ""
    except ssl.SSLError as exc:
        return None, f"TLS handshake failed: {describe(exc)}"
    except (OSError, TimeoutError, ValueError):
        return None, "no answer to GET /health"
    finally:
        if writer is not None:
            writer.close()

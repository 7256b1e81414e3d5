"""Upstream state: unknown / ready / serving / loading / down, from a light /health probe and
from what requests see (a refused connect marks an upstream down at once).

An upstream is `unknown` until the first probe answers, or, without probes, until a request
finds it up or down: an upstream never seen up is never said to have been ready.

While an upstream is down, requests fail fast (no connect timeout paid per request), and the
probe runs every `down_probe_interval_s` instead of `health_interval_s`: an upstream that
answers again serves within that interval, not after the next regular probe.

Each change of state is told once, as a `Change`, to `on_change` (the process logs it, and a
worker tells its parent): a hundred requests that find an upstream down make one change, and
its recovery another."""

from __future__ import annotations

import asyncio
import enum
import ssl
import time
from collections.abc import Callable

import msgspec

from relay.http.tls import describe
from relay.observe.metrics import UpstreamState

READY, SERVING, LOADING, DOWN, UNKNOWN = UpstreamState


class Seen(enum.StrEnum):
    """What saw a change: the probe, or a request (a refused connect, an answer)."""

    PROBE = "probe"
    REQUEST = "request"


class Change(msgspec.Struct, frozen=True):
    """An upstream's state changed: from `was` to `now`, seen `by` the probe (`status`: its
    answer's status, None when none came) or a request; `error`: why it is down."""

    was: UpstreamState
    now: UpstreamState
    by: Seen
    error: str = ""
    status: int | None = None


class Health:
    def __init__(self) -> None:
        # UNKNOWN (not seen yet), READY (it answers), LOADING (503 on /health) or DOWN.
        self.probe = UNKNOWN
        self.last_error = ""
        # Unix time of the last change of `probe` (the start, until one).
        self.since = time.time()
        # The last probe: its unix time and status (None: no answer), None before the first.
        self.probed_at: float | None = None
        self.probe_status: int | None = None
        # Told each change of state (`Change`).
        self.on_change: Callable[[Change], object] | None = None
        # Called when a request finds the upstream down: it wakes the probe.
        self.on_down: Callable[[], object] | None = None
        # Whether probes run (`health_interval_s` > 0): only then is a down upstream passed
        # by, since only a probe would see it come back.
        self.probing = False

    def usable(self) -> bool:
        """Whether requests may go to it now: not while probes know it is down."""
        return self.probe is not DOWN or not self.probing

    def probe_delay(self, interval_s: float, down_interval_s: float) -> float:
        """Seconds until the next probe: sooner while down, to see it come back."""
        return min(interval_s, down_interval_s) if self.probe == DOWN else interval_s

    def state(self, in_flight: int) -> UpstreamState:
        probe = self.probe
        if probe is READY or probe is UNKNOWN:
            return SERVING if in_flight else probe
        return probe

    def probed(self, status: int | None, error: str = "") -> None:
        """One probe result: a status line, or None when no answer came."""
        self.probed_at, self.probe_status = time.time(), status
        if status is None:
            self._become(DOWN, Seen.PROBE, error, status)
        elif status == 503:
            self._become(LOADING, Seen.PROBE, "", status)
        else:
            # Any answer means the server is there (a server without /health gives 404).
            self._become(READY, Seen.PROBE, "", status)

    def connect_failed(self, error: str) -> None:
        """A request could not connect: down now (once; the probe is woken)."""
        if self._become(DOWN, Seen.REQUEST, error) and self.on_down is not None:
            self.on_down()

    def answered(self) -> None:
        """A request got a response head: an upstream down or not seen yet is up."""
        if self.probe is DOWN or self.probe is UNKNOWN:
            self._become(READY, Seen.REQUEST)

    def _become(
        self, now: UpstreamState, by: Seen, error: str = "", status: int | None = None
    ) -> bool:
        """Set the state (and the error, whether or not it changed); whether it changed."""
        was = self.probe
        self.probe, self.last_error = now, error
        if now is was:
            return False
        self.since = time.time()
        if self.on_change is not None:
            self.on_change(Change(was, now, by, error, status))
        return True


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
    except TimeoutError:
        return None, f"no answer to GET /health within {timeout}s"
    except OSError as exc:
        return None, f"no answer to GET /health: {exc.strerror or exc}"
    except ValueError:
        return None, "no answer to GET /health"
    finally:
        if writer is not None:
            writer.close()

"""Child processes for the benchmark: start, wait until ready, CPU/RSS, stop.

Every process is started in its own session (so Ctrl-C in the terminal
reaches only the benchmark, which then stops them in order) with stdout and
stderr going to files in a temp dir (never an unread pipe that could fill up
and stall the child).  All started processes are kept in a registry so that
``stop_all()`` can end them even on error.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
NOFILE = 65536

_registry: list[Proc] = []


def raise_nofile(n: int = NOFILE) -> None:
    """Raise RLIMIT_NOFILE (soft and, if allowed, hard) to at least ``n``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(n, soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Proc:
    """One child process (and its descendants, e.g. nginx workers)."""

    def __init__(self, name: str, argv: list[str], logdir: Path, env: dict | None = None):
        self.name = name
        self.argv = argv
        self.out_path = logdir / f"{name}.out"
        self.err_path = logdir / f"{name}.err"
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.setdefault("PYTHONFAULTHANDLER", "1")  # a crash leaves a trace in .err
        full_env.update(env or {})
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=str(logdir),
                env=full_env,
                start_new_session=True,
                preexec_fn=raise_nofile,
            )
        self.pid = self.popen.pid
        _registry.append(self)

    # -- readiness -------------------------------------------------------
    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}: {self.tail()}")

    def tail(self, n: int = 1500) -> str:
        text = ""
        for p in (self.err_path, self.out_path):
            try:
                text += p.read_bytes()[-n:].decode("utf-8", "replace")
            except OSError:
                pass
        return text.strip()

    def wait_json_event(self, event: str, timeout: float = 20.0) -> dict:
        """Wait for a JSON line ``{"event": event, ...}`` on stdout or stderr."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in (self.out_path, self.err_path):
                for line in p.read_bytes().splitlines():
                    if event.encode() in line:
                        try:
                            obj = json.loads(line)
                        except ValueError:
                            continue
                        if obj.get("event") == event:
                            return obj
            self.check_alive()
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: no {event!r} line in {timeout}s: {self.tail()}")

    def wait_http(
        self,
        host: str,
        port: int,
        path: str = "/health",
        timeout: float = 20.0,
        need_ok: bool = True,
    ) -> None:
        """Poll TCP connect + ``GET path`` until a response (2xx if need_ok)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                status = http_get_status(host, port, path)
                if not need_ok or 200 <= status < 300:
                    return
                last = f"status {status}"
            except OSError as e:
                last = repr(e)
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: not ready on {host}:{port}{path} ({last}): {self.tail()}")

    # -- measurements ----------------------------------------------------
    def pids(self) -> list[int]:
        return [self.pid] + descendants(self.pid)

    def cpu_us(self) -> float:
        return sum(cpu_us(p) for p in self.pids())

    def hwm_kb(self) -> int:
        return sum(status_kb(p, "VmHWM") for p in self.pids())

    # -- stop --------------------------------------------------------------
    def stop(self, timeout: float = 5.0) -> None:
        if self.popen.poll() is None:
            _killpg(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Kill whatever is left in the session (workers, stragglers).
        _killpg(self.pid, signal.SIGKILL)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        if self in _registry:
            _registry.remove(self)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all() -> None:
    for p in reversed(list(_registry)):
        try:
            p.stop()
        except Exception as e:  # keep stopping the others
            print(f"bench: stopping {p.name}: {e!r}", file=sys.stderr)


def http_get_status(host: str, port: int, path: str, timeout: float = 2.0) -> int:
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()
        )
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    parts = data.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ConnectionError(f"bad response {data[:80]!r}")
    return int(parts[1])


def wait_tcp(host: str, port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# -- /proc helpers ----------------------------------------------------------
def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    return data[data.rindex(")") + 2 :].split()  # fields from #3 (state) on


def cpu_us(pid: int) -> float:
    """utime+stime of ``pid`` in microseconds (0 if it is gone)."""
    try:
        f = _stat_fields(pid)
    except (OSError, ValueError):
        return 0.0
    return (int(f[11]) + int(f[12])) * 1e6 / CLK_TCK  # fields 14, 15


def system_busy_us() -> float:
    """Busy CPU time of the whole machine (all cores) from /proc/stat, in µs."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = sum(v[:8]) - v[3] - v[4]  # user..steal minus idle, iowait
    return busy * 1e6 / CLK_TCK


def status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(name))[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out

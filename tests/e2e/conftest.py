"""e2e fixtures: real llama-servers on the tiny deterministic model.

`llama_server` is the reference build (the pinned llama.cpp the simulator and the fixtures
follow): use it for anything that compares with the simulator or asserts version-specific
server behaviour. `llama_any` is parametrized over every build that runs on this machine,
reference first (`[pinned]`, then e.g. `[skulk]` on AVX-512 CPUs): use it for the relay's own
promises, which must hold in front of any llama-server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .llama_server import Build, LlamaServer, builds, start_or_fail

_E2E_DIR = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: end-to-end test against a real llama-server (tests/e2e)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _E2E_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


def _serve(build: Build) -> Iterator[LlamaServer]:
    t0 = time.monotonic()
    srv = start_or_fail(binary=build.binary)
    print(
        f"\n[e2e] llama-server [{build.name}] {srv.binary} on {srv.url} ready in "
        f"{time.monotonic() - t0:.2f}s (log: {srv.log_path})"
    )
    try:
        yield srv
    finally:
        srv.cleanup()


_BUILDS = builds()


@pytest.fixture(scope="session")
def llama_server() -> Iterator[LlamaServer]:
    """The reference llama-server (fails under CI=true if it cannot start; skips otherwise)."""
    yield from _serve(_BUILDS[0])


@pytest.fixture(scope="session", params=_BUILDS, ids=[b.name for b in _BUILDS])
def llama_build(request) -> Build:
    """Each llama-server build that runs on this machine, the reference first."""
    return request.param


@pytest.fixture(scope="session")
def llama_any(llama_build: Build, llama_server: LlamaServer) -> Iterator[LlamaServer]:
    """A running llama-server of `llama_build` (the reference one is shared)."""
    if llama_build is _BUILDS[0]:
        yield llama_server
    else:
        yield from _serve(llama_build)

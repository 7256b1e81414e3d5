"""e2e fixtures: a session-scoped real llama-server on the tiny deterministic model."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .llama_server import LlamaServer, start_or_fail

_E2E_DIR = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: end-to-end test against a real llama-server (tests/e2e)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _E2E_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def llama_server() -> Iterator[LlamaServer]:
    """A running llama-server (fails under CI=true if it cannot start; skips otherwise)."""
    t0 = time.monotonic()
    srv = start_or_fail()
    print(f"\n[e2e] llama-server {srv.binary} on {srv.url} ready in {time.monotonic() - t0:.2f}s"
          f" (log: {srv.log_path})")
    try:
        yield srv
    finally:
        srv.cleanup()

"""Where the shared material lies: `shared/` stands beside the repository (CI copies it there).

The captured llama-server exchanges (`*.http`) are not in this repository: they sit in
`../shared/fixtures/llama-server/` (or `$LLAMA_FIXTURES`). A test that reads them asks for the
`llama_fixtures` fixture (tests/conftest.py), e.g. through `@needs_fixtures`: without the folder
it skips saying where the captures come from, and fails under CI=true.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.support.need import missing

ROOT = Path(__file__).resolve().parents[2]  # the repository
FIXTURES = Path(
    os.environ.get("LLAMA_FIXTURES", ROOT.parent / "shared" / "fixtures" / "llama-server")
)
FIXTURES_MISSING = (
    f"needs the captured llama-server fixtures, not found at {FIXTURES}: they come from the "
    "shared/ folder beside the repository (../shared/fixtures/llama-server, which CI copies "
    "there); or set LLAMA_FIXTURES to their folder"
)

needs_fixtures = pytest.mark.usefixtures("llama_fixtures")


def need_fixtures() -> Path:
    """The captures' folder; absent: skip naming where it comes from (fail under CI=true)."""
    if not FIXTURES.is_dir():
        missing(FIXTURES_MISSING)
    return FIXTURES


def captured(names: Iterable[str]) -> list[str]:
    """Parameters taken from the capture files found at collection: `names` sorted, or one
    placeholder when the folder is absent (the test, `@needs_fixtures`, then skips)."""
    return sorted(names) if FIXTURES.is_dir() else ["no-fixtures"]

"""The captured llama-server chat/completions exchanges, kept in the repository.

They lie in `tests/support/captures/llama-server/` (its README.md says how they were recorded),
beside the Messages and Responses captures of `tests/support/captures/`. Every test reads them
from there: nothing is looked for outside the repository, so no clone skips them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "captures" / "llama-server"


def captured(names: Iterable[str]) -> list[str]:
    """Parameters taken from the capture files, sorted. None found is an error at collection
    (an empty parameter list would skip the test without a word)."""
    found = sorted(names)
    if not found:
        raise FileNotFoundError(f"no llama-server captures found in {FIXTURES}")
    return found

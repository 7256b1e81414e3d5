"""What a test needs from outside the `test` extra: skip naming it, or fail under CI=true.

A plain `pip install -e '.[test]'` runs every test it can and skips the rest, each skip naming
what is missing (an extra, a server binary, Chromium, the captured fixtures). CI installs all
of it (.ci/run), so there a missing piece is a failure, never a quiet skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing(reason: str) -> NoReturn:
    """Skip the test (or the whole module, at import) for `reason`; under CI=true, fail."""
    if in_ci():
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def extra_hint(extra: str) -> str:
    return f"needs the {extra} extra: pip install -e '.[{extra}]'"


def need_extra(extra: str, module: str) -> ModuleType:
    """`module`, which only the optional `extra` installs; missing: skip naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing(f"{extra_hint(extra)} ({exc})")

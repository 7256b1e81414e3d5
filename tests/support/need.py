"""What a test needs from outside the `test` extra: skip naming it, or fail under CI=true.

A plain `pip install -e '.[test]'` runs every test it can and skips the rest, each skip naming
what is missing (an extra, a server binary, Chromium, a non-loopback address). CI installs all
of it (.ci/run), so there a missing piece is a failure, never a quiet skip. Tests skip only
through these helpers (tests/test_habits.py holds it); `opted_in` alone skips under CI too,
for a test run on demand.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
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


def opted_in(var: str, what: str) -> Path:
    """The executable `$var` names, for a test run only on demand (a tool too big for any
    extra). Unset or absent: skip naming the variable, also under CI=true, which does not opt
    in: this is the one skip CI keeps, and its reason says how to run the test."""
    value = os.environ.get(var, "")
    if not value or not Path(value).exists():
        pytest.skip(f"on demand: set {var} to {what}")
    return Path(value)


def extra_hint(extra: str) -> str:
    return f"needs the {extra} extra: pip install -e '.[{extra}]'"


def need_extra(extra: str, module: str) -> ModuleType:
    """`module`, which only the optional `extra` installs; missing: skip naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing(f"{extra_hint(extra)} ({exc})")


def need_own_address() -> str:
    """This machine's non-loopback IPv4 address (`sockets.OWN`), to be a peer from elsewhere;
    none: skip saying so (fail under CI=true)."""
    from tests.support.sockets import OWN

    if OWN is None:
        missing("needs a non-loopback IPv4 address on this machine (a route off loopback)")
    return OWN

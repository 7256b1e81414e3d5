"""The package's shape holds: the layer contracts (import-linter), no import circles, function
size within ruff's bounds, few end-of-line comments. Each rule is shown able to fail, on a
copy of the package with the rule broken on purpose."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support import layout

ROOT = layout.ROOT
LINT = "import sys; from importlinter.cli import lint_imports_command; lint_imports_command()"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package at `root` (its pyproject.toml's contracts). Run with
    `-S` and the installed packages on PYTHONPATH: the editable install's import hook (a
    site .pth) would otherwise find the working tree's `relay` instead of the copy."""
    env = {"PYTHONPATH": f"{root}:{sysconfig.get_paths()['purelib']}", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-S", "-c", LINT], cwd=root, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


@pytest.fixture
def copy(tmp_path) -> Path:
    """The package and its contracts, copied to break a rule in."""
    shutil.copytree(
        ROOT / "relay", tmp_path / "relay", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + line + "\n")


def test_the_layer_contracts_are_kept():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 broken." in done.stdout and "BROKEN" not in done.stdout


@pytest.mark.parametrize(
    "module,line,broken",
    [
        # the hot path writing rows (both the layers and the stream contract say no)
        ("stream/sse.py", "from relay.store import schema  # noqa", "relay.stream.sse -> relay.store.schema"),
        ("stream/usage.py", "import sqlite3  # noqa", "relay.stream.usage -> sqlite3"),
        # a lower layer reaching up
        ("http/chunked.py", "from relay.policy import cors  # noqa", "relay.http.chunked -> relay.policy.cors"),
        ("store/spill.py", "from relay.proxy import slots  # noqa", "relay.store.spill -> relay.proxy.slots"),
        # independent siblings
        ("config.py", "from relay.stream import sse  # noqa", "relay.config -> relay.stream.sse"),
        # the simulator, from the product and into it
        ("proxy/health.py", "from relay.sim import wire  # noqa", "relay.proxy.health -> relay.sim.wire"),
        ("sim/wire.py", "from relay import errors  # noqa", "relay.sim.wire -> relay.errors"),
    ],
)  # fmt: skip
def test_a_broken_contract_fails_lint_imports(copy, module, line, broken):
    append(copy / "relay" / module, line)
    done = lint_imports(copy)
    assert done.returncode == 1, done.stdout + done.stderr
    assert broken in done.stdout


def test_no_import_circles_in_the_package():
    assert layout.cycles(layout.import_graph()) == []


def test_an_import_circle_is_found(copy):
    # (inside a function too: an import anywhere in a module counts)
    append(
        copy / "relay" / "http" / "chunked.py",
        "def _f():\n    from relay.http import fields  # noqa",
    )
    append(copy / "relay" / "http" / "fields.py", "from relay.http import chunked  # noqa")
    found = layout.cycles(layout.import_graph(copy / "relay"))
    assert found == [["relay.http.chunked", "relay.http.fields"]]


def ruff_size_rules(root: Path) -> subprocess.CompletedProcess:
    """ruff's function-size rules (complexity, branches, statements) on the package at `root`,
    as its pyproject.toml bounds them."""
    ruff = Path(sys.executable).with_name("ruff")
    return subprocess.run(
        [str(ruff), "check", "--select", "C901,PLR0912,PLR0915", "--no-cache", "relay"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_functions_are_within_the_size_rules():
    done = ruff_size_rules(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_function_over_the_size_rules_is_found(copy):
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(20))
    append(copy / "relay" / "errors.py", f"def _many(x: int) -> int:\n{branches}    return -1")
    done = ruff_size_rules(copy)
    assert done.returncode == 1
    assert "C901" in done.stdout and "PLR0912" in done.stdout and "`_many`" in done.stdout


def test_few_end_of_line_comments():
    assert layout.per_100(layout.eol_comments()) <= layout.MAX_EOL_PER_100


def test_end_of_line_comments_are_counted():
    source = '"""Doc\nstring."""\n# above\nx = 1  # beside\ny = (\n    2  # inside\n)\n'
    assert layout.comment_counts(source) == (2, 6)


def test_many_end_of_line_comments_are_found(copy):
    append(copy / "relay" / "errors.py", "".join(f"_x{i} = {i}  # why\n" for i in range(2000)))
    assert layout.per_100(layout.eol_comments(copy / "relay")) > layout.MAX_EOL_PER_100


def test_the_layout_script_lists_what_it_finds():
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.layout"], cwd=ROOT, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines() == [
        "import cycles in relay/: 0",
        f"end-of-line comments per 100 code lines: {layout.per_100(layout.eol_comments())}"
        f" (at most {layout.MAX_EOL_PER_100})",
    ]

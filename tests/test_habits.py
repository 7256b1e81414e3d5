"""The habits of a maintained package, each held by a test: the version written once, a
changelog, the pages of docs/ that code and tests cite exist (and no page outside the
repository is cited), commit subjects of at most 72 characters."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import tomllib

import pytest

import relay
from tests.support.layout import ROOT

# Where a page of docs/ is cited by its path in the repository.
_CITED = re.compile(rb"docs/([a-z_-]+\.md)")
# The commit from which subjects are held to the bound (this rule's own); older ones are not
# rewritten.
_FIRST_HELD = "layout: bound functions by ruff's size rules, not modules by lines"
MAX_SUBJECT = 72


def _sources() -> list:
    return [p for d in ("relay", "tests", "bench") for p in (ROOT / d).rglob("*.py")]


def test_the_version_is_written_once():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert importlib.metadata.version("relay") == relay.__version__
    written = [p for p in _sources() if re.search(rb"^__version__\s*=", p.read_bytes(), re.M)]
    assert [p.relative_to(ROOT).as_posix() for p in written] == ["relay/__init__.py"]


def test_a_changelog_opens_with_what_this_release_holds():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "Keep a Changelog" in text
    heads = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert heads and heads[0] == "Unreleased" and relay.__version__ in heads


def test_the_pages_code_and_tests_cite_exist():
    cited = {
        name.decode()
        for p in _sources() + list((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
        for name in _CITED.findall(p.read_bytes())
    }
    assert cited, "nothing cites docs/"
    missing = sorted(n for n in cited if not (ROOT / "docs" / n).exists())
    assert missing == []


def test_no_page_outside_the_repository_is_cited():
    mine = ROOT / "tests" / "test_habits.py"
    cites = [
        p.relative_to(ROOT).as_posix()
        for p in _sources() + list((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
        if p != mine and b"DESIGN.md" in p.read_bytes()
    ]
    assert cites == []


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout


def test_commit_subjects_are_at_most_72_characters():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    first = _git("log", "--format=%H", "--fixed-strings", f"--grep={_FIRST_HELD}").split()
    if not first:
        pytest.skip("the first commit held to the bound is not in this history (shallow?)")
    subjects = _git("log", "--format=%s", f"{first[-1]}^..HEAD").splitlines()
    long = [s for s in subjects if len(s) > MAX_SUBJECT]
    assert long == []

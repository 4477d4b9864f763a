"""The benchmarks' imports, read with ``ast`` (function-local imports too):
no import cycle within ``benchmarks``, and ``benchmarks/report/`` imports no
measuring module (it renders kept results only)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "benchmarks"


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, name: str, is_package: bool) -> set[str]:
    """Every module of ``benchmarks`` that the source imports, anywhere in
    it (``from benchmarks import x`` counts as ``benchmarks.x``)."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m == "benchmarks" or m.startswith("benchmarks.")}


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (those that exist)."""
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    return {
        name: {
            m
            for m in imports_of(path.read_text(), name, path.name == "__init__.py")
            if m in paths and m != name
        }
        for name, path in paths.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in edges.get(node, ()):
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_there_is_no_import_cycle_within_the_benchmarks() -> None:
    assert cycles(graph()) == []


def test_the_report_imports_only_the_report() -> None:
    outside = {
        name: sorted(m for m in imported if not m.startswith("benchmarks.report"))
        for name, imported in graph().items()
        if name.startswith("benchmarks.report")
    }
    assert {name: found for name, found in outside.items() if found} == {}


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # A cycle hidden in a function, through `from package import module`.
        (
            {
                "a.py": "def f():\n    from benchmarks import b\n",
                "b.py": "from benchmarks.a import f\n",
            },
            [["benchmarks.a", "benchmarks.b"]],
        ),
        # A longer one, through a subpackage and a relative import.
        (
            {
                "a.py": "import benchmarks.sub.c\n",
                "sub/__init__.py": "",
                "sub/c.py": "from ..b import x\n",
                "b.py": "from benchmarks import a\n",
            },
            [["benchmarks.a", "benchmarks.b", "benchmarks.sub.c"]],
        ),
        ({"a.py": "import benchmarks.b\n", "b.py": "import json\n"}, []),
    ],
)
def test_the_check_finds_hidden_cycles(
    tmp_path: Path, files: dict[str, str], expected: list[list[str]]
) -> None:
    package = tmp_path / "benchmarks"
    for name, source in {"__init__.py": "", **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(source)
    assert cycles(graph(package)) == expected

"""Read vLLM's code for the seam checks: imported, or from a source tree.

``seams_check.seam_problems`` asks the same questions of either reader:

* ``LiveSource``: the installed vLLM, imported and inspected (what runs at
  start-up and in the tests);
* ``StaticSource(root)``: the ``.py`` files of a vLLM source tree (``root``
  holds the ``vllm`` package folder), parsed with ``ast`` and never
  imported, so a release that cannot run here (vLLM 0.33 has no CPU build)
  is checked the same way from its unpacked wheel.

Questions: a function's parameter names and source text (a method is found
through the class's bases and through re-exports), and whether a module
defines a name. Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

# How deep re-exports and base classes are followed.
MAX_HOPS = 8


@dataclass(frozen=True)
class Function:
    params: list[str]  # positional parameter names, self/cls included if static
    source: str


class Source(Protocol):
    name: str

    def function(self, module: str, path: str) -> Function | None:
        """``path`` is ``Class.method`` or ``function`` in ``module``."""

    def defines(self, module: str, name: str) -> bool:
        """Whether ``from module import name`` would work."""

    def has_module(self, module: str) -> bool:
        """Whether ``import module`` would work."""


class LiveSource:
    name = "the installed vLLM"

    def function(self, module: str, path: str) -> Function | None:
        try:
            owner: Any = importlib.import_module(module)
            for part in path.split("."):
                owner = getattr(owner, part)
            if isinstance(owner, property) and owner.fget is not None:
                owner = owner.fget
            target = inspect.unwrap(owner)
            params = list(inspect.signature(target).parameters)
            source = inspect.getsource(target)
        except (ImportError, AttributeError, TypeError, OSError):
            return None
        return Function(params, source)

    def defines(self, module: str, name: str) -> bool:
        try:
            imported = importlib.import_module(module)
        except ImportError:
            return False
        return hasattr(imported, name) or self.has_module(f"{module}.{name}")

    def has_module(self, module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ImportError:
            return False


class StaticSource:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not (self.root / "vllm" / "__init__.py").is_file():
            raise FileNotFoundError(f"no vllm package under {self.root}")
        self.name = f"the vLLM source at {self.root}"

    # ----- questions -----------------------------------------------------

    def function(self, module: str, path: str) -> Function | None:
        *owners, name = path.split(".")
        found: tuple[str, ast.AST] | None
        if not owners:
            found = self._top_level(module, name, ast.FunctionDef)
        else:
            (class_name,) = owners  # one level of nesting is all we use
            cls = self._top_level(module, class_name, ast.ClassDef)
            found = self._method(*cls, name) if cls else None
        if found is None:
            return None
        where, node = found
        assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        args = node.args
        params = [a.arg for a in (*args.posonlyargs, *args.args)]
        if args.vararg:
            params.append(args.vararg.arg)
        params += [a.arg for a in args.kwonlyargs]
        source = ast.get_source_segment(self._text(where), node) or ""
        return Function(params, source)

    def defines(self, module: str, name: str) -> bool:
        if self.has_module(f"{module}.{name}"):
            return True
        return self._top_level(module, name, ast.AST) is not None

    def has_module(self, module: str) -> bool:
        return self._path(module) is not None

    # ----- reading ---------------------------------------------------------

    def _path(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def _text(self, module: str) -> str:
        path = self._path(module)
        return path.read_text(encoding="utf-8") if path else ""

    def _tree(self, module: str) -> ast.Module | None:
        return _parse(self._path(module))

    def _top_level(
        self, module: str, name: str, kind: type[ast.AST], hops: int = 0
    ) -> tuple[str, ast.AST] | None:
        """The top-level definition of ``name`` in ``module`` (following
        ``from x import name``), as (defining module, node)."""
        tree = self._tree(module)
        if tree is None or hops > MAX_HOPS:
            return None
        for node in _top_level_nodes(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if node.name == name and isinstance(node, kind):
                    return module, node
            elif isinstance(node, ast.Assign | ast.AnnAssign) and kind is ast.AST:
                targets = (
                    node.targets if isinstance(node, ast.Assign) else [node.target]
                )
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return module, node
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, node, self._path(module))
                        if kind is ast.AST and self._path(f"{source}.{alias.name}"):
                            return source, node
                        return self._top_level(source, alias.name, kind, hops + 1)
            elif (
                isinstance(node, ast.Import)
                and kind is ast.AST
                and any((a.asname or a.name.split(".")[0]) == name for a in node.names)
            ):
                return module, node
        return None

    def _method(
        self, module: str, cls: ast.AST, name: str, hops: int = 0
    ) -> tuple[str, ast.AST] | None:
        assert isinstance(cls, ast.ClassDef)
        for node in cls.body:
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.name == name
            ):
                return module, node
        if hops > MAX_HOPS:
            return None
        for base in cls.bases:
            base_name = base.id if isinstance(base, ast.Name) else None
            if base_name is None:
                continue
            found = self._top_level(module, base_name, ast.ClassDef)
            if found is not None:
                method = self._method(*found, name, hops + 1)
                if method is not None:
                    return method
        return None


@cache
def _parse(path: Path | None) -> ast.Module | None:
    if path is None:
        return None
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _top_level_nodes(tree: ast.Module) -> list[ast.stmt]:
    """Module-level statements, including those under ``if``/``try``."""
    nodes: list[ast.stmt] = []
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        nodes.append(node)
        if isinstance(node, ast.If):
            pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                pending += handler.body
    return nodes


def _absolute(module: str, node: ast.ImportFrom, path: Path | None) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` reads from."""
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if path is None or path.name != "__init__.py":
        package = package[:-1]  # a module's package is its parent
    if node.level > 1:
        package = package[: -(node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


# One vLLM name imported by our code: (module, name); name "" for
# `import module`.
Import = tuple[str, str]


@dataclass(frozen=True)
class ImportNeed:
    """Imports in one file that must resolve: every one of ``options[0]``,
    or (``try: ... except ImportError:``) every one of another option."""

    filename: str
    options: tuple[tuple[Import, ...], ...]

    def describe(self) -> str:
        first = self.options[0]
        names = ", ".join(f"{name or module} from {module}" for module, name in first)
        return f"{self.filename} imports {names}"


def vllm_imports(*folders: str | Path) -> list[ImportNeed]:
    """The vLLM imports of every ``.py`` file under ``folders``."""
    needs: list[ImportNeed] = []
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            _collect(tree.body, str(path.relative_to(folder)), needs)
    return needs


def _collect(body: list[ast.stmt], filename: str, needs: list[ImportNeed]) -> None:
    for node in body:
        if isinstance(node, ast.Try) and any(
            _catches_import_error(handler) for handler in node.handlers
        ):
            options = [_imports_in(node.body)]
            options += [_imports_in(handler.body) for handler in node.handlers]
            if any(options):
                needs.append(ImportNeed(filename, tuple(o for o in options if o)))
            continue
        own = _imports_of(node)
        if own:
            needs.append(ImportNeed(filename, (own,)))
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                _collect([child], filename, needs)


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
        for n in names
    )


def _imports_in(body: list[ast.stmt]) -> tuple[Import, ...]:
    found: list[Import] = []
    for node in body:
        for inner in ast.walk(node):
            if isinstance(inner, ast.stmt):
                found += _imports_of(inner)
    return tuple(found)


def _imports_of(node: ast.stmt) -> tuple[Import, ...]:
    if isinstance(node, ast.ImportFrom) and not node.level and node.module:
        if node.module == "vllm" or node.module.startswith("vllm."):
            return tuple((node.module, a.name) for a in node.names)
    elif isinstance(node, ast.Import):
        return tuple(
            (a.name, "")
            for a in node.names
            if a.name == "vllm" or a.name.startswith("vllm.")
        )
    return ()

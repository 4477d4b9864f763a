"""The store's layers, read from each module's imports (``ast``).

Only ``store/engine.py`` chooses the store's implementation; the leases, the
lease table and the refresher speak ``messages.LeaseStore`` and its types,
so they never import the Redis backend (nor redis itself), and the lease
table is pure: no thread, no clock of its own.
"""

from __future__ import annotations

import ast
from importlib.util import resolve_name
from pathlib import Path

import pytest

import vllm_output_rate.store as store_package

STORE_DIR = Path(store_package.__file__).parent
BACKEND = "vllm_output_rate.store.redis_store"


def imported_modules(module: str) -> set[str]:
    """Every module ``store/<module>.py`` imports, and every module it
    imports a name from (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    path = STORE_DIR / f"{module}.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve within the store package
                base = resolve_name("." * node.level + base, store_package.__name__)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_the_reader_sees_imports_of_every_kind() -> None:
    # The check below must be able to fail: engine.py does import the backend.
    assert BACKEND in imported_modules("engine")
    assert "redis" in imported_modules("redis_store")
    assert "threading" in imported_modules("leases")


@pytest.mark.parametrize(
    "module",
    [
        "messages",
        "lease",
        "lease_table",
        "resume",
        "lease_pacing",
        "leases",
        "posted",
        "refresher",
    ],
)
def test_only_the_start_up_names_the_redis_backend(module: str) -> None:
    imports = imported_modules(module)
    assert BACKEND not in imports
    assert not {name for name in imports if name.startswith(f"{BACKEND}.")}
    assert not {name for name in imports if name.split(".")[0] == "redis"}


@pytest.mark.parametrize("module", ["lease", "lease_table", "resume"])
def test_the_lease_table_is_pure(module: str) -> None:
    imports = imported_modules(module)
    assert not imports & {"threading", "time", "logging", "asyncio"}
    ours = {name for name in imports if name.startswith("vllm_output_rate.")}
    allowed = {
        f"vllm_output_rate.store.{name}"
        for name in ("messages", "settings", "resume", "lease")
    }
    # A module of these, or a name imported from one (not by prefix: the
    # ``leases`` module is not pure).
    assert all(name in allowed or name.rpartition(".")[0] in allowed for name in ours)
    assert module == "resume" or ours

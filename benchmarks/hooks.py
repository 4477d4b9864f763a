"""Benchmark-only ``sitecustomize`` hooks for the processes of one server or
engine (never the package itself).

A hook is a ``sitecustomize.py`` written to its own folder and put first on
that server's PYTHONPATH, so that every Python process of the server (API
server, engine core, model worker) imports it at start-up; it acts only when
its environment variable is set. The PYTHONPATH also carries the checkout
(``checkout.python_path``), so a hook can import ``benchmarks.*`` however the
parent was started.

A hook never breaks interpreter start-up, but it never fails silently
either: each process says on stderr (the server's or engine's log) whether
the hook went in, and ``check_log`` turns a failure into an error of the
benchmark that relied on it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from benchmarks.checkout import python_path

MARKER = "[benchmark hook]"


def hook_source(name: str, env: str, body: str) -> str:
    """Source of a sitecustomize that runs ``body`` when ``env`` is set."""
    return f'''\
import os
import sys

if os.environ.get("{env}"):
    try:
{textwrap.indent(textwrap.dedent(body).strip(), " " * 8)}
    except Exception as exc:  # never break interpreter start-up
        print("{MARKER} {name} NOT installed in pid", os.getpid(), repr(exc),
              file=sys.stderr, flush=True)
    else:
        print("{MARKER} {name} installed in pid", os.getpid(),
              file=sys.stderr, flush=True)
'''


def install(hook_dir: Path, source: str) -> str:
    """Write ``source`` as ``hook_dir/sitecustomize.py`` and return the
    PYTHONPATH that puts it first (then the checkout, then the caller's)."""
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(source)
    return python_path(first=hook_dir)


def check_log(log_path: Path, name: str) -> int:
    """Raise if the log says that hook ``name`` failed in some process or
    never ran; else return how many processes installed it."""
    installed = 0
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError as exc:
        raise RuntimeError(f"hook {name}: cannot read {log_path}: {exc}") from exc
    for line in lines:
        if f"{MARKER} {name} NOT installed" in line:
            raise RuntimeError(f"benchmark hook failed ({log_path}): {line}")
        if f"{MARKER} {name} installed" in line:
            installed += 1
    if not installed:
        raise RuntimeError(
            f"benchmark hook {name} did not run in any process ({log_path}): is "
            "its folder first on the PYTHONPATH?"
        )
    return installed

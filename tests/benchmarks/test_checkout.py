"""What the benchmarks need from the checkout they run from."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import checkout

HERE = Path(__file__).resolve()


def _project(folder: Path, name: str = checkout.PROJECT) -> Path:
    """A folder laid out like a checkout: pyproject.toml, benchmarks/, tests/harness."""
    (folder / "benchmarks").mkdir(parents=True)
    (folder / "tests" / "harness").mkdir(parents=True)
    (folder / "pyproject.toml").write_text(
        f'[build-system]\nrequires = ["setuptools"]\n\n[project]\nname = "{name}"\n'
    )
    return folder


def test_the_root_is_the_checkout_that_holds_benchmarks() -> None:
    root = checkout.repo_root()
    assert root == HERE.parents[2]
    assert (root / "benchmarks" / "checkout.py").is_file()


def test_outside_a_checkout_the_error_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    with pytest.raises(checkout.NotACheckout, match="run `make bench` at its top"):
        checkout.repo_root(tmp_path / "benchmarks")
    _project(tmp_path / "other", name="someone-else")
    with pytest.raises(checkout.NotACheckout, match="belongs to 'someone-else'"):
        checkout.repo_root(tmp_path / "other" / "benchmarks")
    incomplete = _project(tmp_path / "incomplete")
    (incomplete / "tests" / "harness").rmdir()
    with pytest.raises(checkout.NotACheckout, match="no tests/harness"):
        checkout.repo_root(incomplete / "benchmarks")
    assert (
        checkout.repo_root(_project(tmp_path / "ok") / "benchmarks") == tmp_path / "ok"
    )


def test_commit_names_head_and_uncommitted_changes(tmp_path: Path) -> None:
    root = _project(tmp_path / "repo")
    assert checkout.commit(root).startswith("unknown (")  # not a git work tree
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    for args in (["init", "-q"], ["add", "pyproject.toml"], ["commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=root, env=env, check=True)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert checkout.commit(root) == head
    (root / "pyproject.toml").write_text("changed\n")
    assert checkout.commit(root) == f"{head} + uncommitted changes"


def test_a_child_python_path_puts_the_hook_first_then_the_checkout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = checkout.repo_root()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), "/somewhere"]))
    path = checkout.python_path(first=tmp_path).split(os.pathsep)
    assert path == [str(tmp_path), str(root), str(root / "tests"), "/somewhere"]
    monkeypatch.delenv("PYTHONPATH")
    assert checkout.python_path().split(os.pathsep) == [str(root), str(root / "tests")]

"""The results kept in the repository, from which BENCHMARKS.md is made.

* ``latest.json``: per section, the latest run that measured it: that run's
  ``run`` (date, commit, command, quick, machine, versions, engine flags),
  and its ``results`` or the ``error`` it stopped with, the seconds it took
  and the cores the rest of the machine used meanwhile. A partial run
  (``--only``) replaces its sections' entries and keeps the others.
* ``history.json``: one row per run that was not ``--quick``: date, commit,
  the sections it measured and their headline ratios
  (``report.history.row``). The first rows were converted from the
  hand-kept history that came before; they leave empty what it did not say.

Both files are written one section or one row a line, so a run's change to
them reads as a diff of the lines it measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).with_name("results")
LATEST, HISTORY = "latest.json", "history.json"


def load_latest(folder: Path) -> dict[str, Any]:
    """Section name -> its latest entry (empty before the first run)."""
    path = folder / LATEST
    if not path.exists():
        return {}
    sections: dict[str, Any] = json.loads(path.read_text())["sections"]
    return sections


def update_latest(
    sections: dict[str, Any], run: dict[str, Any], outcomes: dict[str, Any]
) -> dict[str, Any]:
    """``sections`` with each measured section's entry replaced."""
    return {**sections, **{name: {"run": run, **o} for name, o in outcomes.items()}}


def save_latest(folder: Path, sections: dict[str, Any]) -> None:
    lines = [
        f"  {json.dumps(name)}: {json.dumps(entry, sort_keys=True)}"
        for name, entry in sections.items()
    ]
    body = ",\n".join(lines)
    _write(folder / LATEST, '{"sections": {\n' + body + "\n}}\n")


def load_history(folder: Path) -> list[dict[str, Any]]:
    path = folder / HISTORY
    rows: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    return rows


def save_history(folder: Path, rows: list[dict[str, Any]]) -> None:
    body = ",\n".join(f"  {json.dumps(row)}" for row in rows)
    _write(folder / HISTORY, "[\n" + body + "\n]\n")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(text)
    path.with_suffix(".tmp").replace(path)

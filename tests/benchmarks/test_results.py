"""The kept results and the report made from them (``python -m benchmarks``
with the measuring loop replaced by canned outcomes: nothing is measured
here; a real run's results are ``data/latest_quick.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import results, suite
from benchmarks.__main__ import main
from benchmarks.report import document, history

QUICK = Path(__file__).with_name("data") / "latest_quick.json"


@pytest.fixture
def quick_run() -> dict[str, Any]:
    """A real ``--quick`` run's kept results: section -> entry."""
    sections: dict[str, Any] = json.loads(QUICK.read_text())["sections"]
    return sections


def canned(entries: dict[str, Any], names: list[str]) -> Any:
    """A stand-in for ``suite.run`` that returns the entries' outcomes."""

    def run(selected: list[str], quick: bool, work_dir: Path) -> dict[str, Any]:
        assert list(selected) == names
        return {
            name: {k: v for k, v in entries[name].items() if k != "run"}
            for name in names
        }

    return run


def test_a_partial_run_keeps_the_other_sections_and_adds_a_history_row(
    tmp_path: Path, quick_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = {"accuracy": quick_run["accuracy"]}
    results.save_latest(tmp_path, kept)
    results.save_history(tmp_path, [{"date": "2026-12-01", "commit": "abc"}])
    monkeypatch.setattr(suite, "run", canned(quick_run, ["store"]))
    output = tmp_path / "report" / "BENCHMARKS.md"
    argv = ["--only", "store", "--results", str(tmp_path), "--output", str(output)]
    assert main(argv) == 0
    entries = results.load_latest(tmp_path)
    assert entries["accuracy"] == quick_run["accuracy"]  # untouched
    assert entries["store"]["results"] == quick_run["store"]["results"]
    assert entries["store"]["run"]["command"] == "python -m benchmarks " + " ".join(
        argv
    )
    rows = results.load_history(tmp_path)
    assert len(rows) == 2
    assert rows[1]["sections"] == ["store"]
    assert (
        rows[1]["store_engine"]
        == quick_run["store"]["results"]["engine"]["ratio_median"]
    )
    # One line per section, one per history row.
    assert len((tmp_path / "latest.json").read_text().splitlines()) == 2 + 2
    assert len((tmp_path / "history.json").read_text().splitlines()) == 2 + 2
    text = output.read_text()
    assert text.count("*Measured ") == 2  # store's run and accuracy's
    assert "## Speculative decoding\n\nNot measured yet." in text
    assert "| 2026-12-01 | abc |" in text
    assert (tmp_path / "report" / "docs" / "bench" / "accuracy.png").exists()


def test_a_quick_run_is_kept_but_not_in_the_history(
    tmp_path: Path, quick_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(suite, "run", canned(quick_run, ["scheduler_cost"]))
    output = tmp_path / "BENCHMARKS.md"
    argv = ["--quick", "--only", "scheduler_cost", "--results", str(tmp_path)]
    assert main([*argv, "--output", str(output)]) == 0
    assert results.load_latest(tmp_path)["scheduler_cost"]["run"]["quick"] is True
    assert results.load_history(tmp_path) == []
    assert "**From a quick run (shorter, noisier): scheduler_cost.**" in (
        output.read_text()
    )


def test_a_section_that_failed_says_why_and_fails_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(selected: list[str], quick: bool, work_dir: Path) -> dict[str, Any]:
        return {"store": {"error": "RuntimeError: no redis", "elapsed_s": 1.0}}

    monkeypatch.setattr(suite, "run", failing)
    output = tmp_path / "BENCHMARKS.md"
    argv = ["--only", "store", "--results", str(tmp_path), "--output", str(output)]
    assert main(argv) == 1
    text = output.read_text()
    assert "did not run: RuntimeError: no redis" in text
    assert "Did not run: RuntimeError: no redis" in text
    assert results.load_history(tmp_path) == []  # nothing measured


def test_render_only_measures_nothing(
    tmp_path: Path, quick_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: object) -> dict[str, Any]:
        raise AssertionError("measured")

    monkeypatch.setattr(suite, "run", never)
    results.save_latest(tmp_path, quick_run)
    output = tmp_path / "BENCHMARKS.md"
    assert (
        main(["--render-only", "--results", str(tmp_path), "--output", str(output)])
        == 0
    )
    assert output.read_text().count("*Measured ") == len(quick_run)


def test_the_whole_report_of_a_real_quick_run(
    tmp_path: Path, quick_run: dict[str, Any]
) -> None:
    output = tmp_path / "BENCHMARKS.md"
    text = document.render(quick_run, [], output, tmp_path / "figs")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == [
        "## Summary",
        *(f"## {module.TITLE}" for module in document.SECTIONS.values()),
        "## History",
    ]
    assert "could not" not in text.lower() and "did not run" not in text.lower()
    summary = text.split("## Summary", 1)[1].split("\n\n")[1].splitlines()[2:]
    # At least two rows per measured section (one "not measured" row each
    # for the sections the quick run predates).
    assert len(summary) >= 2 * len(quick_run)
    assert all(
        line.rstrip().endswith(("| met |", "| **missed** |", "| n.a. |"))
        for line in summary
    )
    figures = {path.name for path in (tmp_path / "figs").iterdir()}
    assert figures == {
        "throughput.png",
        "scheduler_cost.png",
        "isolation.png",
        "accuracy.png",
        "fair_shares.png",
    }


def test_a_section_that_cannot_be_formatted_loses_nothing_else(
    tmp_path: Path, quick_run: dict[str, Any]
) -> None:
    broken = {**quick_run, "store": {**quick_run["store"], "results": {"oops": 1}}}
    text = document.render(broken, [], tmp_path / "B.md", tmp_path / "figs")
    assert "could not summarise: KeyError('round_trips')" in text
    assert "(Could not format the results: KeyError('round_trips'))" in text
    assert "## Fair shares on a saturated engine\n\n*Measured" in text


def test_the_committed_history_renders_every_row() -> None:
    rows = results.load_history(results.RESULTS_DIR)
    known = {"date", "commit", "sections", "note", *history.COLUMNS}
    assert rows and all(set(row) <= known for row in rows)
    assert len(history.table(rows)) == len(rows) + 2

"""The teams section renders what ``benchmarks.teams.run`` returns, and
judges the step cost against the user-only plugin and a team's rate at the
engine against its limit, members within theirs."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report import teams

RESULTS = {
    "step_cost": {
        "teams": 100,
        "members": 100,
        "rounds": 40,
        "throttled_team_rate": 50.0,
        "subjects": {
            "users only": {"schedule_ms": 104.9, "against": None, "ratio": 1.0},
            "teams, nobody throttled": {
                "schedule_ms": 107.8,
                "against": "users only",
                "ratio": 1.029,
            },
            "users only, 100 throttled": {
                "schedule_ms": 139.5,
                "against": None,
                "ratio": 1.0,
            },
            "teams, one throttled": {
                "schedule_ms": 151.2,
                "against": "users only, 100 throttled",
                "ratio": 1.071,
            },
        },
    },
    "accuracy": {
        "seconds": 20.0,
        "team_limit": 100.0,
        "member_limit": 40.0,
        "streams_per_member": 2,
        "team_rate": 100.0,
        "team_ratio": 1.0,
        "member_rates": {"crew-1": 25.0, "crew-2": 25.0},
        "client_ok": True,
    },
}


def test_the_section_renders_every_figure(tmp_path: Path) -> None:
    text = teams.section(RESULTS, tmp_path, tmp_path)
    assert "| teams, nobody throttled | 107.80 | 1.029 (/ users only) |" in text
    assert "| the team | 100.0 | 1.000 |" in text
    assert "| crew-1 | 25.0 | 0.625 |" in text
    assert teams.headlines(RESULTS) == {"teams_step_cost": 1.029, "teams_accuracy": 1.0}


def test_the_verdicts() -> None:
    verdicts = [row[3] for row in teams.summary_rows(RESULTS)]
    assert verdicts == [True, False, True]
    over = {
        **RESULTS,
        "accuracy": {
            **RESULTS["accuracy"],
            "member_rates": {"crew-1": 45.0, "crew-2": 25.0},
        },
    }
    assert teams.summary_rows(over)[2][3] is False  # a member over its own
    fast = {**RESULTS, "accuracy": {**RESULTS["accuracy"], "team_ratio": 1.05}}
    assert teams.summary_rows(fast)[2][3] is False

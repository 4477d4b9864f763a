"""Whether a run's users loaded the server together (overlap.py), from
load-tool records on a shared clock, no server."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.demo_figures import HOG, LIGHT, LIMITED, SCENE, STOCK
from vllm_output_rate.demo import run
from vllm_output_rate.demo.busy import OthersCpu
from vllm_output_rate.demo.engine_tally import EngineTally
from vllm_output_rate.demo.engine_view import EngineWatch, Reading
from vllm_output_rate.demo.figures import EngineView, Outcomes, RunFigures
from vllm_output_rate.demo.judging import judge_scene, unequal_load
from vllm_output_rate.demo.overlap import (
    MIN_COVERED,
    covered_share,
    light_window,
    light_window_covered,
)
from vllm_output_rate.demo.scenes import DemoUser, Scene
from vllm_output_rate.demo.stage import DemoError, Played, ServerSpec
from vllm_output_rate.loadtest import LoadResult, LoadSpec, RequestRecord, UserLoad


def result(
    user: DemoUser, spans: list[tuple[float, float | None]], opened: float | None
) -> LoadResult:
    """``user``'s run whose window opened at ``opened`` (monotonic), one
    request per (start, end) span, times from the window's start."""
    duration = SCENE.duration_s - user.start_after_s
    records = [
        RequestRecord(user.name, 0, start, end, status=200, finish_reason="length")
        for start, end in spans
    ]
    spec = LoadSpec("http://x", "m", [UserLoad(user.name, 1)], duration_s=duration)
    return LoadResult.build(spec, records, duration, window_opened_s=opened)


class TestCoveredShare:
    def test_the_union_of_overlapping_intervals_counts_once(self) -> None:
        assert covered_share((0, 10), [(1, 4), (2, 5), (8, 20)]) == pytest.approx(0.6)
        assert covered_share((0, 10), []) == 0.0
        assert covered_share((5, 5), [(0, 10)]) == 0.0

    @given(
        st.lists(
            st.tuples(st.floats(-5, 15), st.floats(0, 10)).map(
                lambda t: (t[0], t[0] + t[1])
            ),
            max_size=12,
        )
    )
    def test_a_share_of_the_window_measured_on_a_fine_grid(
        self, intervals: list[tuple[float, float]]
    ) -> None:
        share = covered_share((0.0, 10.0), intervals)
        assert 0.0 <= share <= 1.0 + 1e-9
        # Midpoints of 1,000 slices: the share they fall in agrees within a slice
        # per interval edge.
        points = [(k + 0.5) / 100 for k in range(1000)]
        inside = sum(any(lo <= p < hi for lo, hi in intervals) for p in points)
        assert share == pytest.approx(inside / 1000, abs=2 * len(intervals) / 1000)


class TestLightWindowCovered:
    def test_a_hog_in_flight_all_along_covers_the_light_users_window(self) -> None:
        # The light user starts 1 s after the hog; both windows opened then.
        light = result(LIGHT, [(0.0, 1.0), (1.0, 2.5)], opened=101.0)
        hog = result(HOG, [(0.0, 2.0), (1.5, 5.0)], opened=100.0)
        assert light_window(light) == (101.0, 103.5)
        share = light_window_covered(SCENE, {"light": light, "hog": hog})
        assert share == pytest.approx(1.0)

    def test_a_hog_that_started_late_covers_only_its_part(self) -> None:
        # The light user's window: 101-105 (its duration, 4 s, cuts the last
        # request's end); the hog's request runs 103-106.
        light = result(LIGHT, [(0.0, 1.0), (1.0, 9.0)], opened=101.0)
        hog = result(HOG, [(0.0, 3.0)], opened=103.0)
        share = light_window_covered(SCENE, {"light": light, "hog": hog})
        assert share == pytest.approx(2 / 4)
        assert share is not None and share < MIN_COVERED

    def test_a_request_still_open_counts_to_the_end_of_its_run(self) -> None:
        light = result(LIGHT, [(0.0, 2.0)], opened=100.0)
        hog = result(HOG, [(0.0, None)], opened=100.0)  # elapsed_s: 5 s
        share = light_window_covered(SCENE, {"light": light, "hog": hog})
        assert share == pytest.approx(1.0)

    def test_cannot_be_told_without_the_clock_reading_or_requests(self) -> None:
        hog = result(HOG, [(0.0, 3.0)], opened=100.0)
        for light in (
            result(LIGHT, [(0.0, 1.0)], opened=None),
            result(LIGHT, [], opened=100.0),
        ):
            assert light_window_covered(SCENE, {"light": light, "hog": hog}) is None


class TestJudging:
    def test_a_light_user_beside_an_idle_server_is_not_judged(self) -> None:
        stock = dataclasses.replace(STOCK, covered=0.3)
        light, hog = judge_scene(SCENE, stock, LIMITED)
        assert (light.good, light.short, light.breaks) == (False, "not judged", False)
        assert "only 30% of its window on stock vLLM" in light.text
        assert hog.good  # the throttled user is still judged at its limit

    def test_covered_runs_are_judged_as_usual(self) -> None:
        stock = dataclasses.replace(STOCK, covered=1.0)
        limited = dataclasses.replace(LIMITED, covered=MIN_COVERED)
        light, _ = judge_scene(SCENE, stock, limited)
        assert light.good and light.short == "better"


class FakeServers:
    """The one server ``play_side`` asks for, by URL (never contacted: the
    test replaces ``play`` and ``put_limits``)."""

    def url(self, scene: Scene, limited: bool) -> tuple[str, ServerSpec]:
        return "http://127.0.0.1:1", ServerSpec.for_scene(scene, limited)


class TestPlayedAgain:
    def runs(self, *hog_opened: float, finished: int = 2) -> list[Played]:
        """Runs in which the light user's window opens at 101 s and the hog's
        at each of ``hog_opened``; the engine finished ``finished`` requests
        (each user got one answer)."""
        return [
            Played(
                {
                    "light": result(LIGHT, [(0.0, 3.0)], opened=101.0),
                    "hog": result(HOG, [(0.0, 4.0)], opened=opened),
                },
                None,
                OthersCpu(),
                EngineTally(finished=finished, prompt_tokens=0, output_tokens=0),
            )
            for opened in hog_opened
        ]

    def play_side(
        self,
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
        runs: list[Played],
        limited: bool = False,
    ) -> tuple[RunFigures, list[dict[str, Any]], int]:
        """``run.play_side`` over ``runs``: its figures, the limits it put
        back, and how many runs it played."""
        played = iter(runs)
        bodies: list[dict[str, Any]] = []
        monkeypatch.setattr(run, "play", lambda *a: next(played))
        monkeypatch.setattr(run, "put_limits", lambda url, key, b: bodies.append(b))
        monkeypatch.setattr(run, "save", lambda *a: None)
        figures = run.play_side(tmp_path, "m", SCENE, FakeServers(), limited)  # type: ignore[arg-type]
        return figures, bodies, len(runs) - len(list(played))

    def test_a_run_beside_an_idle_server_is_played_again(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        figures, bodies, plays = self.play_side(
            monkeypatch, tmp_path, self.runs(103.0, 100.5)
        )
        assert plays == 2 and not bodies  # stock vLLM: no limits to put back
        assert figures.covered == pytest.approx(1.0)

    def test_with_limits_the_scenes_limits_are_put_back_first(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        runs = self.runs(103.0, 100.5)
        for p in runs:  # the stats the plugin would have given
            p.engine = EngineView(watch_of(), 100.0, 105.0)
        _, bodies, plays = self.play_side(monkeypatch, tmp_path, runs, limited=True)
        assert plays == 2
        assert bodies == [
            {
                "default_user_output_tokens_per_second": SCENE.default_limit,
                "user_output_tokens_per_second": {"hog": HOG.limit},
                "remove_users": ["light"],
            }
        ]

    def test_it_gives_up_after_the_last_play_and_says_why(
        self,
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        figures, _, plays = self.play_side(
            monkeypatch, tmp_path, self.runs(*[103.0] * run.PLAYS)
        )
        assert plays == run.PLAYS
        assert figures.covered is not None and figures.covered < MIN_COVERED
        out = capsys.readouterr().out
        assert out.count("playing it again") == run.PLAYS - 1
        assert "only 33% of the light user's window" in out


def watch_of() -> EngineWatch:
    engine = EngineWatch("http://unused", "key")
    engine.readings = [Reading(100.0 + t, {"hog": 5 * t}) for t in range(6)]
    return engine


def test_answers_the_engine_did_not_give_stop_the_demo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The clients got two answers; the server's engine finished one: the
    # other came from elsewhere, so the run measured something else.
    runs = TestPlayedAgain().runs(100.5, finished=1)
    with pytest.raises(DemoError, match=r"1 of the 2 answers .* did not come from"):
        TestPlayedAgain().play_side(monkeypatch, tmp_path, runs)


class TestSameLoad:
    """An unthrottled other user gets about as many answers in both runs;
    when not, one run did not hold the scene: stock is played again."""

    OTHER = dataclasses.replace(HOG, role="other", limit=None)
    SCENE = dataclasses.replace(SCENE, users=(LIGHT, OTHER))

    def runs(self, stock_answers: int, limited_answers: int) -> tuple[RunFigures, ...]:
        def with_answers(figures: RunFigures, ok: int) -> RunFigures:
            hog = dataclasses.replace(
                figures.users["hog"], role="other", outcomes=Outcomes(ok=ok)
            )
            return dataclasses.replace(figures, users={**figures.users, "hog": hog})

        return with_answers(STOCK, stock_answers), with_answers(
            LIMITED, limited_answers
        )

    def test_the_same_load_is_judged(self) -> None:
        stock, limited = self.runs(56, 43)  # 43 >= 0.75 x 56
        assert unequal_load(self.SCENE, stock, limited) is None
        light, _ = judge_scene(self.SCENE, stock, limited)
        assert light.short == "better"

    def test_a_run_short_of_the_others_load_is_not_judged(self) -> None:
        stock, limited = self.runs(33, 53)  # what CI printed once
        why = unequal_load(self.SCENE, stock, limited)
        assert why == (
            "not judged: hog got 33 answers on stock vLLM and 53 with limits, "
            "not the same load"
        )
        light, _ = judge_scene(self.SCENE, stock, limited)
        assert (light.good, light.short, light.text) == (False, "not judged", why)

    def test_a_throttled_users_answers_may_differ(self) -> None:
        stock, limited = self.runs(200, 20)
        assert unequal_load(SCENE, stock, limited) is None  # its hog is throttled

    def test_stock_is_played_again_until_the_loads_match(
        self,
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        stock_short, limited = self.runs(33, 53)
        stock_ok, _ = self.runs(55, 53)
        sides = iter([stock_short, limited, stock_ok])
        played: list[bool] = []

        def play_side(*args: Any, limited: bool) -> RunFigures:
            played.append(limited)
            return next(sides)

        monkeypatch.setattr(run, "play_side", play_side)
        result = run.play_scene(tmp_path, "m", self.SCENE, FakeServers())  # type: ignore[arg-type]
        assert played == [False, True, False]
        assert result.stock is stock_ok
        assert "hog got 33 answers on stock vLLM and 53 with limits" in (
            capsys.readouterr().out
        )

"""What a run measured (figures.py) and what the demo concludes (judging.py,
table.py), from real load-tool records and stats readings, no server."""

from __future__ import annotations

import dataclasses

import pytest

from harness.demo_figures import HOG, LIGHT, LIMITED, SCENE, STOCK, figures
from vllm_output_rate.demo.engine_view import EngineWatch, Reading
from vllm_output_rate.demo.figures import (
    EngineView,
    Outcomes,
    RunFigures,
    run_figures,
)
from vllm_output_rate.demo.judging import (
    AT_LIMIT,
    SceneResult,
    headline,
    judge_scene,
    too_busy,
)
from vllm_output_rate.demo.scenes import DemoUser
from vllm_output_rate.demo.table import format_table
from vllm_output_rate.loadtest import LoadResult, LoadSpec, RequestRecord, UserLoad


def request(
    user: str,
    start: float,
    ttft: float,
    gap: float = 0.1,
    tokens: int = 4,
    engine: tuple[float, float, float] | None = None,
    status: int = 200,
) -> RequestRecord:
    """A completed request; ``engine``: (queue, first token, generation) ms."""
    if status != 200:
        return RequestRecord(user, 0, start, start + 0.01, status=status, error="no")
    first = start + ttft
    chunks = [(first + k * gap, 1) for k in range(tokens)]
    metrics = None
    if engine is not None:
        queue, first_ms, generation = engine
        metrics = {
            "queue_time_ms": queue,
            "time_to_first_token_ms": first_ms,
            "generation_time_ms": generation,
        }
    return RequestRecord(
        user=user,
        stream=0,
        start_s=start,
        end_s=chunks[-1][0],
        first_token_s=first,
        chunks=chunks,
        finish_reason="length",
        usage_completion_tokens=tokens,
        status=200,
        engine_metrics=metrics,
    )


def result(user: DemoUser, records: list[RequestRecord]) -> LoadResult:
    duration = SCENE.duration_s - user.start_after_s
    spec = LoadSpec(
        "http://x", "m", [UserLoad(user.name, user.streams)], duration_s=duration
    )
    return LoadResult.build(spec, records, elapsed_s=duration)


def watch(hog_rate: float, start: float = 100.0) -> EngineWatch:
    engine = EngineWatch("http://unused", "key")
    engine.readings = [
        Reading(start + t / 2, {"hog": round(hog_rate * t / 2)}) for t in range(13)
    ]
    return engine


class TestFigures:
    def test_the_light_users_figures_at_the_engine_and_at_the_client(self) -> None:
        light = [
            request("light", 0.0, 0.2, engine=(100, 20, 380)),  # 4 tokens in 0.5 s
            request("light", 1.0, 0.4, engine=(300, 20, 180)),
            request("light", 2.0, 0.3, engine=(200, 10, 290)),
            # Ends after the window (4 s for a light user starting at 1 s):
            # the limits were lifted by then, so it does not count.
            request("light", 3.7, 0.1, engine=(0, 1, 1)),
        ]
        hog = [request("hog", 0.0, 0.1, gap=0.5, tokens=12)]
        figures = run_figures(
            SCENE, {"light": result(LIGHT, light), "hog": result(HOG, hog)}, None
        )
        f = figures.users["light"]
        assert f.ttft_client_s == pytest.approx(0.3)
        assert f.ttft_engine_s == pytest.approx(0.21)  # queue + first token
        assert f.rate_engine == pytest.approx(12 / 1.5)  # queued to last token
        # Sent to last token: 0.5, 0.7 and 0.6 s.
        assert f.rate_client == pytest.approx(12 / 1.8)
        assert f.limit is None and f.bound_held is None and not figures.limited
        # Client TTFT less the engine's, p50 over all four answers.
        assert f.outside_engine_s == pytest.approx(0.085, abs=0.005)
        assert figures.users["hog"].outside_engine_s is None  # no engine timings
        assert f.queued_engine_s == pytest.approx(0.15)  # p50 of 0.1, 0.3, 0.2, 0
        assert figures.users["hog"].queued_engine_s is None

    def test_the_others_over_the_window_and_with_limits_at_the_engine(self) -> None:
        # 12 tokens, 0.5 s apart from 0.1 s: 10 fall within the 5 s window.
        hog = [request("hog", 0.0, 0.1, gap=0.5, tokens=12)]
        light = [request("light", 0.0, 0.1)]
        results = {"light": result(LIGHT, light), "hog": result(HOG, hog)}
        engine = EngineView(watch(5.0), 100.0, 105.0)
        figures = run_figures(SCENE, results, engine)
        f = figures.users["hog"]
        assert f.rate_client == pytest.approx(10 / 5)
        assert f.rate_engine == pytest.approx(5.0, rel=0.05)
        assert f.limit == 5 and f.bound_held
        assert figures.users["light"].limit == SCENE.default_limit
        # Tokens after the window, when the demo lifted the limits, are not
        # held against the bound.
        engine.watch.readings.append(Reading(107.0, {"hog": 500}))
        assert run_figures(SCENE, results, engine).users["hog"].bound_held
        engine.watch.readings.insert(3, Reading(101.6, {"hog": 40}))
        assert not run_figures(SCENE, results, engine).users["hog"].bound_held

    def test_a_429_is_refused_by_design_only_for_a_refusable_user(self) -> None:
        results = {
            "light": result(
                LIGHT, [request("light", 0, 0.1), request("light", 1, 0, status=429)]
            ),
            "hog": result(
                HOG,
                [request("hog", 0, 0.1, status=429), request("hog", 0, 0, status=500)],
            ),
        }
        figures = run_figures(SCENE, results, None)
        assert figures.users["hog"].outcomes == Outcomes(ok=0, refused=1, failed=["no"])
        assert figures.users["light"].outcomes == Outcomes(
            ok=1, refused=0, failed=["no"]
        )

    def test_a_503_is_stock_vllms_full_queue_and_a_failure_with_limits(
        self,
    ) -> None:
        busy = RequestRecord(
            "hog", 0, 0.0, 0.01, status=200, error="server error in stream: busy",
            stream_error_status=503,
        )  # fmt: skip
        records = [busy, request("hog", 0, 0, status=503), request("hog", 0, 0.1)]
        results = {"light": result(LIGHT, []), "hog": result(HOG, records)}
        stock = run_figures(SCENE, results, None).users["hog"].outcomes
        assert stock == Outcomes(ok=1, queue_full=2)
        assert stock.answered_share == pytest.approx(1 / 3)
        limited = run_figures(SCENE, results, EngineView(watch(5.0), 100.0, 105.0))
        outcomes = limited.users["hog"].outcomes
        assert outcomes.queue_full == 0 and len(outcomes.failed) == 2
        assert Outcomes().answered_share is None


class TestJudging:
    def test_light_better_and_throttled_at_its_limit(self) -> None:
        light, hog = judge_scene(SCENE, STOCK, LIMITED)
        assert light.good and light.short == "better" and not light.breaks
        assert "20 ms instead of 900 ms at the engine" in light.text
        assert hog.good and hog.short == "at its limit" and not hog.breaks

    @pytest.mark.parametrize(
        ("field", "value", "named"),
        [
            ("ttft_engine_s", 0.95, "first token at the engine"),
            ("ttft_client_s", 2.0, "first token at the client"),
            ("rate_engine", 30.0, "rate at the engine"),
            ("rate_client", None, "rate at the client"),
        ],
    )
    def test_light_not_better_when_any_figure_is_worse_or_missing(
        self, field: str, value: float | None, named: str
    ) -> None:
        limited = dataclasses.replace(LIMITED, users=dict(LIMITED.users))
        limited.users["light"] = dataclasses.replace(
            limited.users["light"], **{field: value}
        )
        light = judge_scene(SCENE, STOCK, limited)[0]
        assert not light.good and not light.breaks
        assert light.text == f"NOT better with limits: {named}"

    def test_throttled_below_its_limit_is_reported_not_fatal(self) -> None:
        slow = figures(0.02, 150.0, 5.0 * AT_LIMIT * 0.9, limited=True)
        hog = judge_scene(SCENE, STOCK, slow)[1]
        assert not hog.good and not hog.breaks and hog.short == "below limit"
        assert "(0.81x at the engine)" in hog.text

    def test_a_broken_bound_or_a_failed_request_breaks_the_demo(self) -> None:
        broken = figures(0.02, 150.0, 5.0, limited=True, hog_bound_held=False)
        hog = judge_scene(SCENE, STOCK, broken)[1]
        assert (
            hog.breaks and hog.short == "BOUND BROKEN" and "BROKE THE BOUND" in hog.text
        )
        failed = figures(
            0.02, 150.0, 5.0, limited=True, hog_outcomes=Outcomes(3, 2, ["x", "x", "y"])
        )
        hog = judge_scene(SCENE, STOCK, failed)[1]
        assert hog.breaks and hog.short == "FAILED"
        assert "3 requests FAILED with limits: 2 x x; 1 x y" in hog.text
        assert "2 requests refused (429: its own excess, by design)" in hog.text
        result = SceneResult.judge(SCENE, STOCK, failed)
        assert result.breaks

    def test_where_the_queue_is_scarce_the_light_user_is_judged_by_answers(
        self,
    ) -> None:
        scene = dataclasses.replace(SCENE, light_measure="answers")

        def light_outcomes(run: RunFigures, outcomes: Outcomes) -> RunFigures:
            users = dict(run.users)
            users["light"] = dataclasses.replace(users["light"], outcomes=outcomes)
            return dataclasses.replace(run, users=users)

        # Its latency is no better (the runs swapped): answers decide.
        stock = light_outcomes(LIMITED, Outcomes(ok=2, queue_full=18))
        limited = light_outcomes(STOCK, Outcomes(ok=30))
        light = judge_scene(scene, stock, limited)[0]
        assert light.good and not light.breaks and light.short == "better"
        assert light.text.startswith(
            "better with limits: 30 of 30 answered with limits, 2 of 20 answered "
            "on stock vLLM"
        )
        assert "18 requests answered 503 on stock vLLM (its queue full)" in light.text
        same = judge_scene(scene, light_outcomes(STOCK, Outcomes(ok=5)), limited)[0]
        assert not same.good and not same.breaks and same.short == "NOT better"
        table = format_table([SceneResult.judge(scene, stock, limited)])
        assert "2 +18 503 → 30" in table

    def test_where_prefill_is_scarce_the_light_user_is_judged_by_first_token(
        self,
    ) -> None:
        # Each of its later tokens waits for a full step either way: a rate
        # no better with limits does not count, a first token no better does.
        scene = dataclasses.replace(SCENE, light_measure="first-token")
        limited = dataclasses.replace(LIMITED, users=dict(LIMITED.users))
        limited.users["light"] = dataclasses.replace(
            limited.users["light"], rate_engine=1.0, rate_client=1.0
        )
        light = judge_scene(scene, STOCK, limited)[0]
        assert light.good and light.short == "better"
        slower = dataclasses.replace(limited, users=dict(limited.users))
        slower.users["light"] = dataclasses.replace(
            limited.users["light"], ttft_client_s=5.0
        )
        light = judge_scene(scene, STOCK, slower)[0]
        assert light.text == "NOT better with limits: first token at the client"

    def test_without_a_throttled_user_the_headline_does_not_name_one(self) -> None:
        scene = dataclasses.replace(
            SCENE, users=tuple(u for u in SCENE.users if u.role != "throttled")
        )
        stock = dataclasses.replace(STOCK, users={"light": STOCK.users["light"]})
        limited = dataclasses.replace(LIMITED, users={"light": LIMITED.users["light"]})
        text = headline([SceneResult.judge(scene, stock, limited)])
        assert text == (
            "In this scene, the light user came out better with limits, "
            "and no request failed."
        )

    def test_refused_requests_alone_do_not_break_the_demo(self) -> None:
        refused = figures(
            0.02, 150.0, 5.0, limited=True, hog_outcomes=Outcomes(30, 9, [])
        )
        hog = judge_scene(SCENE, STOCK, refused)[1]
        assert hog.good and not hog.breaks and "9 requests refused" in hog.text

    def test_the_headline_says_whether_every_scene_kept_its_promise(self) -> None:
        good = SceneResult.judge(SCENE, STOCK, LIMITED)
        assert headline([good, good]).startswith("In each of the 2 scenes, the light")
        assert headline([good]).startswith("In this scene,")
        bad = SceneResult.judge(SCENE, LIMITED, STOCK)  # the runs swapped
        assert headline([good, bad]) == "Not as promised in 1 of 2 scenes: Test scarce."

    def test_too_busy_names_the_busiest_run(self) -> None:
        quiet, busy = (
            STOCK,
            dataclasses.replace(LIMITED, others_cores=1.4, others_share=0.7),
        )
        unknown = dataclasses.replace(STOCK, others_cores=None, others_share=None)
        assert too_busy({"a": quiet, "b": unknown}) is None
        text = too_busy({"the stock run": quiet, "the limited run": busy})
        assert text is not None
        assert "1.4 cores busy during the limited run (1 of 2 runs" in text


def test_the_table_has_one_line_per_user_with_stock_then_limits() -> None:
    refused = figures(
        0.02, 150.0, 5.0, limited=True, hog_outcomes=Outcomes(30, 9, ["x"])
    )
    lines = format_table([SceneResult.judge(SCENE, STOCK, refused)] * 2).splitlines()
    assert lines[0] == "Test scarce (--max-num-seqs 2): stock vLLM → with limits"
    assert len(lines) == 2 * 6 + 1  # title, two header lines, rule, two users
    light = next(line for line in lines if line.startswith("light"))
    assert "1000" in light and "900 → 20" in light and "950 → 70" in light
    assert "40 → 150" in light and "10 → 10" in light and light.endswith("better")
    hog = next(line for line in lines if line.startswith("hog"))
    assert "- → 5.0" in hog and "2,000 → 5.1" in hog
    assert "40 → 30 +9 refused +1 FAILED" in hog and hog.endswith("FAILED")

"""The demo's chart from real judged results: one row per scene, the file
written as a PNG (its numbers are checked where they are computed), with a
missing figure drawn as n/a rather than failing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harness.demo_figures import LIMITED, SCENE, STOCK
from vllm_output_rate.demo.chart import plot_demo
from vllm_output_rate.demo.judging import SceneResult


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_one_row_per_scene(tmp_path: Path) -> None:
    one = plot_demo([SceneResult.judge(SCENE, STOCK, LIMITED)], tmp_path / "one.png")
    two = plot_demo(
        [SceneResult.judge(SCENE, STOCK, LIMITED)] * 2, tmp_path / "two.png"
    )
    (w1, h1), (w2, h2) = png_size(one), png_size(two)
    assert w1 == w2 == 1300
    assert h2 > 1.7 * h1
    assert two.stat().st_size > 30_000


def test_a_missing_figure_or_a_scene_without_others_still_draws(tmp_path: Path) -> None:
    users = dict(STOCK.users)
    users["light"] = dataclasses.replace(users["light"], ttft_engine_s=None)
    stock = dataclasses.replace(STOCK, users=users)
    alone = dataclasses.replace(SCENE, users=SCENE.users[:1])
    path = plot_demo(
        [
            SceneResult.judge(SCENE, stock, LIMITED),
            SceneResult.judge(alone, STOCK, LIMITED),
        ],
        tmp_path / "demo.png",
    )
    assert png_size(path)[0] == 1300

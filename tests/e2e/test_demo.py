"""The demo end to end, one scene: real vLLM servers, stock and with limits,
the small local model; what a newcomer running ``make demo`` gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.load_records import PNG_MAGIC
from vllm_output_rate.demo import run

pytestmark = pytest.mark.e2e


def test_resident_slots_scene_light_user_better_hog_at_its_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run.main(["--scene", "resident-slots", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (tmp_path / "demo.png").read_bytes().startswith(PNG_MAGIC)
    (scene,) = json.loads((tmp_path / "summary.json").read_text())
    stock, limited = scene["stock"]["users"], scene["limited"]["users"]
    for users in (stock, limited):
        assert all(not u["outcomes"]["failed"] for u in users.values())
    # The scarcity is strong: on stock vLLM the light user waits behind the
    # hog's queued requests (a second or two here), with limits it gets a
    # slot at once.
    light_ttft = (stock["light"]["ttft_engine_s"], limited["light"]["ttft_engine_s"])
    assert light_ttft[1] < light_ttft[0] / 3, out
    assert limited["hog"]["bound_held"] is True, out
    assert limited["hog"]["rate_engine"] >= 0.9 * limited["hog"]["limit"], out
    assert "the light user came out better with limits" in out


def test_queue_places_scene_light_user_answered_hog_refused_its_excess(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run.main(["--scene", "queue-places", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    (scene,) = json.loads((tmp_path / "summary.json").read_text())
    stock, limited = scene["stock"]["users"], scene["limited"]["users"]
    # On stock vLLM the hog's streams keep the queue full: 503 for both.
    assert stock["light"]["outcomes"]["queue_full"] > 0, out
    assert stock["hog"]["outcomes"]["queue_full"] > 0, out
    # With limits every request of the light user is answered; the hog's
    # excess over its own cap gets 429, and nobody gets 503.
    light = limited["light"]["outcomes"]
    assert light["ok"] > 0 and light["queue_full"] == light["refused"] == 0, out
    assert not light["failed"], out
    hog = limited["hog"]["outcomes"]
    assert hog["refused"] > 0 and not hog["failed"], out
    assert limited["hog"]["bound_held"] is True, out
    assert "the light user came out better with limits" in out

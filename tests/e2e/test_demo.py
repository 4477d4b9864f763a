"""The demo end to end, one scene: real vLLM servers, stock and with limits,
the small local model; what a newcomer running ``make demo`` gets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.load_records import PNG_MAGIC
from vllm_output_rate.demo import run

pytestmark = pytest.mark.e2e

Users = dict[str, dict[str, Any]]


def play(
    key: str, out_dir: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[str, Users, Users]:
    """Play one scene as ``make demo`` does: its output and, per user, the
    figures of the stock run and of the run with limits."""
    code = run.main(["--scene", key, "--out", str(out_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (out_dir / "demo.png").read_bytes().startswith(PNG_MAGIC)
    (scene,) = json.loads((out_dir / "summary.json").read_text())
    return out, scene["stock"]["users"], scene["limited"]["users"]


def test_kv_blocks_scene_light_user_better_hog_at_its_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, stock, limited = play("kv-blocks", tmp_path, capsys)
    for users in (stock, limited):
        assert all(not u["outcomes"]["failed"] for u in users.values())
    # On stock vLLM the light user waits for KV blocks the hog's requests
    # hold (seconds); with limits it gets them back at once.
    light_ttft = (stock["light"]["ttft_engine_s"], limited["light"]["ttft_engine_s"])
    assert light_ttft[1] < light_ttft[0] / 3, out
    assert limited["hog"]["bound_held"] is True, out
    assert limited["hog"]["rate_engine"] >= 0.9 * limited["hog"]["limit"], out
    assert "the light user came out better with limits" in out


def test_prefill_tokens_scene_light_users_first_token_not_behind_long_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, stock, limited = play("prefill-tokens", tmp_path, capsys)
    for users in (stock, limited):
        assert all(not u["outcomes"]["failed"] for u in users.values())
    # Nobody is throttled: the step's token shares alone put the light
    # user's prompt into the next step instead of behind the hog's.
    light_ttft = (stock["light"]["ttft_engine_s"], limited["light"]["ttft_engine_s"])
    assert light_ttft[1] < light_ttft[0] / 3, out
    assert "the light user came out better with limits" in out


def test_queue_places_scene_light_user_answered_hog_refused_its_excess(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, stock, limited = play("queue-places", tmp_path, capsys)
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

"""The demo's scene declarations: checked when declared, and every scene's
flags accepted by vLLM's real parser with the plugin's flags."""

from __future__ import annotations

import dataclasses

import pytest

from harness.vllm_cli import parse_engine_args, vllm_parser
from vllm_output_rate.demo.scenes import (
    LIGHT,
    SCENES,
    DemoUser,
    Scene,
    scene_by_key,
)
from vllm_output_rate.demo.server import DEFAULT_ARGS
from vllm_output_rate.demo.stage import ServerSpec

HOG = DemoUser("hog", "throttled", streams=4, max_tokens=20, limit=5)


def scene(*users: DemoUser, **kwargs: object) -> Scene:
    return Scene("test", "Test", ("--max-num-seqs", "4"), users, **kwargs)  # type: ignore[arg-type]


def test_every_scene_judges_a_light_user_and_has_a_unique_key() -> None:
    assert [s.key for s in SCENES] == ["kv-blocks", "prefill-tokens", "queue-places"]
    for s in SCENES:
        assert [u.role for u in s.users].count("light") == 1
        assert scene_by_key(s.key) is s
    with pytest.raises(KeyError, match="kv-blocks"):
        scene_by_key("nope")


def test_limits_come_from_the_users_or_the_default() -> None:
    s = scene(LIGHT, HOG, default_limit=300)
    assert s.limit(LIGHT) == 300 and s.limit(HOG) == 5
    assert s.limit_flags() == [
        "--default-user-output-tokens-per-second",
        "300",
        "--user-output-tokens-per-second",
        '{"hog": 5}',
    ]
    assert scene(LIGHT).limit_flags() == [
        "--default-user-output-tokens-per-second",
        "1000",
    ]
    # The plugin's other flags (admission caps, prompt limits) join them.
    capped = scene(LIGHT, limited_args=("--some-cap", "4"))
    assert capped.limit_flags()[-2:] == ["--some-cap", "4"]
    assert s.with_role("throttled") == [HOG]


@pytest.mark.parametrize(
    ("users", "kwargs", "message"),
    [
        ((HOG,), {}, "no light user"),
        ((LIGHT, LIGHT), {}, "listed twice"),
        ((LIGHT, dataclasses.replace(HOG, limit=None)), {}, "needs a limit"),
        ((LIGHT, dataclasses.replace(HOG, limit=0)), {}, "must be > 0"),
        ((LIGHT, dataclasses.replace(HOG, streams=0)), {}, ">= 1"),
        ((LIGHT, dataclasses.replace(HOG, role="hog")), {}, "role must be"),
        ((LIGHT,), {"duration_s": 2.0}, "start within the run"),
        ((LIGHT,), {"default_limit": -1.0}, "must be > 0"),
        ((dataclasses.replace(LIGHT, think_s=-1.0),), {}, "think_s must be >= 0"),
        ((LIGHT,), {"light_measure": "speed"}, "light_measure must be one of"),
    ],
)
def test_a_bad_declaration_is_refused_when_declared(
    users: tuple[DemoUser, ...], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        scene(*users, **kwargs)


def test_a_scene_key_names_files() -> None:
    with pytest.raises(ValueError, match="lower-case"):
        Scene("KV blocks", "t", (), (LIGHT,))


@pytest.fixture(scope="module")
def parser():  # type: ignore[no-untyped-def]
    return vllm_parser()


@pytest.mark.parametrize("s", SCENES, ids=lambda s: s.key)
def test_both_servers_flags_make_the_engine_the_scene_declares(
    parser, tiny_model_path: str, s: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    for limited in (False, True):
        spec = ServerSpec.for_scene(s, limited)
        for name, value in spec.env.items():
            monkeypatch.setenv(name, value)  # the plugins the server loads
        args, config = parse_engine_args(
            parser, tiny_model_path, *DEFAULT_ARGS, *spec.args
        )
        assert args.enable_per_request_metrics  # the engine's side of each answer
        section = config.additional_config.get("output_rate")
        if not limited:
            assert section is None and spec.env == {"VLLM_PLUGINS": ""}  # stock
            continue
        assert section["default_user_output_tokens_per_second"] == s.default_limit
        own = {u.name: u.limit for u in s.users if u.limit is not None}
        assert section["user_output_tokens_per_second"] == own
        assert (
            spec.admin_key and spec.env["VLLM_OUTPUT_RATE_ADMIN_KEY"] == spec.admin_key
        )
    if s.key == "kv-blocks":
        assert config.cache_config.num_gpu_blocks_override == 40
        assert not config.cache_config.enable_prefix_caching
    elif s.key == "prefill-tokens":
        assert config.scheduler_config.max_num_batched_tokens == 512
        assert not config.cache_config.enable_prefix_caching
    else:
        assert args.max_num_queued_reqs == 16

"""Tests for the tiny random-weight Llama model builder."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.demo import tiny_model, tiny_model_recipe
from vllm_output_rate.demo.tiny_model import (
    MARKER_NAME,
    MODEL_DIRNAME,
    build_tiny_model,
    default_model_path,
    is_complete,
)
from vllm_output_rate.demo.tiny_model_recipe import BOS_TOKEN, EOS_TOKEN

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build shared by the read-only tests (a build takes a second or two)."""
    return build_tiny_model(tmp_path_factory.mktemp("shared") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    # Load the way vLLM does, through AutoTokenizer, to catch a saved
    # tokenizer_class that would swap in a different (non byte-level) pipeline.
    return AutoTokenizer.from_pretrained(model_dir)


def _mtimes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in path.iterdir()}


# --- default location -------------------------------------------------------


def test_default_path_prefers_project_cache_var(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_OUTPUT_RATE_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_model_path() == tmp_path / "c" / MODEL_DIRNAME


def test_default_path_falls_back_to_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_OUTPUT_RATE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_model_path() == tmp_path / "x" / "vllm-output-rate" / MODEL_DIRNAME


def test_default_path_falls_back_to_home_cache(monkeypatch, tmp_path):
    # Empty variables count as unset, as the XDG spec says.
    monkeypatch.setenv("VLLM_OUTPUT_RATE_CACHE", "")
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = tmp_path / ".cache" / "vllm-output-rate" / MODEL_DIRNAME
    assert default_model_path() == expected


def test_build_without_path_uses_default(monkeypatch, tmp_path, model_dir):
    monkeypatch.setenv("VLLM_OUTPUT_RATE_CACHE", str(tmp_path))
    target = tmp_path / MODEL_DIRNAME
    # Pre-seed a complete copy so this stays fast: it must be found, not rebuilt.
    target.mkdir()
    for f in model_dir.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(tiny_model, "_build_into", _must_not_build)
    assert build_tiny_model() == target


# --- build, idempotence, determinism, atomicity ------------------------------


def _must_not_build(directory: Path) -> None:
    raise AssertionError(f"unexpected rebuild into {directory}")


def test_build_writes_complete_model(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        WEIGHTS,
        "tokenizer.json",
        "tokenizer_config.json",
        MARKER_NAME,
    } <= names
    assert is_complete(model_dir)
    # No staging or trash folders left next to the model.
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]


def test_second_call_does_not_rebuild(monkeypatch, model_dir):
    before = _mtimes(model_dir)
    monkeypatch.setattr(tiny_model, "_build_into", _must_not_build)
    assert build_tiny_model(model_dir) == model_dir
    assert _mtimes(model_dir) == before


def test_force_rebuild_is_byte_identical(tmp_path, model_dir):
    target = build_tiny_model(tmp_path / "m")
    first = {p.name: p.read_bytes() for p in target.iterdir()}
    marker_mtime = (target / MARKER_NAME).stat().st_mtime_ns
    build_tiny_model(target, force=True)
    assert (target / MARKER_NAME).stat().st_mtime_ns != marker_mtime  # rebuilt
    second = {p.name: p.read_bytes() for p in target.iterdir()}
    assert second == first
    # And the same bytes as an independent build elsewhere.
    assert (model_dir / WEIGHTS).read_bytes() == first[WEIGHTS]
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_incomplete_folder_is_replaced(tmp_path, model_dir):
    target = tmp_path / "m"
    target.mkdir()
    (target / WEIGHTS).write_bytes(b"half written")  # no marker
    build_tiny_model(target)
    assert is_complete(target)
    assert (target / WEIGHTS).read_bytes() == (model_dir / WEIGHTS).read_bytes()


def test_failed_build_leaves_nothing_behind(monkeypatch, tmp_path):
    def boom(
        directory: Path, vocab_size: int, ids: dict[str, int], variant: str
    ) -> None:
        (directory / WEIGHTS).write_bytes(b"partial")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(tiny_model, "save_model", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        build_tiny_model(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_concurrent_builds_agree(tmp_path, model_dir):
    target = tmp_path / "m"
    errors: list[BaseException] = []

    def build() -> None:
        try:
            build_tiny_model(target)
        except BaseException as exc:  # reported below, in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert is_complete(target)
    assert (target / WEIGHTS).read_bytes() == (model_dir / WEIGHTS).read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_cli_prints_path(capsys, model_dir):
    assert tiny_model.main(["--path", str(model_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir)


# --- model and tokenizer contents ---------------------------------------------


def test_model_config_matches_tokenizer(model_dir, tokenizer):
    config = json.loads((model_dir / "config.json").read_text())
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == len(tokenizer)
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["num_key_value_heads"] == 1
    assert config["tie_word_embeddings"] is False
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == gen[key] == getattr(tokenizer, key)
    assert tokenizer.bos_token == BOS_TOKEN
    assert tokenizer.eos_token == EOS_TOKEN


def test_weights_are_float32_and_untied(model_dir):
    from safetensors import safe_open

    with safe_open(model_dir / WEIGHTS, framework="pt") as f:
        keys = set(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
    assert "lm_head.weight" in keys  # separate head, not tied to embeddings
    assert dtypes == {"F32"}


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "  leading and trailing spaces  ",
        "tabs\tand\nnewlines\r\n",
        "".join(chr(c) for c in range(32, 127)),  # all printable ASCII
    ],
)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127)))
def test_tokenizer_round_trips_any_ascii(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_tokenizer_compresses_english(tokenizer):
    # The BPE merges are real: common words are single tokens, not bytes.
    text = "the rate limit of the server"
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text) // 2


def test_chat_template_renders(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == f"{BOS_TOKEN}system: Be brief.\nuser: Hi there\nassistant:"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1


# --- real vLLM ---------------------------------------------------------------

VLLM_SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    # Engine processes are spawned, so the entry point must be guarded.
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams

        llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True)
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        outs = llm.generate(["The quick brown fox", "Once upon a time"], params)
        chat = llm.chat([{"role": "user", "content": "Hello"}], params)
        result = {
            "lengths": [len(o.outputs[0].token_ids) for o in outs],
            "chat_length": len(chat[0].outputs[0].token_ids),
            "chat_prompt_ids": list(chat[0].prompt_token_ids),
        }
        print("RESULT " + json.dumps(result), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)
def test_vllm_loads_and_generates(tmp_path, model_dir, tokenizer):
    script = tmp_path / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # Test the model alone: not this project's (or anyone's) vLLM plugins.
        "VLLM_PLUGINS": "",
    }
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["lengths"] == [16, 16]
    assert result["chat_length"] == 16
    expected_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert result["chat_prompt_ids"] == tokenizer.encode(
        expected_prompt, add_special_tokens=False
    )


# --- variants ------------------------------------------------------------------


def test_variants_live_in_their_own_folders_and_leave_the_default_alone(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("VLLM_OUTPUT_RATE_CACHE", str(tmp_path))
    assert default_model_path() == tmp_path / MODEL_DIRNAME
    assert default_model_path("echo") == tmp_path / "tiny-echo-v1"
    # The default recipe is the same as before variants existed.
    assert "variant" not in tiny_model_recipe.build_spec()
    assert tiny_model_recipe.spec_hash() != tiny_model_recipe.spec_hash("echo")
    with pytest.raises(ValueError, match="unknown tiny model variant"):
        default_model_path("nope")


def test_the_echo_variant_predicts_its_input_token(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path / "echo", variant="echo")
    assert is_complete(path, "echo") and not is_complete(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("The quick brown fox jumps over", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0]
    # Greedily it repeats the token it is given: n-gram drafts are accepted.
    assert torch.equal(logits.argmax(-1), ids[0])
    # At temperature 1 it repeats it most of the time, not always.
    repeat = logits.softmax(-1).gather(1, ids[0][:, None]).mean().item()
    assert 0.5 < repeat < 0.95


def test_the_hybrid_variant_is_a_mamba2_and_attention_model(tmp_path):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path / "hybrid", variant="hybrid")
    assert is_complete(path, "hybrid") and not is_complete(path, "echo")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["GraniteMoeHybridForCausalLM"]
    # Its shape is in the recipe: a change of it rebuilds the cached model.
    spec = tiny_model_recipe.build_spec("hybrid")
    assert spec["variant"]["hybrid_shape"]["mamba_d_state"]
    # transformers loads it and it runs on the project's tokenizer.
    model = AutoModelForCausalLM.from_pretrained(path)
    kinds = [type(module).__name__ for module in model.modules()]
    assert "GraniteMoeHybridMambaLayer" in kinds
    assert "GraniteMoeHybridAttention" in kinds
    ids = AutoTokenizer.from_pretrained(path)("Bread is made", return_tensors="pt")
    assert model(**ids).logits.shape[-1] == config["vocab_size"]


def test_the_vision_variant_turns_each_image_into_its_image_tokens(tmp_path):
    import json

    from PIL import Image
    from transformers import AutoProcessor

    from vllm_output_rate.demo.tiny_vision import IMAGE_TOKEN, image_seq_len

    path = build_tiny_model(tmp_path / "vision", variant="vision")
    assert is_complete(path, "vision") and not is_complete(path)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Idefics3ForConditionalGeneration"]
    vision = tiny_model_recipe.VARIANTS["vision"]["vision"]
    assert image_seq_len(vision) == 64  # (224 / 14)^2 patches, merged 2 x 2
    # Without torchvision: transformers' PIL image processor.
    processor = AutoProcessor.from_pretrained(path)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "image"},
                {"type": "text", "text": "hi"},
            ],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    pictures = [Image.new("RGB", (64, 48)), Image.new("RGB", (300, 200))]
    ids = processor(text=text, images=pictures)["input_ids"][0]
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    # Any image size: one tile, 64 image tokens each.
    assert list(ids).count(image_id) == 2 * 64
    assert config["image_token_id"] == image_id

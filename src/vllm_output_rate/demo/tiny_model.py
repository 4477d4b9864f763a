"""Build a tiny random-weight Llama model that real vLLM can serve on CPU.

No model can be downloaded in this project's environments, yet the end-to-end
tests and the demo need a model that vLLM really loads.  This module makes one
locally, deterministically and in a few seconds: a 2-layer Llama with random
weights and a small byte-level BPE tokenizer trained on embedded text.

The output is meaningless text, which is all a rate limiter needs: what it
measures is tokens, not their sense.

Variants, each in its own cache folder (the default one never changes):

* ``llama``: the default model above.
* ``echo``: the same Llama with its attention and MLP output projections
  zeroed and its embeddings tied (and scaled by 3): the residual stream is
  the current token's embedding, so the model predicts the token it was
  given. Sampled greedily it repeats the prompt's last token forever, so
  n-gram speculative decoding (which needs no draft model) finds drafts and
  the model accepts them; at temperature 1 it repeats with probability
  about 0.8, so some drafts are rejected.
* ``hybrid``: a Granite 4 style hybrid (``GraniteMoeHybridForCausalLM``): one
  Mamba2 layer and one attention layer, dense MLPs, the same tokenizer, for
  the end-to-end tests of hybrid models (vLLM's CPU build has Mamba2 kernels).

Usage::

    python -m vllm_output_rate.demo.tiny_model [--variant V] [--path P] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Bump when the recipe below changes in a way the spec hash would not see.
# It is part of the folder name, so old caches are simply left alone.
FORMAT_VERSION = 1
MODEL_DIRNAME = f"tiny-llama-v{FORMAT_VERSION}"
DEFAULT_VARIANT = "llama"
# The hybrid variant: the same sizes where they apply; the Mamba2 layer has
# 4 heads of 64 (hidden 128, expanded twice) and a state of 16.
HYBRID_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "shared_intermediate_size": 256,
    "num_local_experts": 0,  # dense: the shared MLP only
    "num_experts_per_tok": 0,
    "num_hidden_layers": 2,
    "layer_types": ["mamba", "attention"],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "mamba_n_heads": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_expand": 2,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 64,
    "max_position_embeddings": 4096,
    "position_embedding_type": "rope",
    "tie_word_embeddings": False,
}

# What each variant changes in the recipe (the default changes nothing).
VARIANTS: dict[str, dict[str, Any]] = {
    DEFAULT_VARIANT: {},
    "echo": {"tie_word_embeddings": True, "zero_layer_outputs": True, "embed_scale": 3},
    # About 23 M parameters: a decode step of several milliseconds on these
    # CPUs instead of the tiny model's 2, for benchmarks that compare a fixed
    # per-step cost with a longer step (benchmarks.engine_throughput).
    "small": {
        "shape": {
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
        }
    },
    # In the recipe, so that a change of shape rebuilds the cached model.
    "hybrid": {"hybrid_shape": HYBRID_SHAPE},
}
MARKER_NAME = ".complete"
SEED = 1234
# Weight init draws from torch's global RNG; two threads building at once
# would interleave draws and break determinism.
_RNG_LOCK = threading.Lock()

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
# Order fixes the ids: bos=0, eos=1, pad=2.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
TARGET_VOCAB_SIZE = 512

# Sizes measured to work with vLLM's CPU attention backend, which rejects
# head_dim 16; hidden 128 with 2 heads gives head_dim 64.
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# Plain prompt format; the role names are ordinary text, so no extra special
# tokens are needed.  Uses content as a string, so vLLM passes strings.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Training text for the tokenizer.  Written for this module; any English works,
# but it must stay fixed, since it determines the vocabulary.
CORPUS = """\
The morning train left the station a few minutes after seven o'clock.
Most of the passengers were reading, and a few were already asleep.
A small dog waited by the door, watching the fields go past the window.
When the rain started, the farmer covered the hay and walked back home.
She opened the letter slowly, because she knew what it would say.
The library closes at nine, but the reading room stays open until ten.
Every server has a limit, and every limit is a promise to someone else.
If one user sends a thousand requests, the others should not have to wait.
A fair scheduler gives each user a steady share of the output tokens.
The bucket fills at a constant rate and empties as tokens are produced.
He counted the coins twice, then put them back into the blue box.
The children built a castle of sand, and the tide carried it away.
Bread is made from flour, water, salt and a little patience.
The river runs north for a hundred miles before it reaches the sea.
Please write your name and address on the first line of the form.
Our meeting is on Tuesday afternoon, in the room next to the kitchen.
The old clock in the hall has not worked since the winter of the storm.
They planted apple trees along the road, one for every child in town.
A good question is often more useful than a quick answer.
The engine started with a cough, and the whole boat began to shake.
Numbers like 12, 345 and 6789 appear in tables, prices and dates.
The quick brown fox jumps over the lazy dog near the quiet river bank.
Light travels faster than sound, which is why we see lightning first.
The mountain path was narrow, steep, and covered with loose stones.
At the market, the baker sold warm rolls and small honey cakes.
Nobody remembered who had left the window open during the night.
The teacher asked the class to explain the answer in their own words.
Water boils at one hundred degrees at the level of the sea.
The garden was full of roses, tulips, and tall yellow sunflowers.
Time moves slowly when you are waiting, and quickly when you are late.
The ship's captain checked the map, the wind, and the stars above.
A network sends data in packets, and each packet finds its own way.
Rate limits protect a shared service from being used up by one client.
The cat slept on the warm stones while the sun went down behind the hill.
Coffee, tea, milk and juice were served with breakfast every day.
The museum keeps old tools, maps, coins, and letters from the war.
He learned to play the piano by listening to songs on the radio.
Winter nights are long, so people light candles and tell stories.
The bridge was painted red so that ships could see it through the fog.
Thank you for your patience; your request will be processed shortly.
"""


def _dirname(variant: str) -> str:
    if variant == DEFAULT_VARIANT:
        return MODEL_DIRNAME
    return f"tiny-{variant}-v{FORMAT_VERSION}"


def default_model_path(variant: str = DEFAULT_VARIANT) -> Path:
    """Where the model lives when no path is given.

    ``$VLLM_OUTPUT_RATE_CACHE`` wins so tests and CI can isolate the cache;
    otherwise follow the XDG base-directory convention (empty means unset).
    """
    dirname = _dirname(_check_variant(variant))
    override = os.environ.get("VLLM_OUTPUT_RATE_CACHE")
    if override:
        return Path(override).expanduser() / dirname
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "vllm-output-rate" / dirname


def _check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(
            f"unknown tiny model variant {variant!r}; choose from {sorted(VARIANTS)}"
        )
    return variant


def _library_versions() -> dict[str, str]:
    # Weights and merges depend on these libraries (RNG streams, trainer),
    # so a different install must not reuse an old build.  Reading metadata
    # avoids importing torch on the fast "already built" path.
    return {
        name: metadata.version(name) for name in ("torch", "transformers", "tokenizers")
    }


def build_spec(variant: str = DEFAULT_VARIANT) -> dict[str, Any]:
    """Everything the build output depends on; its hash goes in the marker."""
    spec = _base_spec()
    if variant != DEFAULT_VARIANT:
        spec["variant"] = {"name": variant, **VARIANTS[_check_variant(variant)]}
    return spec


def _base_spec() -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "seed": SEED,
        "shape": MODEL_SHAPE,
        "special_tokens": list(SPECIAL_TOKENS),
        "target_vocab_size": TARGET_VOCAB_SIZE,
        "chat_template": CHAT_TEMPLATE,
        "corpus": CORPUS,
        "libraries": _library_versions(),
    }


def spec_hash(variant: str = DEFAULT_VARIANT) -> str:
    blob = json.dumps(build_spec(variant), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def is_complete(path: Path, variant: str = DEFAULT_VARIANT) -> bool:
    """True if ``path`` holds a finished build of the current recipe."""
    try:
        marker = json.loads((path / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("spec_hash") == spec_hash(variant)


def train_tokenizer() -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``CORPUS`` and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Byte level: every byte has a token, so any text encodes and ASCII
    # decodes back exactly.  No prefix space, so round-trips are exact.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    # Prepend bos on encode(), as Llama tokenizers do; vLLM's chat path
    # renders bos through the template and then skips special tokens.
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {
        "bos_token_id": tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    }


def save_model(
    directory: Path,
    vocab_size: int,
    ids: dict[str, int],
    variant: str = DEFAULT_VARIANT,
) -> None:
    """Save a seeded random ``LlamaForCausalLM`` (or, for the hybrid
    variant, ``GraniteMoeHybridForCausalLM``) and its generation config."""
    import torch
    from transformers import (
        GenerationConfig,
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedModel,
    )

    changes = VARIANTS[_check_variant(variant)]
    model_class: type[PreTrainedModel] = LlamaForCausalLM
    if "hybrid_shape" in changes:
        model_class = GraniteMoeHybridForCausalLM
        config = GraniteMoeHybridConfig(
            vocab_size=vocab_size, **changes["hybrid_shape"], **ids
        )
    else:
        shape = {**MODEL_SHAPE, **changes.get("shape", {})}
        if "tie_word_embeddings" in changes:
            shape["tie_word_embeddings"] = changes["tie_word_embeddings"]
        config = LlamaConfig(vocab_size=vocab_size, **shape, **ids)
    # Seed right before construction: weight init is the only RNG consumer,
    # which makes the safetensors file byte-identical across builds.  fork_rng
    # restores the caller's RNG state afterwards (e.g. a test's own seed).
    with _RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = model_class(config).to(torch.float32).eval()
    with torch.no_grad():
        if changes.get("zero_layer_outputs"):
            # Each layer then adds nothing to the residual stream.
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        if "embed_scale" in changes:
            model.model.embed_tokens.weight.mul_(changes["embed_scale"])
    model.save_pretrained(directory, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(directory)


def _file_digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def _write_marker(directory: Path, variant: str) -> None:
    # Written last: its presence is what makes a folder count as complete.
    marker = {"spec_hash": spec_hash(variant), "files": _file_digests(directory)}
    (directory / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True))


def _build_into(directory: Path, variant: str) -> None:
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(directory)
    save_model(directory, len(tokenizer), _token_ids(tokenizer), variant)
    _write_marker(directory, variant)


def _discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _install(staging: Path, target: Path, *, force: bool, variant: str) -> None:
    """Move a finished ``staging`` folder to ``target`` by rename.

    A rename is atomic, so no reader ever sees a half-written folder (while a
    forced rebuild swaps folders there is briefly none, and a reader then
    builds its own).  If another process installed a complete build first,
    keep theirs (unless forced): both are identical anyway.
    """
    last_error: OSError | None = None
    for _ in range(3):
        try:
            staging.rename(target)  # fails if target exists and is not empty
            return
        except OSError as exc:
            last_error = exc
        if is_complete(target, variant) and not force:
            _discard(staging)
            return
        # Stale, incomplete or forced: move it aside, then retry the rename.
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        with contextlib.suppress(FileNotFoundError):
            target.rename(trash / target.name)
        _discard(trash)
    raise RuntimeError(f"could not install tiny model at {target}") from last_error


def build_tiny_model(
    path: Path | None = None,
    *,
    force: bool = False,
    variant: str = DEFAULT_VARIANT,
) -> Path:
    """Build the tiny model at ``path`` (default: ``default_model_path()``).

    Returns the model folder.  Does nothing if a complete build of the same
    recipe is already there, unless ``force`` is true.
    """
    _check_variant(variant)
    target = Path(path) if path is not None else default_model_path(variant)
    if not force and is_complete(target, variant):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # A sibling on the same filesystem, so the final rename is atomic; a
    # unique name, so concurrent builders never write into the same folder.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    # mkdtemp makes the folder private (0700); a shared cache should be readable.
    staging.chmod(0o755)
    try:
        _build_into(staging, variant)
        _install(staging, target, force=force, variant=variant)
    finally:
        _discard(staging)  # no-op after a successful rename
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_output_rate.demo.tiny_model",
        description="Build (if needed) the tiny test model and print its path.",
    )
    parser.add_argument("--path", type=Path, default=None, help="model folder")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    parser.add_argument(
        "--variant", choices=sorted(VARIANTS), default=DEFAULT_VARIANT, help="model"
    )
    args = parser.parse_args(argv)
    print(build_tiny_model(args.path, force=args.force, variant=args.variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())

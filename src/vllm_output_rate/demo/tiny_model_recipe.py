"""The tiny model's recipe: a random-weight model and tokenizer, made locally.

No model can be downloaded in this project's environments, yet the tests,
benchmarks and demo need one that real vLLM loads on CPU. ``train_tokenizer``
trains a small byte-level BPE on the embedded ``CORPUS``; ``save_model``
saves a seeded 2-layer Llama with random weights (meaningless text, which is
all a rate limiter needs: it counts tokens). Both are deterministic, and
``build_spec`` holds everything they depend on: its hash names a build.

Variants (``VARIANTS``; the default one never changes):

* ``llama``: the default model above; ``small``: about 23 M parameters.
* ``echo``: attention and MLP outputs zeroed, embeddings tied and scaled by
  3: the residual stream is the current token's embedding, so the model
  predicts the token it was given, and n-gram speculative decoding finds
  drafts it accepts (greedily always, at temperature 1 about 80 %).
* ``hybrid``: a Granite 4 style hybrid (one Mamba2 and one attention layer,
  dense MLPs; vLLM's CPU build has Mamba2 kernels), for hybrid models' tests.
* ``vision``: an Idefics3 (SmolVLM's architecture) over the tiny Llama, for
  image inputs (``tiny_vision.py``).
"""

from __future__ import annotations

import hashlib
import json
import threading
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Bump when the recipe below changes in a way the spec hash would not see.
# It is part of the folder name, so old caches are simply left alone.
FORMAT_VERSION = 1
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
    # 224-pixel images in patches of 14, merged 2 x 2: 64 image tokens each.
    "vision": {
        "vision": {
            "image_size": 224,
            "patch_size": 14,
            "scale_factor": 2,
            "encoder_shape": {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            },
            # Bump when tiny_vision.py's tokens or template change.
            "version": 1,
        }
    },
}
SEED = 1234
# Weight init draws from torch's global RNG; two threads building at once
# would interleave draws and break determinism.
RNG_LOCK = threading.Lock()

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


def check_variant(variant: str) -> str:
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
        spec["variant"] = {"name": variant, **VARIANTS[check_variant(variant)]}
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


def token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
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

    changes = VARIANTS[check_variant(variant)]
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
    with RNG_LOCK, torch.random.fork_rng(devices=[]):
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

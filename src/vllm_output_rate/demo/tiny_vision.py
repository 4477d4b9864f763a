"""The tiny model's vision variant: a random-weight Idefics3 (SmolVLM's
architecture), for tests of image inputs end to end.

vLLM's CPU build serves Idefics3 without torchvision (which this project's
environment cannot import; docs/architecture.md, "Multimodal models"), and
transformers has a PIL image processor for it. The text side is the tiny Llama
(``tiny_model_recipe``) with the image tokens added to its tokenizer; the
vision side one ViT layer. Image splitting is off, so every image is one
tile of ``VISION["image_size"]`` pixels, ``image_seq_len`` (64) image tokens
wrapped in three more: what a request's images cost in prompt tokens.
Deterministic like the other variants (seeded, fixed inputs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_output_rate.demo import tiny_model_recipe as recipe

IMAGE_TOKEN = "<image>"
# Idefics3's processor wraps each image's tokens in these; the row/column
# tokens are only used with image splitting, which is off, but the
# processor looks them up.
SPECIAL = [
    "<fake_token_around_image>",
    IMAGE_TOKEN,
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)),
]
# Image parts of a message become the image token; text parts stay text.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def image_seq_len(vision: dict[str, Any]) -> int:
    """Image tokens per image: the patches, merged by the pixel shuffle."""
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    return int(patches // vision["scale_factor"] ** 2)


def save_vision_model(directory: Path, vision: dict[str, Any]) -> None:
    """Save the tokenizer, processor, seeded model and generation config."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    tokenizer = recipe.train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = CHAT_TEMPLATE
    size = {"longest_edge": vision["image_size"]}
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size=size, max_image_size=size, do_image_splitting=False
        ),
        tokenizer=tokenizer,
        image_seq_len=image_seq_len(vision),
        chat_template=CHAT_TEMPLATE,
    )
    ids = recipe.token_ids(tokenizer)
    config = Idefics3Config(
        vision_config=Idefics3VisionConfig(
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            **vision["encoder_shape"],
        ).to_dict(),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer), **recipe.MODEL_SHAPE, **ids
        ).to_dict(),
        scale_factor=vision["scale_factor"],
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        tie_word_embeddings=False,
        **ids,
    )
    with recipe.RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.SEED)
        model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(directory)
    processor.save_pretrained(directory)

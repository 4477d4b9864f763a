"""What this plugin supports: the vLLM version and the engine configuration.

Both checks raise with a message that names the option and says why, at
start-up, before a single request is served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_output_rate.validation import OutputRateConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The scheduler subclass overrides private methods of vLLM's V1 scheduler
# (see seams.py); their behaviour is pinned by tests against these releases.
SUPPORTED_VLLM = SpecifierSet(">=0.32,<0.34")


class UnsupportedVllmError(RuntimeError):
    pass


def check_vllm_version(version: str | None = None) -> str:
    """Refuse a vLLM release outside ``SUPPORTED_VLLM``; return the version."""
    if version is None:
        import vllm

        version = vllm.__version__
    if not SUPPORTED_VLLM.contains(Version(version), prereleases=True):
        raise UnsupportedVllmError(
            f"vllm-output-rate supports vLLM {SUPPORTED_VLLM} but vLLM {version} is "
            "installed. Install a supported release (vllm-output-rate[cpu] or "
            "vllm-output-rate[cuda]) or a vllm-output-rate built for this vLLM."
        )
    return version


def check_supported_config(vllm_config: VllmConfig) -> None:
    """Reject engine settings that would break the per-user accounting.

    The reasons follow the specification: speculative decoding samples several
    tokens per step but a request is charged one; every data-parallel rank
    would keep its own budget for the same user; the other modes change how
    steps are split, skipped or preempted in ways this scheduler does not
    cover.
    """
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    rejections: list[tuple[bool, str]] = [
        (
            parallel.data_parallel_size > 1,
            f"--data-parallel-size {parallel.data_parallel_size}: every rank "
            "would keep its own budget, so a user would get one budget per rank",
        ),
        (
            parallel.pipeline_parallel_size > 1,
            f"--pipeline-parallel-size {parallel.pipeline_parallel_size}: several "
            "micro-batches in flight are not covered by the skip/preempt logic",
        ),
        (
            model is not None and model.is_multimodal_model,
            "multimodal models: encoder inputs are not covered",
        ),
        (
            model is not None and model.is_encoder_decoder,
            "encoder-decoder models are not covered",
        ),
        (model is not None and model.is_hybrid, "hybrid (Mamba) models"),
        (
            model is not None and model.is_attention_free,
            "attention-free models are not covered",
        ),
        (model is not None and model.is_diffusion, "diffusion models"),
        (
            model is not None and model.runner_type == "pooling",
            "pooling models produce no output tokens",
        ),
        (
            vllm_config.kv_transfer_config is not None,
            "KV connectors (--kv-transfer-config) change the KV lifecycle",
        ),
        (
            vllm_config.ec_transfer_config is not None,
            "EC connectors (--ec-transfer-config) change the encoder cache lifecycle",
        ),
        (
            vllm_config.aux_output_config.enabled,
            "auxiliary output connectors",
        ),
        (
            vllm_config.cache_config.kv_offloading_size is not None,
            "KV offloading (--kv-offloading-size) changes the KV lifecycle",
        ),
    ]
    reasons = [reason for rejected, reason in rejections if rejected]
    if reasons:
        raise OutputRateConfigError(
            "per-user output rate limiting (--default-user-output-tokens-per-second)"
            " cannot be combined with: " + "; ".join(reasons)
        )

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


def refused_options(vllm_config: VllmConfig, *, store: bool = False) -> list[str]:
    """The engine settings that per-user limits cannot be combined with.

    Each reason says why and what would lift it. Lifted (see
    docs/architecture.md, "Engine modes"): speculative decoding (a step is
    charged the most it can emit, the rest is given back), pipeline
    parallelism (any number of steps in flight), hybrid and attention-free
    (Mamba) models (the hold-back ends on a state block boundary),
    multimodal models (the hold-back never splits an unsplittable
    placeholder), KV offloading and KV connectors (a new request whose KV
    may come from outside is not admitted while throttled), LoRA (resident
    adapters count against --max-loras), data parallelism with a shared
    store (``store``: the ranks lease one budget per user).
    """
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    scheduler = vllm_config.scheduler_config
    rejections: list[tuple[bool, str]] = [
        (
            parallel.data_parallel_size > 1 and not store,
            f"--data-parallel-size {parallel.data_parallel_size} without "
            "--output-rate-store: every rank would keep its own budget, so a user "
            "would get one budget per rank (give --output-rate-store URL to share "
            "one budget through Redis/Valkey)",
        ),
        (
            model is not None and model.is_encoder_decoder,
            "encoder-decoder models: the encoder input is scheduled with the "
            "first decoder chunk, which the hold-back and the skip are not "
            "verified against (lifted by scheduler tests of such requests)",
        ),
        (
            model is not None and model.is_diffusion,
            "diffusion models: a step emits a canvas of tokens, not sampled "
            "tokens, so what a step delivers is not what is charged",
        ),
        (
            model is not None and model.runner_type == "pooling",
            "pooling models produce no output tokens: there is nothing to limit",
        ),
        (
            vllm_config.ec_transfer_config is not None,
            "EC connectors (--ec-transfer-config): encoder outputs fetched from "
            "another instance are not verified against the hold-back and the "
            "skip (lifted by scheduler tests with such a connector)",
        ),
        (
            vllm_config.aux_output_config.enabled,
            "auxiliary output connectors: not verified against the skip of "
            "throttled requests",
        ),
        (
            getattr(scheduler, "prefill_schedule_interval", 1) > 1,
            f"--prefill-schedule-interval "
            f"{getattr(scheduler, 'prefill_schedule_interval', 1)}: vLLM 0.33 "
            "holds every prefill back while a running request decodes, and "
            "throttled residents count as decoding, so a new user's first "
            "token would wait for throttled users' tokens (on vLLM 0.32 it "
            "only applies with data parallelism)",
        ),
    ]
    return [reason for rejected, reason in rejections if rejected]


def check_supported_config(vllm_config: VllmConfig, *, store: bool = False) -> None:
    """Raise OutputRateConfigError naming every refused setting (``store``:
    a shared budget store is configured)."""
    reasons = refused_options(vllm_config, store=store)
    if reasons:
        raise OutputRateConfigError(
            "per-user output rate limiting (--default-user-output-tokens-per-second)"
            " cannot be combined with: " + "; ".join(reasons)
        )

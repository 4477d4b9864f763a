"""Entry point of the ``vllm.general_plugins`` group (see pyproject.toml).

vLLM calls ``register()`` in every process it starts (API server, engine
core, workers). It refuses an unsupported vLLM before anything else and
installs the wrappers listed in ``seams.py``. With the plugin installed but
``--default-user-output-tokens-per-second`` not given, vLLM runs its own
scheduler: the wrappers then only add the flags to ``--help``.
"""

from __future__ import annotations

from vllm_output_rate.integration import seams
from vllm_output_rate.integration.compat import check_vllm_version


def register() -> None:
    check_vllm_version()
    seams.verify_seams(api=False)
    seams.install()

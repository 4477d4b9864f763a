"""``python -m vllm_output_rate.cli``: the same as ``vllm-output-rate``."""

import sys

from vllm_output_rate.cli import main

sys.exit(main())

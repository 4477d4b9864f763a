"""``vllm-output-rate demo``: the noisy-neighbour demo (``demo/run.py``)."""

from __future__ import annotations

import argparse

from vllm_output_rate.demo import run as demo_run

HELP = "noisy-neighbour demo: the same load on stock vLLM, then with limits"


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    p = subparsers.add_parser("demo", help=HELP, description=HELP)
    demo_run.add_arguments(p)
    p.set_defaults(func=demo_run.run)

"""``vllm-output-rate demo``: the scarce-engine demo (``demo/run.py``)."""

from __future__ import annotations

import argparse

from vllm_output_rate.demo import run as demo_run

HELP = "demo: a light user beside a hog on a scarce engine, stock vLLM vs limits"


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    p = subparsers.add_parser("demo", help=HELP, description=HELP)
    demo_run.add_arguments(p)
    p.set_defaults(func=demo_run.run)

"""``vllm-output-rate top``: the live per-user view (``vllm_output_rate/top.py``)."""

from __future__ import annotations

import argparse

from vllm_output_rate import top as live_view
from vllm_output_rate.cli.common import fail

HELP = "live table of each user's limit, delivered rate and throttling"


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    p = subparsers.add_parser("top", help=HELP, description=HELP)
    live_view.add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return live_view.run(args)
    except live_view.TopError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return 0  # the way to quit a live view

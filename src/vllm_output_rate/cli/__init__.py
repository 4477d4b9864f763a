"""The ``vllm-output-rate`` command line: plain argparse subcommands.

Each subcommand is a module here with an ``add_parser(subparsers)`` that adds
its parser and arguments and sets ``func`` (``argparse.Namespace -> exit
code``); ``build_parser`` lists them.  To add one, write such a module and
add a line to ``build_parser``.

- ``load`` (alias ``bench``): drive a running vLLM OpenAI server with
  per-user load and report the measured per-user output rates (an example:
  docs/operations.md, "Measuring a deployment: the load tool");
- ``demo``: the noisy-neighbour demo (stock vLLM, then with limits);
- ``hash-key``: the digest of an API key for ``--output-rate-api-keys``;
- ``top``: a live table of every user with traffic, from the admin endpoint.

Exit codes: 0 success; 1 the server was unreachable or any request failed
(or, with ``load --fail-on-bound``, a limit's bound was exceeded); 2 bad
arguments; 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vllm_output_rate.cli import demo, hash_key, load, top
from vllm_output_rate.cli.common import PROG


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Per-user output-token rate limits for vLLM: tools.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    load.add_parser(subparsers)
    demo.add_parser(subparsers)
    hash_key.add_parser(subparsers)
    top.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    return code

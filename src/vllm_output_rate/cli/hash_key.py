"""``vllm-output-rate hash-key``: the digest of an API key for a keys file."""

from __future__ import annotations

import argparse
import sys

from vllm_output_rate.api_keys import digest
from vllm_output_rate.cli.common import fail

HELP = "print the digest of an API key for --output-rate-api-keys files"


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    p = subparsers.add_parser("hash-key", help=HELP, description=HELP)
    p.add_argument("key", nargs="?", help="the API key (default: read stdin)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key:
        return fail("an empty API key cannot be used", 2)
    print(digest(key))
    return 0

"""``vllm-output-rate load`` (alias ``bench``): per-user load against a server.

Drives a running vLLM OpenAI server with the users of ``--users`` (the load
tool, ``vllm_output_rate.loadtest``), prints one row per user (tokens, rate,
TTFT, whether the bound held for the limits of ``--limits``) and can write
the full results as JSON and a chart of tokens per second.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from vllm_output_rate.cli.common import PROG, fail, positive_float, positive_int
from vllm_output_rate.cli.progress import ProgressLine
from vllm_output_rate.loadtest import (
    CAVEAT,
    DEFAULT_PROMPT,
    LoadError,
    LoadResult,
    LoadSpec,
    UserLoad,
    list_models_sync,
    run_load_sync,
)
from vllm_output_rate.loadtest.spec import ENDPOINT_PATHS, any_api_key

HELP = "measure per-user output tok/s against a running vLLM server"
# In --users / --limits, this name means "no output_rate_user" (anonymous).
ANONYMOUS_TOKEN = "-"


def _split_pairs(text: str, what: str) -> list[tuple[str, str | None]]:
    pairs: list[tuple[str, str | None]] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, text_value = item.rpartition(":")
        value: str | None = text_value
        if not sep:
            name, value = item, None
        name = name.strip()
        if not name:
            raise argparse.ArgumentTypeError(
                f"{what}: empty user name in {item!r} "
                f"(use {ANONYMOUS_TOKEN!r} for anonymous requests)"
            )
        pairs.append((name, value))
    if not pairs:
        raise argparse.ArgumentTypeError(f"{what}: no users given")
    return pairs


def _user_name(token: str) -> str | None:
    return None if token == ANONYMOUS_TOKEN else token


def parse_users(text: str) -> list[UserLoad]:
    """``'user-a:4,user-b:1,-:2'`` -> UserLoads (``-`` = anonymous; a name
    without ``:N`` gets one stream)."""
    users: list[UserLoad] = []
    seen: set[str | None] = set()
    for token, value in _split_pairs(text, "--users"):
        name = _user_name(token)
        if name in seen:
            raise argparse.ArgumentTypeError(f"--users: {token!r} is listed twice")
        seen.add(name)
        try:
            streams = 1 if value is None else int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--users: streams for {token!r} must be an integer, got {value!r}"
            ) from None
        if streams < 1:
            raise argparse.ArgumentTypeError(
                f"--users: streams for {token!r} must be >= 1, got {streams}"
            )
        users.append(UserLoad(name=name, streams=streams))
    return users


def parse_limits(text: str) -> dict[str | None, float]:
    """``'user-a:20,user-b:100'`` -> ``{"user-a": 20.0, "user-b": 100.0}``."""
    limits: dict[str | None, float] = {}
    for token, value in _split_pairs(text, "--limits"):
        if value is None:
            raise argparse.ArgumentTypeError(
                f"--limits: {token!r} needs a rate, e.g. {token}:20"
            )
        try:
            rate = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--limits: rate for {token!r} must be a number, got {value!r}"
            ) from None
        if not (math.isfinite(rate) and rate > 0):
            raise argparse.ArgumentTypeError(
                f"--limits: rate for {token!r} must be > 0, got {value!r}"
            )
        limits[_user_name(token)] = rate
    return limits


def read_api_keys(path: str) -> dict[str, str]:
    """A YAML/JSON file mapping each user name to the API key (plain text)
    its requests carry; the client's side of the server's keys file."""
    import yaml

    try:
        content = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"--api-keys {path}: cannot read: {exc.strerror}"
        ) from None
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(
            f"--api-keys {path}: not valid YAML/JSON: {exc}"
        ) from None
    if not isinstance(content, dict) or not all(
        isinstance(user, str) and user and isinstance(key, str) and key
        for user, key in content.items()
    ):
        raise argparse.ArgumentTypeError(
            f"--api-keys {path}: expected a mapping of user name to API key, "
            'e.g. {"user-a": "sk-a"}'
        )
    return dict(content)


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    # "bench" was this command's first name; `make bench` is something else
    # (the project's benchmarks), hence "load", with the old name kept.
    p = subparsers.add_parser("load", aliases=["bench"], help=HELP, description=HELP)
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root, e.g. http://127.0.0.1:8000 (default: %(default)s)",
    )
    p.add_argument(
        "--model", default=None, help="model name (default: the server's first model)"
    )
    p.add_argument(
        "--users",
        type=parse_users,
        required=True,
        help=f"users and their concurrent streams, e.g. 'user-a:4,user-b:1'; "
        f"{ANONYMOUS_TOKEN!r} sends requests without output_rate_user",
    )
    p.add_argument(
        "--limits",
        type=parse_limits,
        default={},
        help="each user's expected limit in tok/s, e.g. 'user-a:20'; used only "
        "to check the bound (the server's own configuration sets the limits)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=200,
        help="tokens per request; sent with ignore_eos (default: %(default)s)",
    )
    p.add_argument(
        "--duration",
        type=positive_float,
        default=30.0,
        help="seconds during which new requests are started (default: %(default)s)",
    )
    p.add_argument(
        "--endpoint",
        choices=sorted(ENDPOINT_PATHS),
        default="completions",
        help="OpenAI endpoint to stream from (default: %(default)s)",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt of every request")
    p.add_argument(
        "--api-keys",
        type=read_api_keys,
        default=None,
        metavar="FILE",
        help="YAML/JSON file mapping each user of --users to its API key, for a "
        "server with --output-rate-api-keys (each user's requests carry "
        "'Authorization: Bearer KEY'; keys are never written to --json)",
    )
    p.add_argument(
        "--request-timeout",
        type=positive_float,
        default=300.0,
        help="seconds before one request is abandoned (default: %(default)s)",
    )
    p.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of tok/s per user")
    p.add_argument(
        "--fail-on-bound",
        action="store_true",
        help="exit 1 also when a user with a limit exceeded its bound",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    users: list[UserLoad] = args.users
    names = {u.name for u in users}
    unknown = [n for n in args.limits if n not in names]
    if unknown:
        shown = ", ".join(ANONYMOUS_TOKEN if n is None else n for n in unknown)
        return fail(f"--limits names users that are not in --users: {shown}", 2)
    for u in users:
        u.limit = args.limits.get(u.name)
    keys: dict[str, str] | None = args.api_keys
    if keys is not None:
        without = [ANONYMOUS_TOKEN if u.name is None else u.name for u in users]
        without = [n for n in without if n not in keys]
        if without:
            return fail(f"--api-keys has no key for: {', '.join(without)}", 2)
        extra = sorted(set(keys) - names)
        if extra:
            return fail(f"--api-keys names users not in --users: {', '.join(extra)}", 2)

    try:
        model = args.model
        if model is None:
            models = list_models_sync(args.base_url, api_key=any_api_key(keys))
            if not models:
                return fail(f"{args.base_url} serves no models")
            model = models[0]
        spec = LoadSpec(
            base_url=args.base_url,
            model=model,
            users=users,
            max_tokens=args.max_tokens,
            duration_s=args.duration,
            prompt=args.prompt,
            endpoint=args.endpoint,
            request_timeout_s=args.request_timeout,
            api_keys=keys,
        )
        total = sum(u.streams for u in users)
        print(
            f"{PROG} load: {model} at {args.base_url}, {len(users)} users, "
            f"{total} streams, {args.duration:g} s",
            file=sys.stderr,
        )
        result = run_load_sync(spec, None if args.quiet else ProgressLine())
    except LoadError as exc:
        return fail(str(exc))
    except ValueError as exc:  # LoadSpec validation
        return fail(str(exc), 2)
    _print_report(result, args)
    return _exit_code(result, fail_on_bound=args.fail_on_bound)


def _print_report(result: LoadResult, args: argparse.Namespace) -> None:
    from vllm_output_rate.loadtest.report import format_table, plot_rates

    print(format_table(result))
    print()
    print(CAVEAT)
    if args.json:
        print(f"wrote {result.write_json(args.json)}")
    if args.plot:
        print(f"wrote {plot_rates({'': result}, args.plot)}")


def _exit_code(result: LoadResult, *, fail_on_bound: bool) -> int:
    """1 if a request failed or a client count differs from the server's
    usage (or, with ``fail_on_bound``, a bound was exceeded); else 0."""
    code = 0
    if not result.ok:
        failed = len(result.failed_requests)
        lines = "\n".join(f"  {line}" for line in result.error_summary())
        code = fail(f"{failed} of {len(result.records)} requests failed:\n{lines}")
    mismatched = [u.label for u in result.users if not u.tokens_agree]
    if mismatched:
        code = fail(
            "client token counts differ from the server's usage for: "
            + ", ".join(mismatched)
        )
    broken = [u.label for u in result.users if u.bound_ok is False]
    if broken:
        print(f"bound exceeded for: {', '.join(broken)}", file=sys.stderr)
        if fail_on_bound:
            code = 1
    return code

"""The ``vllm-output-rate`` command line.

Subcommands are registered in one place, ``SUBCOMMANDS``: each is a name, a
one-line help, a function adding its arguments to an argparse parser and a
function running it (``argparse.Namespace -> exit code``).  Add one with
``register(Subcommand(...))`` or by appending to the list.

``bench`` drives a running vLLM OpenAI server with per-user load and reports
the measured per-user output rates::

    vllm-output-rate bench --base-url http://127.0.0.1:8000 \\
        --users 'user-a:4,user-b:1' --limits 'user-a:20,user-b:100' \\
        --max-tokens 200 --duration 30 --json out.json --plot out.png

Exit codes: 0 all requests completed; 1 the server was unreachable or any
request failed (or, with ``--fail-on-bound``, a limit's bound was exceeded);
2 bad arguments; 130 interrupted.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from vllm_output_rate.loadtest.loadgen import (
    CAVEAT,
    DEFAULT_PROMPT,
    ENDPOINT_PATHS,
    LoadError,
    LoadSpec,
    ProgressSnapshot,
    UserLoad,
    list_models_sync,
    run_load_sync,
)

PROG = "vllm-output-rate"
# In --users / --limits, this name means "no output_rate_user" (anonymous).
ANONYMOUS_TOKEN = "-"


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: list[Subcommand] = []


def register(command: Subcommand) -> Subcommand:
    """Add a subcommand (replacing one of the same name)."""
    SUBCOMMANDS[:] = [c for c in SUBCOMMANDS if c.name != command.name]
    SUBCOMMANDS.append(command)
    return command


# --------------------------------------------------------------------------
# Argument parsing helpers
# --------------------------------------------------------------------------


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


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


# --------------------------------------------------------------------------
# Progress line
# --------------------------------------------------------------------------


class ProgressLine:
    """Elapsed time and tokens per user on stderr: one line rewritten in
    place on a terminal, a new line every ``plain_every_s`` otherwise."""

    def __init__(self, stream: TextIO | None = None, plain_every_s: float = 5.0):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.plain_every_s = plain_every_s
        self._last_plain = -math.inf
        self._width = 0

    @staticmethod
    def render(s: ProgressSnapshot) -> str:
        users = "  ".join(
            f"{label} {tokens:,} tok" for label, tokens in s.tokens.items()
        )
        failed = sum(s.requests_failed.values())
        text = (
            f"[{min(s.elapsed_s, 9999):6.1f}s / {s.duration_s:g}s] {users}"
            f"  | in flight {s.in_flight}"
        )
        if failed:
            text += f"  | {failed} failed"
        return text

    def __call__(self, snapshot: ProgressSnapshot) -> None:
        text = self.render(snapshot)
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
            if snapshot.done:
                self.stream.write("\n")
        else:
            now = time.monotonic()
            if not snapshot.done and now - self._last_plain < self.plain_every_s:
                return
            self._last_plain = now
            self.stream.write(text + "\n")
        self.stream.flush()


# --------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------


def _configure_bench(p: argparse.ArgumentParser) -> None:
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
        type=_positive_int,
        default=200,
        help="tokens per request; sent with ignore_eos (default: %(default)s)",
    )
    p.add_argument(
        "--duration",
        type=_positive_float,
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
        "--request-timeout",
        type=_positive_float,
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


def _run_bench(args: argparse.Namespace) -> int:
    from vllm_output_rate.loadtest.report import format_table, plot_rates

    users: list[UserLoad] = args.users
    names = {u.name for u in users}
    unknown = [n for n in args.limits if n not in names]
    if unknown:
        shown = ", ".join(ANONYMOUS_TOKEN if n is None else n for n in unknown)
        return _fail(f"--limits names users that are not in --users: {shown}", 2)
    for u in users:
        u.limit = args.limits.get(u.name)

    try:
        model = args.model
        if model is None:
            models = list_models_sync(args.base_url)
            if not models:
                return _fail(f"{args.base_url} serves no models")
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
        )
        progress = None if args.quiet else ProgressLine()
        total = sum(u.streams for u in users)
        print(
            f"{PROG} bench: {model} at {args.base_url}, {len(users)} users, "
            f"{total} streams, {args.duration:g} s",
            file=sys.stderr,
        )
        result = run_load_sync(spec, progress)
    except LoadError as exc:
        return _fail(str(exc))
    except ValueError as exc:  # LoadSpec validation
        return _fail(str(exc), 2)

    print(format_table(result))
    print()
    print(CAVEAT)
    if args.json:
        print(f"wrote {result.write_json(args.json)}")
    if args.plot:
        print(f"wrote {plot_rates({'': result}, args.plot)}")

    code = 0
    if not result.ok:
        failed = len(result.failed_requests)
        lines = "\n".join(f"  {line}" for line in result.error_summary())
        _fail(f"{failed} of {len(result.records)} requests failed:\n{lines}")
        code = 1
    mismatched = [u.label for u in result.users if not u.tokens_agree]
    if mismatched:
        _fail(
            "client token counts differ from the server's usage for: "
            + ", ".join(mismatched)
        )
        code = 1
    broken = [u.label for u in result.users if u.bound_ok is False]
    if broken:
        print(f"bound exceeded for: {', '.join(broken)}", file=sys.stderr)
        if args.fail_on_bound:
            code = 1
    return code


def _fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


register(
    Subcommand(
        name="bench",
        help="measure per-user output tok/s against a running vLLM server",
        configure=_configure_bench,
        run=_run_bench,
    )
)


def _configure_demo(p: argparse.ArgumentParser) -> None:
    from vllm_output_rate.demo.run import add_arguments

    add_arguments(p)


def _run_demo(args: argparse.Namespace) -> int:
    from vllm_output_rate.demo.run import run

    return run(args)


register(
    Subcommand(
        name="demo",
        help="noisy-neighbour demo: the same load on stock vLLM, then with limits",
        configure=_configure_demo,
        run=_run_demo,
    )
)


def _configure_hash_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", nargs="?", help="the API key (default: read stdin)")


def _run_hash_key(args: argparse.Namespace) -> int:
    from vllm_output_rate.api_keys import digest

    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key:
        return _fail("an empty API key cannot be used", 2)
    print(digest(key))
    return 0


register(
    Subcommand(
        name="hash-key",
        help="print the digest of an API key for --output-rate-api-keys files",
        configure=_configure_hash_key,
        run=_run_hash_key,
    )
)


def _configure_top(p: argparse.ArgumentParser) -> None:
    from vllm_output_rate.top import add_arguments

    add_arguments(p)


def _run_top(args: argparse.Namespace) -> int:
    from vllm_output_rate.top import TopError, run

    try:
        return run(args)
    except TopError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 0  # the way to quit a live view


register(
    Subcommand(
        name="top",
        help="live table of each user's limit, delivered rate and throttling",
        configure=_configure_top,
        run=_run_top,
    )
)


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Per-user output-token rate limits for vLLM: tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in SUBCOMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.configure(p)
        p.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args._run(args)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())

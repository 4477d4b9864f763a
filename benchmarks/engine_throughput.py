"""1b. Engine throughput when limits do not bind: the throughput benchmark's
load through vLLM's offline ``LLM`` class, stock against ours, paired rounds.

``LLM`` runs the same engine-core and model-worker processes, scheduler, KV
cache manager and model as the OpenAI server, without the HTTP front end. On
this 2-core machine the server's throughput for one and the same load varies
up to tenfold between runs, for stock vLLM and ours alike (the slow state in
section 1), while the engine driven this way has not shown that state; so
the scheduler's effect on throughput is measured here, and the server figure
is kept beside it.

Each server kind lives in its own child process (``--child``) for the whole
benchmark, so start-up is paid once; the parent sends ``run`` and reads one
JSON line per round.

On its own (``make bench`` runs it within sections 1, 8 and 9)::

    PYTHONPATH=tests:. python -m benchmarks.engine_throughput \
        [--saturated | --speculative] [--variant small] [--quick] \
        [--work-dir DIR]

``--variant small`` runs a 23 M-parameter model of the same family, whose
decode step is several times the tiny model's: the plugin's cost per step
is fixed, so its share of a step depends on the step's length.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from benchmarks import hooks, step_timing
from benchmarks.measure import median, quartiles
from benchmarks.noise import OthersCpu, tree_cpu
from benchmarks.progress import log
from benchmarks.servers import DEFAULT_LIMIT
from vllm_output_rate.demo.server import DEFAULT_ENV
from vllm_output_rate.demo.tiny_model_recipe import DEFAULT_VARIANT, VARIANTS

# Paired rounds: two runs of the same code with 16 differed by 2-4 % here,
# more than the 0.98 targets leave; 32 narrow the median's spread by √2.
ROUNDS = 32
QUICK_ROUNDS = 4
STREAMS = 32
MAX_TOKENS = 256
GENERATES_PER_ROUND = 4  # about 2 s of decoding per round here
WARMUP_GENERATES = 8  # the first rounds after start-up ran a few % slow
# Untimed, at the start of each run: the first seconds after switching from
# one engine to the other ran 5-10 % slower than the same engine's next run
# (so the second run of every round lost, whichever engine it was).
WARMUP_PER_RUN = 1
PROMPT_TOKEN_IDS = [1, 45, 49, 173, 170, 43, 172, 97]  # tiny model's vocab
READY_TIMEOUT_S = 600.0
ROUND_TIMEOUT_S = 300.0
KINDS = ("stock", "ours")
# The same engines on a saturated load (section 9, benchmarks.fair_shares):
# few active slots, users with weights and a floor on ours.
SATURATED = "-saturated"
SATURATED_KINDS = ("stock" + SATURATED, "ours" + SATURATED)
# The same engines with n-gram speculation on the echo model (section 8,
# benchmarks.speculative), limits far above demand on ours.
SPECULATIVE = "-speculative"
SPECULATIVE_KINDS = ("stock" + SPECULATIVE, "ours" + SPECULATIVE)
# "ours" leasing its limits from the store at this URL (benchmarks/store.py).
STORE_KIND = "ours-store"
STORE_URL_ENV = "VLLM_OUTPUT_RATE_BENCH_STORE_URL"
# After each message vLLM's model worker keeps polling its shared-memory
# queue for a second (SpinCondition.busy_loop_s), pinned to the same core as
# the other engine's worker: a run that starts within that second shares the
# core with it. Before each run, wait until both engines' processes are idle.
IDLE_CORES = 0.1
IDLE_SAMPLE_S = 0.25
IDLE_MAX_WAIT_S = 10.0


# ----- child: one LLM, driven over stdin/stdout ------------------------------


def build_engine(kind: str, model: str) -> tuple[Any, list[Any], list[Any], Load]:
    """One ``kind``'s ``LLM``, with its load's sampling parameters and
    prompts (also for ``benchmarks.engine_profile``)."""
    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = {}
    saturated = kind.endswith(SATURATED)
    base = kind.removesuffix(SATURATED).removesuffix(SPECULATIVE)
    if kind.endswith(SPECULATIVE):
        from benchmarks.speculative import SPECULATION

        extra["speculative_config"] = SPECULATION
    if base in ("ours", STORE_KIND):
        section: dict[str, Any] = {
            "default_user_output_tokens_per_second": DEFAULT_LIMIT
        }
        if kind == STORE_KIND:
            section["store_url"] = os.environ[STORE_URL_ENV]
        if saturated:
            from benchmarks.fair_shares import FAIRNESS_CONFIG

            section.update(FAIRNESS_CONFIG)
        extra["additional_config"] = {"output_rate": section}
    load = load_for(saturated)
    if saturated:
        from benchmarks.fair_shares import ENGINE_LIMITS

        extra.update(ENGINE_LIMITS)
    # The same engine settings as the benchmark servers (demo/server.py and
    # servers.SERVER_ARGS).
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        **({"max_num_seqs": 64} | extra),
    )
    params = [
        SamplingParams(
            max_tokens=load.max_tokens,
            ignore_eos=True,
            # Greedy with speculation: the echo model's drafts are accepted.
            **({"temperature": 0.0} if kind.endswith(SPECULATIVE) else {}),
            extra_args={"output_rate_user": user} if user else None,
        )
        for user in load.users
    ]
    prompts = [{"prompt_token_ids": PROMPT_TOKEN_IDS}] * len(load.users)
    return llm, params, prompts, load


def _child(kind: str, model: str) -> None:
    llm, params, prompts, load = build_engine(kind, model)
    scheduler_cls = llm.llm_engine.vllm_config.scheduler_config.scheduler_cls
    _warm_up(llm, params, prompts, load, WARMUP_GENERATES)
    _reply({"ready": True, "scheduler_cls": str(scheduler_cls)})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        _warm_up(llm, params, prompts, load, WARMUP_PER_RUN)
        if load.continuous:
            tokens, seconds = _continuous_round(
                llm, params, prompts, load.tokens_per_round
            )
            _reply({"tokens": tokens, "seconds": seconds})
            continue
        tokens = 0
        started = time.perf_counter()
        for _ in range(load.generates_per_round):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        _reply({"tokens": tokens, "seconds": time.perf_counter() - started})


def _warm_up(
    llm: Any, params: list[Any], prompts: list[Any], load: Load, generates: int
) -> None:
    """Untimed: ``generates`` batches of the load's requests, or as many
    tokens with the engine kept full when the timed rounds keep it full (so
    the step timing, which counts every step, is not mixed with closed
    batches' last steps)."""
    if load.continuous:
        _continuous_round(llm, params, prompts, load.tokens_for(generates))
        return
    for _ in range(generates):
        llm.generate(prompts, params, use_tqdm=False)


def _continuous_round(
    llm: Any, params: list[Any], prompts: list[Any], tokens_wanted: int
) -> tuple[int, float]:
    """``tokens_wanted`` tokens with the engine kept full: one request per
    prompt at first, and each that ends replaced at once by the same
    stream's next, until that many tokens came out (the requests still
    running then are aborted, after the clock stops). Closed batches end in
    steps with fewer requests than slots, and how many depends on the order
    requests finish in, not on the engine's speed."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    numbers = itertools.count()
    stream_of: dict[str, int] = {}

    def add(stream: int) -> None:
        request_id = f"round-{next(numbers)}"
        stream_params = params[stream].clone()
        stream_params.output_kind = RequestOutputKind.DELTA
        engine.add_request(request_id, prompts[stream], stream_params)
        stream_of[request_id] = stream

    tokens = 0
    started = time.perf_counter()
    for stream in range(len(prompts)):
        add(stream)
    while tokens < tokens_wanted:
        for output in engine.step():
            tokens += len(output.outputs[0].token_ids)
            if output.finished:
                add(stream_of.pop(output.request_id))
    seconds = time.perf_counter() - started
    engine.abort_request(list(stream_of))
    while engine.has_unfinished_requests():
        engine.step()
    return tokens, seconds


@dataclass
class Load:
    """One round's work: ``generates_per_round`` batches of one request per
    entry of ``users`` (None: anonymous), ``max_tokens`` each; or, when
    ``continuous``, as many tokens with every stream kept busy."""

    users: list[str | None]
    max_tokens: int
    generates_per_round: int
    continuous: bool = False

    def tokens_for(self, generates: int) -> int:
        """The tokens of ``generates`` batches of the load's requests."""
        return generates * len(self.users) * self.max_tokens

    @property
    def tokens_per_round(self) -> int:
        return self.tokens_for(self.generates_per_round)

    @property
    def streams(self) -> int:
        return len(self.users)


def load_for(saturated: bool) -> Load:
    """The throughput load, or section 9's saturated one."""
    if not saturated:
        return Load([None] * STREAMS, MAX_TOKENS, GENERATES_PER_ROUND)
    from benchmarks.fair_shares import ENGINE_LOAD_USERS

    return Load(list(ENGINE_LOAD_USERS), 64, 2, continuous=True)


def _reply(message: dict[str, Any]) -> None:
    # stdout carries only these lines; vLLM logs to stderr.
    print("@@" + json.dumps(message), flush=True)


# ----- parent ------------------------------------------------------------------


class _Engine:
    def __init__(self, kind: str, model: str, work_dir: Path, python_path: str) -> None:
        self.timing_path = str(work_dir / f"step-timing-{kind}.json")
        env = {
            **os.environ,
            **DEFAULT_ENV,
            "PYTHONPATH": python_path,  # with the step-timing hook first
            step_timing.PATH_ENV: self.timing_path,
        }
        if kind.startswith("stock"):
            env["VLLM_PLUGINS"] = ""  # the plugin is not even loaded
        self.kind = kind
        self.log_path = work_dir / f"engine-{kind}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.engine_throughput",
                "--child",
                kind,
                "--model",
                model,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        # A blocking readline cannot time out, so a thread reads the replies
        # and _read waits on the queue with the deadline.
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self.info = self._read(READY_TIMEOUT_S)
            hooks.check_log(self.log_path, step_timing.HOOK_NAME)
        except BaseException:
            self.process.kill()  # it failed to start: nothing to wait for
            self.close()
            raise

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the child and its engine processes."""
        return sum(tree_cpu(self.process.pid).values())

    def _pump(self) -> None:
        stdout: IO[str] = self.process.stdout  # type: ignore[assignment]
        for line in stdout:
            if line.startswith("@@"):
                self._replies.put(line[2:])
        self._replies.put(None)  # the child closed its stdout: it exited

    def _read(self, timeout_s: float) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"engine child {self.kind} did not answer in {timeout_s:g} s "
                f"(log: {self._log.name})"
            ) from None
        if reply is None:
            raise RuntimeError(
                f"engine child {self.kind} exited (log: {self._log.name})"
            )
        return json.loads(reply)

    def run_round(self) -> dict[str, Any]:
        stdin: IO[str] = self.process.stdin  # type: ignore[assignment]
        stdin.write("run\n")
        stdin.flush()
        return self._read(ROUND_TIMEOUT_S)

    def close(self) -> None:
        try:
            if self.process.stdin and not self.process.stdin.closed:
                self.process.stdin.close()
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        finally:
            self._log.close()


def wait_until_idle(engines: list[_Engine]) -> float:
    """Wait (at most IDLE_MAX_WAIT_S) until the engines' processes together
    use under IDLE_CORES cores; returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < IDLE_MAX_WAIT_S:
        before = sum(e.cpu_seconds() for e in engines)
        time.sleep(IDLE_SAMPLE_S)
        if sum(e.cpu_seconds() for e in engines) - before < IDLE_CORES * IDLE_SAMPLE_S:
            break
    return time.monotonic() - started


def engine_throughput(
    model: str,
    work_dir: Path,
    settle: Callable[[], float],
    quick: bool = False,
    kinds: tuple[str, str] = KINDS,
) -> dict[str, Any]:
    """Paired rounds of the same load on two engines, by default stock and
    'ours' (the ratio is the second over the first); ``settle`` runs before
    each measurement (the quiet-machine gate)."""
    rounds = QUICK_ROUNDS if quick else ROUNDS
    python_path = hooks.install(work_dir / "step-timing-hook", step_timing.HOOK)
    engines: dict[str, _Engine] = {}
    try:
        for kind in kinds:  # one at a time: start-up is CPU-heavy
            started = time.monotonic()
            engines[kind] = _Engine(kind, model, work_dir, python_path)
            log(f"engine {kind} ready after {time.monotonic() - started:.0f} s")
        runs: list[dict[str, Any]] = []
        for i in range(rounds):
            order = kinds if i % 2 == 0 else kinds[::-1]
            for kind in order:
                idle_wait_s = wait_until_idle(list(engines.values()))
                settle()
                with OthersCpu() as others:
                    reply = engines[kind].run_round()
                rate = reply["tokens"] / reply["seconds"]
                runs.append(
                    {
                        "round": i,
                        "engine": kind,
                        "tok_s": rate,
                        "tokens": reply["tokens"],
                        "others_cores": others.cores,
                        "idle_wait_s": idle_wait_s,
                    }
                )
                log(
                    f"engine round {i + 1}/{rounds} {kind}: {rate:,.0f} tok/s "
                    f"(waited {idle_wait_s:.1f} s for idle engines)"
                )
        scheduler_cls = {k: e.info.get("scheduler_cls") for k, e in engines.items()}
        timing = {k: step_timing.read(e.timing_path) for k, e in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    ratios = []
    for i in range(rounds):
        rate = {r["engine"]: r["tok_s"] for r in runs if r["round"] == i}
        ratios.append(rate[kinds[1]] / rate[kinds[0]])
    ratio = median(ratios)
    q1, q3 = quartiles(ratios)
    load = load_for(kinds == SATURATED_KINDS)
    return {
        "rounds": rounds,
        "streams": load.streams,
        "max_tokens": load.max_tokens,
        "generates_per_round": load.generates_per_round,
        "continuous": load.continuous,
        # The warm-ups keep the engine full too (runs since 2026-12-03 14:27).
        "continuous_warm_up": load.continuous,
        "default_limit": DEFAULT_LIMIT,
        "scheduler_cls": scheduler_cls,
        "step_timing": timing,
        "runs": runs,
        "ratios": ratios,
        "ratio_median": ratio,
        "ratio_quartiles": [q1, q3],
    }


def main() -> None:
    """A run on its own (section 1b's load, or section 9's with
    ``--saturated``), or, with ``--child``, one engine of a run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--child",
        choices=(*KINDS, STORE_KIND, *SATURATED_KINDS, *SPECULATIVE_KINDS),
        help="(internal) serve one engine kind to the parent",
    )
    parser.add_argument("--model", help="model folder (default: the tiny model)")
    parser.add_argument(
        "--variant",
        default=DEFAULT_VARIANT,
        choices=sorted(VARIANTS),
        help="tiny model variant when no --model is given (small: a longer step)",
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--saturated", action="store_true", help="section 9's load")
    load.add_argument(
        "--speculative",
        action="store_true",
        help="section 8's: n-gram speculation on the echo variant",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds, not {ROUNDS}"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=Path("results/bench-engine")
    )  # results/ is git-ignored
    args = parser.parse_args()
    if args.child:
        if not args.model:
            parser.error("--child needs --model")
        _child(args.child, args.model)
        return
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    variant = "echo" if args.speculative else args.variant
    model = args.model or str(build_tiny_model(variant=variant))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    kinds = KINDS
    if args.saturated:
        kinds = SATURATED_KINDS
    elif args.speculative:
        kinds = SPECULATIVE_KINDS
    results = engine_throughput(
        model, args.work_dir, settle=lambda: 0.0, quick=args.quick, kinds=kinds
    )
    (args.work_dir / "engine-throughput.json").write_text(
        json.dumps(results, indent=1, default=str)
    )
    q1, q3 = results["ratio_quartiles"]
    print(
        f"ours / stock {results['ratio_median']:.3f} (quartiles {q1:.2f}-{q3:.2f},"
        f" {results['rounds']} rounds)"
    )
    for kind, timing in (results.get("step_timing") or {}).items():
        print(
            f"{kind}: engine step {timing['engine_step_us']:.0f} us, "
            f"schedule() {timing['schedule_us']:.0f} us, "
            f"get_grammar_bitmask() {timing['bitmask_us']:.0f} us"
        )


if __name__ == "__main__":
    main()

"""Engine throughput of a pair of engines (``kinds.PAIRS``), paired rounds.

vLLM's offline ``LLM`` class runs the same engine-core and model-worker
processes, scheduler, KV cache manager and model as the OpenAI server,
without the HTTP front end, whose throughput on this 2-core machine swings
up to tenfold between runs of the same load (stock and ours alike); so the
scheduler's effect on throughput is judged here. Each engine lives in its
own child process (``--child PAIR ROLE``) for the whole benchmark; each round
runs both, order alternating, after both went idle, each run after one
untimed warm-up; the figure is the median over rounds of candidate /
baseline in the same round. A ``sitecustomize`` hook (``step_timing``) times
``schedule()`` and the engine step inside both engine cores.

Alone::

    PYTHONPATH=tests:. python -m benchmarks.engine_throughput [--pair plain]
        [--quick] [--work-dir DIR]
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
from pathlib import Path
from typing import IO, Any

from benchmarks import hooks, step_timing
from benchmarks.kinds import PAIRS, STORE_URL_ENV, Pair, Side
from benchmarks.measure import log, median, quartiles
from benchmarks.noise import tree_cpu
from vllm_output_rate.demo.server import DEFAULT_ENV

# Two runs of the same code with 16 rounds differed by 2-4 % here, more than
# the 0.98 targets leave; 32 narrow the median's spread by √2.
ROUNDS, QUICK_ROUNDS = 32, 4
ROLES = ("baseline", "candidate")
WARMUP_GENERATES = 8  # the first rounds after start-up ran a few % slow
# Untimed, at the start of each run: the first seconds after switching from
# one engine to the other ran 5-10 % slower than the same engine's next run.
WARMUP_PER_RUN = 1
PROMPT_TOKEN_IDS = [1, 45, 49, 173, 170, 43, 172, 97]  # the tiny model's vocab
READY_TIMEOUT_S, ROUND_TIMEOUT_S = 600.0, 300.0
# vLLM's model worker polls its shared-memory queue for a second after each
# message, on the same core as the other engine's worker: before each run,
# wait until both engines' processes are idle.
IDLE_CORES, IDLE_SAMPLE_S, IDLE_MAX_WAIT_S = 0.1, 0.25, 10.0


# ----- child: one LLM, driven over stdin/stdout ---------------------------


def engine_args(pair: Pair, side: Side) -> dict[str, Any]:
    """``LLM``'s arguments beside the model for one side of a pair: the
    benchmark servers' engine settings (``servers.SERVER_ARGS``), the pair's,
    and ours' configuration when the plugin is on."""
    args: dict[str, Any] = {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 4096,
        "max_num_seqs": 64,
        **pair.llm_args,
    }
    if side.plugin:
        section = dict(side.output_rate)
        if side.store:
            section["store_url"] = os.environ[STORE_URL_ENV]
        args["additional_config"] = {"output_rate": section}
    return args


def build_engine(pair: Pair, side: Side, model: str) -> tuple[Any, list[Any]]:
    """One side's ``LLM`` and its load's sampling parameters."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, **engine_args(pair, side))
    params = [
        SamplingParams(
            max_tokens=pair.load.max_tokens,
            ignore_eos=True,
            **({"temperature": 0.0} if pair.greedy else {}),
            extra_args={"output_rate_user": user} if user else None,
        )
        for user in pair.load.users
    ]
    return llm, params


def _child(pair: Pair, side: Side, model: str) -> None:
    llm, params = build_engine(pair, side, model)
    load = pair.load
    if load.prompt_len is None:
        prompts = [{"prompt_token_ids": PROMPT_TOKEN_IDS}] * len(params)
    else:
        prompts = distinct_prompts(len(params), load.prompt_len)

    def generate(generates: int) -> tuple[int, float]:
        if load.continuous:
            return _continuous(llm, params, prompts, load.tokens_for(generates))
        tokens, started = 0, time.perf_counter()
        for _ in range(generates):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        return tokens, time.perf_counter() - started

    generate(WARMUP_GENERATES)
    _reply({"ready": True})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        generate(WARMUP_PER_RUN)
        tokens, seconds = generate(load.generates)
        _reply({"tokens": tokens, "seconds": seconds})


def distinct_prompts(count: int, length: int) -> list[dict[str, list[int]]]:
    """``count`` prompts of ``length`` tokens of the tiny model's vocabulary,
    no two with the same first block, so no prefix cache serves them."""
    return [
        {
            "prompt_token_ids": [
                3 + (i * 7 + j * 13 + (i * j) % 5) % 500 for j in range(length)
            ]
        }
        for i in range(count)
    ]


def _continuous(
    llm: Any, params: list[Any], prompts: list[Any], tokens_wanted: int
) -> tuple[int, float]:
    """``tokens_wanted`` tokens with the engine kept full: each request that
    ends is replaced at once by its stream's next (closed batches end in
    steps with fewer requests than slots, as many as the order requests
    finish in, not the engine's speed, decides); the requests still running
    at the end are aborted after the clock stops."""
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

    tokens, started = 0, time.perf_counter()
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


def _reply(message: dict[str, Any]) -> None:
    print("@@" + json.dumps(message), flush=True)  # vLLM logs to stderr


# ----- parent -------------------------------------------------------------


class _Engine:
    """One child process serving one side of a pair."""

    def __init__(
        self, pair: Pair, role: str, model: str, work_dir: Path, python_path: str
    ) -> None:
        side: Side = getattr(pair, role)
        self.name = f"{pair.name} {role}"
        self.timing_path = str(work_dir / f"step-timing-{pair.name}-{role}.json")
        env = {
            **os.environ,
            **DEFAULT_ENV,
            "PYTHONPATH": python_path,  # with the step-timing hook first
            step_timing.PATH_ENV: self.timing_path,
        }
        if not side.plugin:
            env["VLLM_PLUGINS"] = ""  # the plugin is not even loaded
        self.log_path = work_dir / f"engine-{pair.name}-{role}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        command = [sys.executable, "-m", "benchmarks.engine_throughput"]
        command += ["--child", pair.name, role, "--model", model]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        # A blocking readline cannot time out: a thread reads the replies.
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self._read(READY_TIMEOUT_S)
            hooks.check_log(self.log_path, step_timing.HOOK_NAME)
        except BaseException:
            self.process.kill()
            self.close()
            raise

    def cpu_seconds(self) -> float:
        return sum(tree_cpu(self.process.pid).values())

    def _pump(self) -> None:
        stdout: IO[str] = self.process.stdout  # type: ignore[assignment]
        for line in stdout:
            if line.startswith("@@"):
                self._replies.put(line[2:])
        self._replies.put(None)  # the child exited

    def _read(self, timeout_s: float) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"engine {self.name} did not answer in {timeout_s:g} s "
                f"(log: {self.log_path})"
            ) from None
        if reply is None:
            raise RuntimeError(f"engine {self.name} exited (log: {self.log_path})")
        return json.loads(reply)

    def run_round(self) -> float:
        """One timed run; its tokens per second."""
        stdin: IO[str] = self.process.stdin  # type: ignore[assignment]
        stdin.write("run\n")
        stdin.flush()
        reply = self._read(ROUND_TIMEOUT_S)
        return float(reply["tokens"] / reply["seconds"])

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


def _wait_until_idle(engines: list[_Engine]) -> None:
    started = time.monotonic()
    while time.monotonic() - started < IDLE_MAX_WAIT_S:
        before = sum(e.cpu_seconds() for e in engines)
        time.sleep(IDLE_SAMPLE_S)
        if sum(e.cpu_seconds() for e in engines) - before < IDLE_CORES * IDLE_SAMPLE_S:
            return


def engine_throughput(
    pair_name: str,
    work_dir: Path,
    quick: bool = False,
    settle: Callable[[], object] = lambda: None,
) -> dict[str, Any]:
    """Paired rounds of ``pair_name``'s load on its two engines; ``settle``
    runs before each run (the quiet-machine gate)."""
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    pair = PAIRS[pair_name]
    rounds = QUICK_ROUNDS if quick else ROUNDS
    work_dir.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_model(variant=pair.variant))
    python_path = hooks.install(work_dir / "step-timing-hook", step_timing.HOOK)
    engines: dict[str, _Engine] = {}
    tok_s: dict[str, list[float]] = {role: [] for role in ROLES}
    try:
        for role in ROLES:  # one at a time: start-up is CPU-heavy
            engines[role] = _Engine(pair, role, model, work_dir, python_path)
        for i in range(rounds):
            for role in ROLES if i % 2 == 0 else ROLES[::-1]:
                _wait_until_idle(list(engines.values()))
                settle()
                tok_s[role].append(engines[role].run_round())
            log(
                f"engine {pair.name} round {i + 1}/{rounds}: "
                + ", ".join(f"{role} {tok_s[role][-1]:,.0f} tok/s" for role in ROLES)
            )
    finally:
        for engine in engines.values():
            engine.close()
    ratios = [c / b for b, c in zip(tok_s["baseline"], tok_s["candidate"], strict=True)]
    return {
        "pair": pair.name,
        "description": pair.description,
        "labels": {role: getattr(pair, role).label for role in ROLES},
        "rounds": rounds,
        "streams": len(pair.load.users),
        "max_tokens": pair.load.max_tokens,
        "tokens_per_round": pair.load.tokens_for(pair.load.generates),
        "continuous": pair.load.continuous,
        "tok_s": tok_s,
        "ratios": ratios,
        "ratio_median": median(ratios),
        "ratio_quartiles": list(quartiles(ratios)),
        "step_timing": {
            role: step_timing.read(engine.timing_path)
            for role, engine in engines.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="plain", choices=sorted(PAIRS))
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds")
    parser.add_argument("--work-dir", type=Path, default=Path("results/bench-engine"))
    parser.add_argument("--child", nargs=2, metavar=("PAIR", "ROLE"), help="(internal)")
    parser.add_argument("--model", help="(internal) the child's model folder")
    args = parser.parse_args()
    if args.child:
        pair = PAIRS[args.child[0]]
        _child(pair, getattr(pair, args.child[1]), args.model)
        return
    results = engine_throughput(args.pair, args.work_dir, args.quick)
    (args.work_dir / f"engine-{args.pair}.json").write_text(json.dumps(results))
    q1, q3 = results["ratio_quartiles"]
    labels = results["labels"]
    print(
        f"{labels['candidate']} / {labels['baseline']} {results['ratio_median']:.3f}"
        f" (quartiles {q1:.3f}-{q3:.3f}, {results['rounds']} rounds)"
    )
    for role, timing in results["step_timing"].items():
        if timing:
            print(
                f"{labels[role]}: engine step {timing['engine_step_us']:.0f} us, "
                f"schedule() {timing['schedule_us']:.1f} us"
            )


if __name__ == "__main__":
    main()

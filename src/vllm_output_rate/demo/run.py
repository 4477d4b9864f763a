"""The demo: a scarce engine, a light user hurt on stock vLLM, whole with limits.

``make demo`` (or ``vllm-output-rate demo``) plays each scene of
``scenes.py`` twice on a small local model: on stock vLLM, then with
per-user limits, the same flags and load otherwise. In each scene something is
scarce (KV blocks, resident slots, places in vLLM's queue), a hog's many
streams take it, and a light user asks for short answers. The servers of two
scenes start together (``stage.py``); each run is measured at the engine
(vLLM's per-request timings; with limits, the plugin's stats) and at the
client (``figures.py``).

It prints a line per run, then per scene a table (``table.py``), one line
per user, each figure as stock -> with limits, and the verdicts
(``judging.py``): the light user better with limits, the throttled user at
its limit, nobody's request failed (a 429 to a refusable user's own excess
is shown as refused by design, a 503 on stock vLLM as its queue full). It
draws the chart (``chart.py``), keeps the raw results and server logs in
``results/demo/``, and says in plain words when other programs took too much
of the machine for the figures to mean much (``busy.py``). A run in which
the users' clients did not load the server together (``overlap.py``) is
played again, and says so. Each run line also gives what the server's engine
did (``engine_tally.py``): a client answer it did not give stops the demo.
Exit code 1 only when a request failed, a bound broke, a server did not
start or stopped under it, or the plugin's stats or vLLM's counters could
not be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from vllm_output_rate.demo.engine_tally import unseen_answers
from vllm_output_rate.demo.figures import RunFigures, run_figures
from vllm_output_rate.demo.judging import (
    SceneResult,
    headline,
    too_busy,
    unequal_load,
)
from vllm_output_rate.demo.overlap import MIN_COVERED, light_window_covered
from vllm_output_rate.demo.scenes import SCENES, Scene, scene_by_key
from vllm_output_rate.demo.server import ServerStartError
from vllm_output_rate.demo.stage import (
    DemoError,
    Played,
    Servers,
    ServerSpec,
    play,
    put_limits,
    scene_limits,
)
from vllm_output_rate.demo.tiny_model import build_tiny_model

# Scenes whose servers start together: two scenes, four servers, ~8 GB.
SCENES_PER_START = 2
# The tiny model's 2 ms steps make vLLM's HTTP front end, not the engine, the
# bottleneck on a 2-core machine: nothing at the engine is scarce then. The
# 23 M-parameter variant's steps of several ms make the engine the bottleneck,
# as a real model on a GPU is.
MODEL_VARIANT = "small"
# A run whose users' loads did not overlap is played again, this often in all.
PLAYS = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-output-rate demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scene",
        action="append",
        choices=[s.key for s in SCENES],
        help="play only this scene (repeatable; default: all)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("results/demo"), help="folder for outputs"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.0f} ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} tok/s"


def describe(scene: Scene, figures: RunFigures) -> str:
    """One line per run, printed as it ends."""
    side = "with limits" if figures.limited else "stock vLLM "
    parts = []
    for name, f in figures.users.items():
        if f.role == "light":
            answered = f.outcomes.answered_share
            parts.append(
                f"{name}: first token {_ms(f.ttft_engine_s)} engine / "
                f"{_ms(f.ttft_client_s)} client, {_rate(f.rate_client)}"
                + ("" if answered is None else f", {answered:.0%} answered")
            )
        else:
            queued = (
                ""
                if f.queued_engine_s is None
                else f", {_ms(f.queued_engine_s)} queued at the engine"
            )
            outside = (
                ""
                if f.outside_engine_s is None
                else f", {_ms(f.outside_engine_s)} outside it"
            )
            rate = _rate(f.rate_engine or f.rate_client)
            parts.append(f"{name}: {rate}{queued}{outside}")
    notes = []
    if (tally := figures.tally) is not None:
        notes.append(
            f"engine: {tally.finished:,.0f} answers, "
            f"{tally.prompt_tokens:,.0f} prompt tokens"
        )
    if figures.others_cores is not None:
        notes.append(f"others: {figures.others_cores:.1f} cores")
    extra = f" [{'; '.join(notes)}]" if notes else ""
    return f"   {scene.title}, {side}: " + "; ".join(parts) + extra


def introduce(scene: Scene) -> str:
    """The scene in two lines, printed before anything runs."""
    users = "; ".join(
        f"{u.name} ({u.role}): {u.streams} stream{'s' if u.streams > 1 else ''} of "
        f"{u.max_tokens} tokens, limit {scene.limit(u):g} tok/s"
        for u in scene.users
    )
    return f"{scene.title}: {' '.join(scene.server_args)}\n   {users}"


def save(out: Path, scene: Scene, side: str, played: Played) -> None:
    folder = out / scene.key / side
    for name, result in played.results.items():
        result.write_json(folder / f"{name}.json")
    if played.engine is not None:
        readings = [dataclasses.asdict(r) for r in played.engine.watch.readings]
        (folder / "engine.json").write_text(
            json.dumps(
                {
                    "window_s": [played.engine.start_s, played.engine.end_s],
                    "readings": readings,
                }
            )
        )


def play_side(
    out: Path, model: str, scene: Scene, servers: Servers, limited: bool
) -> RunFigures:
    """One run of ``scene`` on stock vLLM or with limits, played again (up to
    ``PLAYS`` times in all) while the others' load did not cover the light
    user's window: such a run shows an idle server, not the scene."""
    url, spec = servers.url(scene, limited)
    for attempt in range(1, PLAYS + 1):
        if attempt > 1 and limited:
            put_limits(url, spec.admin_key, scene_limits(scene))
        played = play(scene, url, model, spec)
        save(out, scene, "limits" if limited else "stock", played)
        if played.engine is not None and len(played.engine.watch.readings) < 2:
            raise DemoError("the plugin's stats endpoint could not be read")
        f = run_figures(scene, played.results, played.engine)
        f.others_cores, f.others_share = played.others.cores, played.others.share
        f.covered = light_window_covered(scene, played.results)
        f.tally = played.tally
        print(describe(scene, f), flush=True)
        answered = [u.outcomes.ok for u in f.users.values()]
        if unseen := unseen_answers(played.tally, answered):
            raise DemoError(
                f"{unseen} of the {sum(answered)} answers the clients got did not "
                f"come from the engine of the server at {url} (it finished "
                f"{played.tally.finished:,.0f}): the run measured another server"
            )
        if f.covered is None or f.covered >= MIN_COVERED:
            break
        print(
            f"   the others' requests were in flight for only {f.covered:.0%} of "
            "the light user's window (their clients did not run together)"
            + ("; playing it again" if attempt < PLAYS else ""),
            flush=True,
        )
    return f


def play_scene(out: Path, model: str, scene: Scene, servers: Servers) -> SceneResult:
    """Both runs of ``scene``; the stock run played again (``PLAYS`` times in
    all) while an unthrottled user's load differed between the two."""
    stock = play_side(out, model, scene, servers, limited=False)
    limited = play_side(out, model, scene, servers, limited=True)
    for _ in range(PLAYS - 1):
        if (why := unequal_load(scene, stock, limited)) is None:
            break
        print(f"   {why.removeprefix('not judged: ')}; playing stock vLLM again")
        stock = play_side(out, model, scene, servers, limited=False)
    return SceneResult.judge(scene, stock, limited)


def _play_or_explain(
    out: Path, model: str, scene: Scene, servers: Servers
) -> SceneResult:
    """``play_scene``; when it fails because a server stopped under it (some
    other program stopped it), say so rather than what the client saw."""
    try:
        return play_scene(out, model, scene, servers)
    except Exception as exc:
        stopped = servers.stopped()
        if not stopped:
            raise
        raise DemoError(
            "a vLLM server stopped during the demo, so nothing can be judged: "
            + "; ".join(stopped)
            + ". Was it stopped from outside? Run the demo again."
        ) from exc


def batches(scenes: Sequence[Scene]) -> list[list[Scene]]:
    return [
        list(scenes[i : i + SCENES_PER_START])
        for i in range(0, len(scenes), SCENES_PER_START)
    ]


def run(args: argparse.Namespace) -> int:
    from vllm_output_rate.demo.chart import plot_demo
    from vllm_output_rate.demo.table import format_table

    began = time.monotonic()
    scenes = [scene_by_key(k) for k in args.scene] if args.scene else list(SCENES)
    model = str(build_tiny_model(variant=MODEL_VARIANT))
    print(f"model: {model} (a small random-weight Llama, built locally)")
    print("Each scene runs on stock vLLM, then with per-user limits:")
    for scene in scenes:
        print(f"- {introduce(scene)}")
    results: list[SceneResult] = []
    try:
        for batch in batches(scenes):
            specs = [
                ServerSpec.for_scene(s, lim) for s in batch for lim in (False, True)
            ]
            print(
                f"\nstarting {len(specs)} vLLM servers (stock and with limits) ...",
                flush=True,
            )
            with Servers(model, specs, args.out) as servers:
                ready = time.monotonic() - began
                print(f"   ready, {ready:.0f} s since the start", flush=True)
                for scene in batch:
                    results.append(_play_or_explain(args.out, model, scene, servers))
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped", file=sys.stderr)
        return 130
    except (DemoError, ServerStartError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    print()
    print(format_table(results))
    print()
    for result in results:
        for verdict in result.verdicts:
            print(f"{result.scene.title}, {verdict.user}: {verdict.text}")
    print(f"\n{headline(results)}")
    busy = too_busy(
        {
            f"the {side} run of {r.scene.title}": figures
            for r in results
            for side, figures in (("stock", r.stock), ("limited", r.limited))
        }
    )
    if busy:
        print(f"\n{busy}")
    (args.out / "summary.json").write_text(
        json.dumps([dataclasses.asdict(r) for r in results], indent=1)
    )
    chart = plot_demo(results, args.out / "demo.png")
    took = time.monotonic() - began
    print(f"\nwrote {chart} and the raw results in {args.out}/ ({took:.0f} s)")
    broken = [v for r in results for v in r.verdicts if v.breaks]
    for verdict in broken:
        print(f"demo: {verdict.user}: {verdict.text}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())

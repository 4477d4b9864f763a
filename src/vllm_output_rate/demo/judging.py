"""What the demo concludes from a scene's two runs, in plain words.

``judge_scene`` gives one ``Verdict`` per user (pure, from ``figures.py``):

* light: *better with limits* when, with limits, its time to first token
  (p50) is lower and its rate higher, at the engine and at the client; in a
  scene about prefill (``light_measure`` "first-token"), its time to first
  token alone (every later token waits for a full step either way); in a
  scene about the queue ("answers"), when a larger share of its requests
  is answered;
* throttled: *at its limit* when its engine rate over the window is at least
  ``AT_LIMIT`` of its limit; the bound, checked at the engine on every pair
  of the plugin's stats readings, must hold for every user with a limit;
* a light user is *not judged* when, in either run, the others' requests
  did not cover its window (``overlap.py``): it ran beside an idle server;
  or when an unthrottled other user's load was not the same in both runs
  (``unequal_load``: one of them did not hold the scene);
* everyone: no failed request in either run. A 429 to a refusable user is
  its own excess refused by design, and a 503 on stock vLLM its queue caps
  full: counted and shown, never a failure.

``Verdict.breaks`` (a failed request, a broken bound) is what makes the demo
exit 1; the rest is reported, never fatal: on a busy machine a light user
may lose by luck, and ``too_busy`` says when the figures mean little.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from vllm_output_rate.demo.figures import Outcomes, RunFigures, UserFigures
from vllm_output_rate.demo.overlap import MIN_COVERED
from vllm_output_rate.demo.scenes import Scene

AT_LIMIT = 0.9  # engine rate / limit, at least, for "at its limit"
# Other programs using more than this share of the machine's cores during a
# run: the servers lacked CPU and the figures mean little (busy.py).
BUSY_SHARE = 0.5
# An unthrottled user's answers in one run, at least this share of the other
# run's: the same load, so the runs compare (unequal_load).
SAME_LOAD = 0.75


@dataclass
class Verdict:
    user: str
    good: bool  # what the scene promises for this user held
    short: str  # a word or two, for the table
    text: str  # the whole verdict, in plain words
    breaks: bool = False  # a failed request or a broken bound: exit 1


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.0f} ms"


def light_verdict(
    stock: UserFigures, limited: UserFigures, *, rate: bool = True
) -> tuple[bool, str, str]:
    checks = [
        ("first token at the engine", stock.ttft_engine_s, limited.ttft_engine_s, -1),
        ("first token at the client", stock.ttft_client_s, limited.ttft_client_s, -1),
    ]
    if rate:
        checks += [
            ("rate at the engine", stock.rate_engine, limited.rate_engine, 1),
            ("rate at the client", stock.rate_client, limited.rate_client, 1),
        ]
    worse = [
        name
        for name, before, after, sign in checks
        if before is None or after is None or sign * (after - before) <= 0
    ]
    if worse:
        return False, "NOT better", "NOT better with limits: " + ", ".join(worse)
    return (
        True,
        "better",
        (
            f"better with limits: first token {_ms(limited.ttft_engine_s)} "
            f"instead of {_ms(stock.ttft_engine_s)} at the engine"
        ),
    )


def answers_verdict(stock: UserFigures, limited: UserFigures) -> tuple[bool, str, str]:
    before = stock.outcomes.answered_share
    after = limited.outcomes.answered_share

    def answered(outcomes: Outcomes) -> str:
        if not outcomes.sent:
            return "nothing sent"
        return f"{outcomes.ok} of {outcomes.sent} answered"

    text = (
        f"{answered(limited.outcomes)} with limits, "
        f"{answered(stock.outcomes)} on stock vLLM"
    )
    if before is None or after is None or after <= before:
        return False, "NOT better", f"NOT better with limits: {text}"
    return True, "better", f"better with limits: {text}"


def throttled_verdict(limited: UserFigures) -> tuple[bool, str, str]:
    if limited.limit is None or limited.rate_engine is None:
        return False, "no engine rate", "its rate at the engine could not be read"
    ratio = limited.rate_engine / limited.limit
    if ratio >= AT_LIMIT:
        return True, "at its limit", f"at its limit ({ratio:.2f}x at the engine)"
    return False, "below limit", f"below its limit ({ratio:.2f}x at the engine)"


def _failures(label: str, user: UserFigures) -> str:
    counts = Counter(user.outcomes.failed).most_common(3)
    detail = "; ".join(f"{n} x {text}" for text, n in counts)
    return f"{len(user.outcomes.failed)} requests FAILED {label}: {detail}"


def uncovered(stock: RunFigures, limited: RunFigures) -> str | None:
    """Why the light user cannot be judged: a run in which the others' load
    did not cover its window (overlap.py); None when both did."""
    for label, run in (("on stock vLLM", stock), ("with limits", limited)):
        if run.covered is not None and run.covered < MIN_COVERED:
            return (
                f"not judged: the others' requests were in flight for only "
                f"{run.covered:.0%} of its window {label}"
            )
    return None


def unequal_load(scene: Scene, stock: RunFigures, limited: RunFigures) -> str | None:
    """Why the light user cannot be judged: an unthrottled other user whose
    answers on one side fell short of ``SAME_LOAD`` of the other side's. No
    limit binds it, so the same load should get about as many answers on
    both; when it does not, one run did not hold the scene. None when all
    matched."""
    for user in scene.with_role("other"):
        counts = (
            stock.users[user.name].outcomes.ok,
            limited.users[user.name].outcomes.ok,
        )
        if min(counts) < SAME_LOAD * max(counts):
            return (
                f"not judged: {user.name} got {counts[0]} answers on stock vLLM and "
                f"{counts[1]} with limits, not the same load"
            )
    return None


def judge_user(
    scene: Scene, name: str, stock: RunFigures, limited: RunFigures
) -> Verdict:
    user = next(u for u in scene.users if u.name == name)
    before, after = stock.users[name], limited.users[name]
    good, short, text = True, "shown", "shown only"
    why = uncovered(stock, limited) or unequal_load(scene, stock, limited)
    if user.role == "light" and why:
        good, short, text = False, "not judged", why
    elif user.role == "light" and scene.light_measure == "answers":
        good, short, text = answers_verdict(before, after)
    elif user.role == "light":
        rate = scene.light_measure == "latency"
        good, short, text = light_verdict(before, after, rate=rate)
    elif user.role == "throttled":
        good, short, text = throttled_verdict(after)
    notes = [text]
    breaks = False
    if after.bound_held is False:
        good, breaks, short = False, True, "BOUND BROKEN"
        notes.append("the engine BROKE THE BOUND")
    for label, figures in (("on stock vLLM", before), ("with limits", after)):
        if figures.outcomes.failed:
            good, breaks, short = False, True, "FAILED"
            notes.append(_failures(label, figures))
    refused = before.outcomes.refused + after.outcomes.refused
    if refused:
        notes.append(f"{refused} requests refused (429: its own excess, by design)")
    if before.outcomes.queue_full:
        notes.append(
            f"{before.outcomes.queue_full} requests answered 503 on stock vLLM "
            "(its queue full)"
        )
    return Verdict(name, good, short, "; ".join(notes), breaks)


def judge_scene(scene: Scene, stock: RunFigures, limited: RunFigures) -> list[Verdict]:
    """One verdict per user of ``scene``, in its order."""
    return [judge_user(scene, u.name, stock, limited) for u in scene.users]


def too_busy(runs: dict[str, RunFigures]) -> str | None:
    """Plain words when other programs took more than ``BUSY_SHARE`` of the
    machine during a run (``runs``: label -> figures); None when they did
    not, or when it could not be measured."""
    busy = {
        label: run
        for label, run in runs.items()
        if run.others_share is not None and run.others_share > BUSY_SHARE
    }
    if not busy:
        return None
    worst_label, worst = max(busy.items(), key=lambda kv: kv[1].others_share or 0)
    return (
        f"The machine was too busy for these figures to mean much: other "
        f"programs kept {worst.others_cores:.1f} cores busy during {worst_label} "
        f"({len(busy)} of {len(runs)} runs above {BUSY_SHARE:.0%} of the "
        f"machine). Run the demo again when the machine is quieter."
    )


@dataclass
class SceneResult:
    """A scene's two runs and what they mean: what the table and chart show."""

    scene: Scene
    stock: RunFigures
    limited: RunFigures
    verdicts: list[Verdict]

    @classmethod
    def judge(cls, scene: Scene, stock: RunFigures, limited: RunFigures) -> SceneResult:
        return cls(scene, stock, limited, judge_scene(scene, stock, limited))

    @property
    def breaks(self) -> bool:
        return any(v.breaks for v in self.verdicts)


def headline(results: list[SceneResult]) -> str:
    """The demo's conclusion in one sentence."""
    where = f"each of the {len(results)} scenes" if len(results) > 1 else "this scene"
    lost = [r.scene.title for r in results if not all(v.good for v in r.verdicts)]
    if not lost:
        throttled = any(r.scene.with_role("throttled") for r in results)
        return (
            f"In {where}, the light user came out better with limits, "
            + ("the throttled user got its limit, " if throttled else "")
            + "and no request failed."
        )
    return (
        f"Not as promised in {len(lost)} of {len(results)} scenes: {', '.join(lost)}."
    )

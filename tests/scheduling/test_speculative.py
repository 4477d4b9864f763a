"""Per-user limits with speculative decoding, on vLLM's real scheduler.

A step that verifies k draft tokens emits between 1 and k + 1 tokens. Every
test runs for synchronous and asynchronous scheduling (and some with more
steps in flight, as with pipeline parallelism), with the harness proposing
drafts and the synthetic model accepting a seeded random share of them.
After every test the accounting invariant is checked exactly: for each user,
the tokens the limiter holds as spent equal the tokens the user received.
The bound ``(W + 0.1) x limit + 1`` is checked on the dispatch times of the
tokens users received.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter

import pytest

from harness.bounds import assert_bound
from harness.counting_limiter import CountingLimiter, watch_updates
from harness.scheduler_sim import SchedulerHarness, make_scheduler

MS = 1_000_000
S = 1_000_000_000
K = 4  # draft tokens per step


@pytest.fixture(
    params=[(False, 0), (True, 1), (True, 3)], ids=["sync", "async", "3-in-flight"]
)
def mode(request: pytest.FixtureRequest) -> tuple[bool, int]:
    return request.param


@pytest.fixture
def spec_limited(tiny_model_path: str, mode: tuple[bool, int]):
    """Factory for a limited scheduler with speculative decoding; checks the
    accounting afterwards."""
    is_async, in_flight = mode
    made: list[SchedulerHarness] = []

    def make(
        default: float,
        users: dict[str, float] | None = None,
        *,
        fair_step_tokens: bool = True,
        **kwargs,
    ):
        limits: dict[str, object] = {"default_user_output_tokens_per_second": default}
        if not fair_step_tokens:
            limits["fair_step_tokens"] = False
        if users:
            limits["user_output_tokens_per_second"] = users
        harness = make_scheduler(
            tiny_model_path,
            limits=limits,
            is_async=is_async,
            in_flight=in_flight,
            num_spec_tokens=kwargs.pop("num_spec_tokens", K),
            **kwargs,
        )
        harness.scheduler.output_rate.use_limiter(
            CountingLimiter(default, users, clock=harness.clock)
        )
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.settle()
        limiter = harness.scheduler.output_rate.limiter
        assert +limiter.net == harness.received_tokens()
        # Every step was reported and settled: nothing is kept.
        assert not harness.scheduler.output_rate.accounting.ledger.unsettled_steps()


def accept_by_hash(request, drafts: int) -> int:
    """A deterministic acceptance: the same request at the same length
    accepts the same drafts in every run (for side-by-side comparisons)."""
    key = f"{request.request_id}:{request.num_output_tokens}".encode()
    return zlib.crc32(key) % (drafts + 1)


def test_drafts_are_charged_and_rejected_ones_given_back(spec_limited) -> None:
    h = spec_limited(1000)
    request = h.add("a", max_tokens=200)
    h.acceptance = lambda _request, drafts: 1  # one of four drafts accepted
    h.run_until_done(5 * MS)
    assert len(h.outputs[request.request_id]) == 200
    drafted = [d.drafts for d in h.dispatches if d.samples]
    assert drafted[0] == 0 and max(drafted) == K  # the prefill, then drafts
    # Two tokens per decode step: the accepted draft and one more (and the
    # steps dispatched while the last ones were in flight).
    assert len(drafted) <= 1 + (200 - 1) // 2 + 1 + h.in_flight


def test_a_step_never_emits_more_than_the_budget(spec_limited) -> None:
    # 20 tok/s with a 100 ms burst: at most 3 tokens at once, so a request
    # may carry at most 2 drafts, however many the drafter proposes.
    h = spec_limited(20)
    h.acceptance = lambda _request, drafts: drafts  # every draft accepted
    h.add("a", max_tokens=400)
    for _ in range(300):
        h.step(10 * MS)
    assert max(d.drafts for d in h.dispatches) <= 2
    assert_bound(h.received_by("a"), 20)


def test_the_long_run_rate_is_exactly_the_limit(spec_limited) -> None:
    rates = {"a": 50, "b": 7.5, "c": 333}
    h = spec_limited(10, rates)
    for user in rates:
        for _ in range(4):
            h.add(user, max_tokens=100_000)
    h.add(None, max_tokens=100_000)
    for _ in range(2000):  # 20 s of 10 ms steps
        h.step(10 * MS)
    h.drain()
    for user, rate in {**rates, "__anonymous__": 10}.items():
        times = h.received_by(user)
        assert_bound(times, rate)
        span_s = (times[-1] - times[0]) / S
        # Demand is far above every limit: the whole budget is used (rejected
        # drafts come back), nothing is lost to rounding.
        assert len(times) - 1 >= rate * span_s, (user, len(times))


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_holds_for_random_traffic(spec_limited, seed: int) -> None:
    rng = random.Random(seed)
    rates = {f"user-{i}": rng.choice([2, 3.5, 12, 40, 150]) for i in range(5)}
    h = spec_limited(
        25,
        rates,
        num_blocks=rng.choice([60, 400]),
        max_num_seqs=rng.choice([6, 32]),
        max_num_batched_tokens=rng.choice([64, 512]),
        num_spec_tokens=rng.choice([1, 3, 5]),
    )
    h.seed = seed
    h.proposals = lambda _request: rng.randint(0, h.num_spec_tokens)
    expected: dict[str, int] = {}
    for _ in range(40):
        user = rng.choice([*rates, None])
        max_tokens = rng.randint(1, 60)
        eos_at = rng.randrange(max_tokens) if rng.random() < 0.3 else None
        request = h.add(
            user, prompt_len=rng.randint(1, 200), max_tokens=max_tokens, eos_at=eos_at
        )
        expected[request.request_id] = max_tokens if eos_at is None else eos_at + 1
    for _ in range(800):
        h.step(rng.randint(2, 30) * MS)
        if rng.random() < 0.01 and h.scheduler.running:
            victim = rng.choice(h.scheduler.running).request_id
            h.abort(victim)
            expected.pop(victim)
    h.drain()
    # Paused, never cut: what finished has its full length (the fixture
    # aborts the rest, which must not cost budget either).
    finished = [r for r in expected if r in h.finished]
    assert finished
    for request_id in finished:
        assert len(h.outputs[request_id]) == expected[request_id], request_id
    for user, rate in {**rates, "__anonymous__": 25}.items():
        assert_bound(h.received_by(user), rate)


def test_limits_that_do_not_bind_cost_no_speculation(
    tiny_model_path: str, mode: tuple[bool, int], spec_limited
) -> None:
    is_async, in_flight = mode

    def workload(h: SchedulerHarness) -> list[tuple[int, str, int, int]]:
        h.acceptance = accept_by_hash
        for i in range(10):
            h.add(f"user-{i % 3}", prompt_len=5 + 37 * i % 300, max_tokens=30 + i)
        h.run_until_done(1 * MS)
        return [(d.step, d.request_id, d.num_tokens, d.drafts) for d in h.dispatches]

    stock = make_scheduler(
        tiny_model_path,
        limits=None,
        is_async=is_async,
        in_flight=in_flight,
        num_spec_tokens=K,
        max_num_batched_tokens=256,
    )
    # Several users' prompts exceed the step's tokens at times: the same as
    # stock with the step's tokens as vLLM sizes them.
    ours = spec_limited(1e6, max_num_batched_tokens=256, fair_step_tokens=False)
    assert workload(ours) == workload(stock)
    assert sum(d.drafts for d in ours.dispatches) > 0


def test_refunds_skipped_as_changing_nothing_change_nothing(
    tiny_model_path: str, mode: tuple[bool, int], spec_limited
) -> None:
    """The plain limiter lets the ledger skip a full step's refunds when all
    its users are free (far below their limits): the same traffic then gets
    the same dispatches and tokens as with every refund made and counted."""
    is_async, in_flight = mode
    rates = {"slow": 30.0}  # binds; the others never do

    def workload(h: SchedulerHarness) -> tuple[list[tuple[int, str, int, int]], dict]:
        h.acceptance = accept_by_hash
        for i in range(12):
            user = "slow" if i % 4 == 0 else f"free-{i % 3}"
            h.add(user, prompt_len=5 + 23 * i % 90, max_tokens=40 + 13 * i)
        h.run_until_done(2 * MS)
        dispatches = [
            (d.step, d.request_id, d.num_tokens, d.drafts) for d in h.dispatches
        ]
        return dispatches, {u: h.received_by(u) for u in set(h.users.values())}

    skipping = make_scheduler(
        tiny_model_path,
        limits={
            "default_user_output_tokens_per_second": 1e6,
            "user_output_tokens_per_second": rates,
        },
        is_async=is_async,
        in_flight=in_flight,
        num_spec_tokens=K,
    )
    limiter = skipping.scheduler.output_rate.limiter
    answers: list[bool] = []
    absorbed = limiter.refunds_absorbed

    def watched(users):
        answers.append(absorbed(users))
        return answers[-1]

    limiter.refunds_absorbed = watched  # type: ignore[method-assign]
    counted = spec_limited(1e6, rates)  # refunds all made; invariant checked
    assert workload(skipping) == workload(counted)
    if not is_async:  # only a synchronous step is settled at once
        assert any(answers) and not all(answers)


def test_a_stop_inside_the_accepted_drafts_is_given_back(spec_limited) -> None:
    h = spec_limited(1000)
    h.acceptance = lambda _request, drafts: drafts
    request = h.add("a", max_tokens=100, eos_at=6)
    h.run_until_done(1 * MS)
    assert len(h.outputs[request.request_id]) == 7
    assert h.finished[request.request_id] == "stop"


def test_an_aborted_request_is_charged_what_it_received(spec_limited) -> None:
    h = spec_limited(1000)
    request = h.add("a", max_tokens=100)
    for _ in range(5):
        h.step(1 * MS)
    h.abort(request.request_id)  # a step may still be in flight
    h.run_until_done(1 * MS)


def test_preemption_with_drafts_in_flight_keeps_the_accounts(spec_limited) -> None:
    h = spec_limited(400, {"b": 30}, num_blocks=24)
    requests = [h.add(u, prompt_len=40, max_tokens=60) for u in "aabbab"]
    h.run_until_done(3 * MS)
    assert h.preemptions > 0
    for request in requests:
        assert len(h.outputs[request.request_id]) == 60
    assert_bound(h.received_by("b"), 30)


def test_a_throttled_user_does_not_slow_others(spec_limited) -> None:
    h = spec_limited(5, {"fast": 10_000})
    h.acceptance = lambda _request, drafts: drafts
    for _ in range(8):
        h.add("slow", max_tokens=500)
    fast = h.add("fast", max_tokens=400)
    for _ in range(100):
        h.step(10 * MS)
    # The fast user keeps every draft: 1 + K tokens in every decode step.
    fast_steps = [d for d in h.dispatches if d.request_id == fast.request_id]
    assert all(d.drafts == K for d in fast_steps[2:])
    assert_bound(h.received_by("slow"), 5)


def test_update_from_output_never_touches_the_limiter(spec_limited) -> None:
    h = spec_limited(10)
    for _ in range(3):
        h.add("a", max_tokens=20)
    untouched = watch_updates(h)
    h.run_until_done(20 * MS)
    assert untouched and all(untouched)


def test_statistics_count_what_users_received(spec_limited) -> None:
    h = spec_limited(1000, {"named": 1000})
    h.acceptance = lambda _request, drafts: drafts // 2
    h.add("named", max_tokens=50)
    h.run_until_done(1 * MS)
    h.settle()
    users = h.scheduler.output_rate.metrics_snapshot()["labels"]
    assert users["named"]["tokens_admitted"] == 50
    assert Counter(u for _, u in h.received_at)["named"] == 50


def test_fast_steps_charge_every_draft_and_a_binding_user_leaves_them(
    spec_limited, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Free users decode with every draft: fast steps, charged by the ledger's
    # O(1) check of the step's token counts (synchronous scheduling, where
    # the harness proposes drafts). Then a user joins whose burst covers its
    # first steps only: it must be charged all it can emit while covered and
    # trimmed once its limit binds. Every draft is accepted, so any token
    # charged short would show as tokens beyond the bound.
    h = spec_limited(1e6, {"edge": 250})
    h.acceptance = lambda _request, drafts: drafts
    ledger = h.scheduler.output_rate.accounting.ledger
    checks: list[bool] = []
    all_full = ledger._all_full
    monkeypatch.setattr(
        ledger, "_all_full", lambda *args: checks.append(all_full(*args)) or checks[-1]
    )
    for i in range(8):
        h.add(f"free-{i % 2}", max_tokens=100_000)
    for _ in range(50):
        h.step(10 * MS)
    assert any(checks) or h.is_async
    h.add("edge", max_tokens=100_000)
    for _ in range(400):  # 4 s
        h.step(10 * MS)
    h.drain()
    times = h.received_by("edge")
    assert_bound(times, 250)
    # Covered at first (its burst), then held to the limit with trimmed
    # drafts: about 250 tok/s over the run, never more.
    assert 250 * 3.5 < len(times) <= 250 * 4 + 26
    if not h.is_async:
        assert max(d.drafts for d in h.dispatches if d.user == "edge") == K

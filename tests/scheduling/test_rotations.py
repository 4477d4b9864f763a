"""The rotations rank exactly as ``ordering.share_slots`` does, step after step.

Plain records (no scheduler): a simulated engine runs seeded random
workloads (2 to 60 users, weights, several requests each, waiting users
claiming slots with and without free resident places, requests finishing
and arriving, kept steps, uncontested steps, a pick passed over), and in
every contested step ``Rotations.rank`` must return what ``share_slots``
returns for the same running list: the same order, grants and, for small
batches, the details a kept batch reads. Then the step is served as the
reference ordered it, the counters are charged and the rotations told.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from vllm_output_rate.scheduling.fair_share import TURN_TOKENS, FairShare
from vllm_output_rate.scheduling.ordering import share_slots
from vllm_output_rate.scheduling.rotations import DETAILED_USERS, Rotations

STEPS = 60


@dataclass(eq=False)
class Req:
    rid: str
    user: str
    last_served: int = -1


def user_of(r: Req) -> str:
    return r.user


def last_served_of(r: Req) -> int:
    return r.last_served


def id_of(r: Req) -> str:
    return r.rid


def simulate(seed: int, seen: Counter[str]) -> None:
    rng = random.Random(seed)
    users = [f"u{i}" for i in range(rng.choice([2, 3, 5, 20, 60]))]
    weights = {u: rng.choice([0.5, 2.0, 3.0]) for u in users if rng.random() < 0.5}
    fair = FairShare(weights)
    ids = iter(range(10**9))

    def new(user: str) -> Req:
        return Req(f"r{next(ids)}", user)

    running = [new(rng.choice(users)) for _ in range(rng.randint(4, 80))]
    waiting = [new(rng.choice(users)) for _ in range(rng.randint(0, 30))]
    slots = rng.randint(1, len(running) // 2 + 1)
    max_resident = len(running) + rng.choice([0, 0, 5, 10])
    rotations = Rotations(user_of, last_served_of, id_of)
    user_last_served: dict[str, int] = {}
    finished: set[str] = set()
    batch: list[Req] = []
    may_keep = False
    for step in range(1, STEPS):
        wanted = dict(Counter(r.user for r in waiting))
        room = max(0, max_resident - len(running))
        if len(running) + sum(wanted.values()) <= slots:
            # Uncontested by slots: the reference rotates; nothing followed.
            seen["uncontested"] += 1
            rotations.forget()
            for request in running:
                request.last_served = step
            fair.charge(Counter(map(user_of, running)), {})
            user_last_served.update(dict.fromkeys(map(user_of, running), step))
            running.append(new(rng.choice(users)))
            finished, may_keep = set(), False
            continue
        granted: dict[str, int] = {}
        if may_keep and not finished and rng.random() < 0.3:
            seen["kept"] += 1  # the last batch served again, without ranking
        else:
            previous = step - 1
            reference = share_slots(
                running,
                user_of,
                last_served_of,
                lambda u, k, turn: fair.key(u, k, user_last_served.get(u, -1), turn),
                turn_left=lambda r, t=previous: (
                    TURN_TOKENS if r.last_served == t else 0
                ),
                weight_of=fair.weight,
                waiting=wanted,
                slots=slots,
                room=room,
            )
            rotations.resume(step, list(running), finished)
            ranked = rotations.rank(
                step=step,
                running=list(running),
                waiting=wanted,
                slots=slots,
                room=room,
                fair=fair,
                user_last_served=user_last_served,
            )
            where = f"seed {seed} step {step}"
            assert list(map(id_of, ranked.order)) == list(
                map(id_of, reference.order)
            ), where
            assert ranked.granted == reference.granted, where
            detailed = len(reference.last_picks) <= DETAILED_USERS
            assert rotations.detailed == detailed, where
            if detailed:
                assert _picks(ranked.last_picks) == _picks(reference.last_picks), where
                assert ranked.next_slots == reference.next_slots, where
                assert ranked.rivals_key == reference.rivals_key, where
            seen["ranked"] += 1
            seen["granted"] += bool(reference.granted)
            seen["many users"] += not detailed
            seen["two in turn"] += any(
                k > 0 and in_turn for k, _, in_turn in reference.last_picks.values()
            )
            running = list(reference.order)
            batch = running[: sum(len(p) for _, p, _ in reference.last_picks.values())]
            granted = dict(reference.granted)
        served = list(batch)
        passed_over = rng.random() < 0.05 and 0 < len(batch) < len(running)
        if passed_over:  # vLLM passed a pick over: the next request served
            served[-1] = running[len(batch)]
            seen["passed over"] += 1
        admitted = []
        for request in list(waiting):
            if granted.get(request.user):
                granted[request.user] -= 1
                waiting.remove(request)
                admitted.append(request)
                if rng.random() < 0.5:  # its prefill ended: it sampled
                    served.append(request)
        for request in served:
            request.last_served = step
        running += admitted
        counts = Counter(map(user_of, served))
        user_last_served.update(dict.fromkeys(counts, step))
        fair.charge(
            counts, {user: rng.randint(0, 5) for user in map(user_of, admitted)}
        )
        served_ids = set(map(id, served))
        fair.backlogged(
            {r.user for r in running if id(r) not in served_ids} | set(wanted), ()
        )
        rotations.settled(
            step,
            list(running),
            {request.rid: 1 for request in served},
            preempted=False,
            sampled_all=rng.random() < 0.5,
            set_aside=not passed_over and rng.random() < 0.5,
        )
        may_keep = not admitted and not passed_over
        finished = set()
        for request in list(running):
            if rng.random() < 0.03:
                running.remove(request)
                finished.add(request.rid)
        seen["finished"] += bool(finished)
        if rng.random() < 0.3:
            waiting.append(new(rng.choice([*users, f"new{step}"])))
        if not running:
            return


def _picks(last_picks: dict) -> dict:
    return {
        u: (k, list(map(id_of, picks)), on) for u, (k, picks, on) in last_picks.items()
    }


def test_rotations_rank_as_share_slots_does() -> None:
    seen: Counter[str] = Counter()
    for seed in range(120):
        simulate(seed, seen)
    # Every kind of step was met, so that the comparison cannot pass
    # vacuously.
    for kind in (
        "ranked",
        "kept",
        "uncontested",
        "granted",
        "many users",
        "two in turn",
        "passed over",
        "finished",
    ):
        assert seen[kind], (kind, seen)

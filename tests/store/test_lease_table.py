"""``LeaseTable``'s asks (pure: no store, no clock): what a shared user's
lease reports, with and without lending its unused share."""

from __future__ import annotations

import pytest

from vllm_output_rate.store.lease_table import LeaseTable
from vllm_output_rate.store.messages import UNBOUNDED, Exchange, Round
from vllm_output_rate.store.settings import StoreSettings

S = 1_000_000_000
SETTINGS = StoreSettings(url="redis://127.0.0.1:1/0", refresh_s=0.1, lease_s=2.0)


def shared_lease_asked_again(lend_unused: bool) -> float:
    """The want of a shared user's second ask, after it used nothing and
    was never held back."""
    table = LeaseTable(
        SETTINGS, 100.0, {}, engines_hint=2, now_ns=0, lend_unused=lend_unused
    )
    table.note_demand({"u": 1})
    first = Round(table.asks({"u": 1}, 0), 0, 0, [], (100.0, {}))
    answer = Exchange(0, 1, 2, False, {"u": 50.0}, frozenset({"u"}))
    table.answered(0, 0)
    table.apply_answer(first, answer, 0)
    table.note_peaks({"u": 1})
    (ask,) = table.asks({"u": 1}, S)  # a shared user is asked every cycle
    assert ask.user == "u" and ask.weight == 1
    return ask.want


def test_a_shared_engine_that_used_nothing_lends_its_share() -> None:
    # Output tokens: it reports what it used (with headroom), the rest of
    # its share goes to engines that need it.
    want = shared_lease_asked_again(lend_unused=True)
    assert want != UNBOUNDED
    assert want == pytest.approx(2.0)


def test_without_lending_it_keeps_its_weighted_share() -> None:
    # Prompt tokens: bursts would wait a grace period for a lent share.
    assert shared_lease_asked_again(lend_unused=False) == UNBOUNDED

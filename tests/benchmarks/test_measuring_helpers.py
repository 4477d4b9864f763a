"""The measuring side's small pieces with logic of their own (no server)."""

from __future__ import annotations

import math
import time

import pytest

from benchmarks import noise
from benchmarks.accuracy import acc_max_tokens, plan_batches
from benchmarks.measure import median, quartiles
from benchmarks.servers import SERVER_ARGS, common_flags


def test_others_cores_are_busy_time_minus_our_processes() -> None:
    before = noise._Sample()
    before.at, before.busy, before.own = 0.0, 100.0, {1: 10.0, 2: 5.0}
    after = noise._Sample()
    # pid 3 was born in the period and counts from zero.
    after.at, after.busy, after.own = 2.0, 103.0, {1: 11.0, 2: 5.5, 3: 0.25}
    assert after.others_cores(before) == pytest.approx(1.25 / 2)
    # Ours and the machine's counters are read at different moments, so
    # ours can exceed the machine's: never below zero.
    after.busy = 101.0
    assert after.others_cores(before) == 0.0


def test_tree_cpu_counts_this_process_and_a_gone_one_as_nothing() -> None:
    ours = noise.tree_cpu()
    assert ours and all(v >= 0 for v in ours.values())
    assert noise.tree_cpu(2**22 + 12345) == {}  # above Linux's pid_max


def test_the_noise_monitor_accounts_per_period() -> None:
    monitor = noise.NoiseMonitor()
    monitor.start()
    try:
        monitor.mark("a")
        time.sleep(0.3)
        monitor.mark("b")
        time.sleep(0.1)
    finally:
        monitor.stop()
    a, b = monitor.summary("a"), monitor.summary("b")
    assert a is not None and b is not None
    assert a["seconds"] == pytest.approx(0.3, abs=0.15)
    assert 0.0 <= a["others_cores"] <= (noise.psutil.cpu_count() or 1)
    assert monitor.summary("never marked") is None


def test_median_and_quartiles_skip_missing_values() -> None:
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([None]) is None
    assert quartiles([1.0, None, 2.0, 3.0, 4.0, 5.0, math.nan]) == (2.0, 4.0)
    q1, q3 = quartiles([])
    assert math.isnan(q1) and math.isnan(q3)


def test_the_servers_common_flags_are_what_vllm_parses() -> None:
    flags = common_flags()["flags"]
    # The demo server's --max-model-len 1024 is overridden by SERVER_ARGS:
    # vLLM's parser keeps the last value, and so does the report.
    i = SERVER_ARGS.index("--max-model-len")
    assert flags["--max-model-len"] == SERVER_ARGS[i + 1]
    assert flags["--enforce-eager"] is True
    assert flags["--dtype"] == "float32"
    assert common_flags()["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_accuracy_batches_keep_each_batchs_summed_limits_under_the_cap() -> None:
    cells = [(limit, s) for limit in (5, 20, 100, 500) for s in (1, 4, 16)]
    batches = plan_batches(cells, cap=500.0)
    assert sorted(c for b in batches for c in b) == sorted(cells)  # each once
    for batch in batches:
        assert sum(limit for limit, _ in batch) <= 500.0
    # First fit, largest first: the 500s alone, the rest packed tightly.
    assert batches[:3] == [[(500, 16)], [(500, 4)], [(500, 1)]]
    assert len(batches) == 4
    assert plan_batches([(900, 1)], cap=500.0) == [[(900, 1)]]  # alone if above


def test_accuracy_requests_outlast_the_run_within_the_model_length() -> None:
    # Each stream's one request must still be open at the deadline.
    assert acc_max_tokens(20, 4, 20.0) * 4 >= 20 * 20.0
    assert acc_max_tokens(500, 1, 20.0) == 3500  # capped by --max-model-len

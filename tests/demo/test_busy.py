"""busy.py: the CPU the rest of the machine takes, from /proc, with our own
process tree (the demo and its servers) left out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_output_rate.demo.busy import (
    OthersCpu,
    machine_busy_s,
    others_cpu_s,
    own_cpu_s,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

# 0.5 s of CPU, checked as >= 0.4 s: /proc counts in clock ticks, sampled,
# so a child that spun exactly 0.4 s once read 0.3999 s in CI.
SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"


def test_others_are_the_machine_minus_our_tree() -> None:
    # A process born in the period counts from zero; ours used 3 + 1 s.
    assert others_cpu_s(10.0, {1: 2.0}, {1: 5.0, 2: 1.0}) == 6.0
    assert others_cpu_s(1.0, {}, {1: 3.0}) == 0.0  # never below zero


def test_our_tree_holds_a_child_and_its_cpu() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", SPIN + "\ninput()"], stdin=subprocess.PIPE
    )
    try:
        for _ in range(100):
            cpu = own_cpu_s().get(child.pid, 0.0)
            if cpu >= 0.4:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        assert cpu >= 0.4
        assert os.getpid() in own_cpu_s()
        assert set(own_cpu_s(root=child.pid)) == {child.pid}  # a tree of its own
    finally:
        child.communicate(b"\n")


def test_a_reaped_child_still_counts_as_ours() -> None:
    before = own_cpu_s()[os.getpid()]
    subprocess.run([sys.executable, "-c", SPIN], check=True)
    assert own_cpu_s()[os.getpid()] - before >= 0.4


def test_others_cpu_over_a_block() -> None:
    busy = machine_busy_s()
    with OthersCpu() as others:
        subprocess.run([sys.executable, "-c", SPIN], check=True)
    assert machine_busy_s() >= busy
    assert others.cores is not None and others.cores >= 0
    assert others.share == pytest.approx(others.cores / (os.cpu_count() or 1))

"""The profile comparison of benchmarks.engine_profile on made-up stats."""

from __future__ import annotations


def test_compare_lists_the_largest_differences_in_own_time_first() -> None:
    from benchmarks.engine_profile import compare

    stock = {
        ("vllm/v1/engine/core.py", 1, "step"): (10, 0.5, 9.0),
        ("vllm/v1/worker/gpu_input_batch.py", 345, "add_request"): (72, 0.002, 0.01),
        ("torch/nn/modules/module.py", 9, "_call_impl"): (100, 0.3, 3.0),
    }
    ours = {
        ("vllm/v1/engine/core.py", 1, "step"): (10, 0.5, 9.5),
        ("vllm/v1/worker/gpu_input_batch.py", 345, "add_request"): (4560, 0.12, 0.2),
        ("torch/nn/modules/module.py", 9, "_call_impl"): (100, 0.2, 2.9),
        ("vllm_output_rate/scheduling/ordering.py", 89, "share_slots"): (9, 0.08, 0.1),
    }
    text = compare(stock, ours, top=2)
    assert "stock engine/core.py:step 9.000 (10)" in text
    assert "ours  engine/core.py:step 9.500 (10)" in text
    rows = text.split("differences):\n")[1].splitlines()
    assert len(rows) == 2
    assert "add_request  calls 72 -> 4560" in rows[0] and "+0.118 s" in rows[0]
    assert "share_slots  calls 0 -> 9" in rows[1]

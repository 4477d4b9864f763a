"""The engine's tally of a run: vLLM's counters read from ``/metrics`` text."""

from __future__ import annotations

import pytest

from vllm_output_rate.demo.engine_tally import (
    EngineTally,
    TallyError,
    parse_tally,
    unseen_answers,
)

# As vLLM 0.32's /metrics writes them (prometheus_client adds _created).
PAGE = """\
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 55.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 2.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e9
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 34340.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 72.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_counters_summed_over_their_labels() -> None:
    assert parse_tally(PAGE) == EngineTally(60.0, 34340.0, 72.0)


def test_a_run_is_the_difference_of_two_readings() -> None:
    run = EngineTally(60, 34340, 72) - EngineTally(2, 1000, 8)
    assert run == EngineTally(58, 33340, 64)


def test_a_page_without_vllms_counters_is_an_error() -> None:
    with pytest.raises(TallyError, match="vllm:prompt_tokens"):
        parse_tally(PAGE.replace("vllm:prompt_tokens", "other_tokens"))


def test_answers_the_engine_did_not_give_are_counted() -> None:
    tally = EngineTally(finished=58, prompt_tokens=0, output_tokens=0)
    assert unseen_answers(tally, [56, 2]) == 0
    assert unseen_answers(tally, [56, 2, 0]) == 0
    # The clients got 66 answers; this engine finished 58 requests.
    assert unseen_answers(tally, [33, 33]) == 8

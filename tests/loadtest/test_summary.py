"""The pure summaries: percentiles, span rates, rate bins, the bound check."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.load_records import record
from vllm_output_rate.loadtest.spec import ANONYMOUS_LABEL, UserLoad
from vllm_output_rate.loadtest.summary import (
    RequestRecord,
    bin_rates,
    bound_allowance,
    bound_window,
    percentile,
    span_rate,
    summarize,
    summarize_user,
)


class TestPercentile:
    def test_small_cases(self):
        assert percentile([], 50) is None
        assert percentile([7.0], 95) == 7.0
        assert percentile([1, 2, 3, 4], 50) == 2.5
        assert percentile([10, 20], 95) == pytest.approx(19.5)
        assert percentile([3, 1, 2], 0) == 1
        assert percentile([3, 1, 2], 100) == 3

    def test_rejects_out_of_range(self):
        with pytest.raises(ValueError):
            percentile([1.0], 101)

    @given(
        st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
        st.floats(0, 100),
    )
    def test_matches_numpy_linear(self, values, q):
        np = pytest.importorskip("numpy")
        got = percentile(values, q)
        assert got == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


class TestSpanRate:
    def test_definition(self):
        # 11 tokens over 2 s: the first one starts the clock -> 5 tok/s.
        assert span_rate(1.0, 3.0, 11) == pytest.approx(5.0)

    def test_undefined_cases(self):
        assert span_rate(None, None, 0) is None
        assert span_rate(1.0, 1.0, 1) is None
        assert span_rate(1.0, 1.0, 5) is None  # all at one instant

    def test_bound_allowance(self):
        assert bound_allowance(10.0, 20.0) == pytest.approx(10.1 * 20 + 1)
        assert bound_allowance(0.0, 50.0) == pytest.approx(6.0)

    def test_bound_window_runs_from_the_first_request_sent(self):
        assert bound_window(0.5, 3.0) == pytest.approx(2.5)
        assert bound_window(None, None) == 0.0
        assert bound_window(0.5, None) == 0.0


class TestBinRates:
    def test_bins_and_boundaries(self):
        chunks = [(0.0, 1), (0.99, 2), (1.0, 4), (2.5, 8)]
        assert bin_rates(chunks, horizon_s=3.0) == [3.0, 4.0, 8.0]

    def test_horizon_pads_with_zeros_and_extends(self):
        assert bin_rates([(0.2, 5)], horizon_s=3.5) == [5.0, 0.0, 0.0, 0.0]
        assert bin_rates([(4.2, 1)], horizon_s=1.0) == [0.0, 0.0, 0.0, 0.0, 1.0]

    def test_other_bin_width(self):
        assert bin_rates([(0.1, 1), (0.6, 1), (0.7, 1)], 1.0, bin_s=0.5) == [
            2.0,
            4.0,
        ]

    def test_exact_horizon_has_no_extra_bin(self):
        assert len(bin_rates([], horizon_s=5.0)) == 5
        assert bin_rates([], horizon_s=0.0) == []

    @given(
        st.lists(
            st.tuples(st.floats(0, 30, allow_nan=False), st.integers(1, 5)),
            max_size=100,
        ),
        st.floats(0.1, 30),
    )
    def test_conserves_tokens(self, chunks, horizon):
        rates = bin_rates(chunks, horizon)
        assert sum(rates) == pytest.approx(sum(n for _, n in chunks))


class TestSummarize:
    def test_user_span_rate_over_all_streams(self):
        users = [UserLoad("a", 2, limit=10.0), UserLoad("b", 1)]
        records = [
            # user a, stream 0: tokens at 1.0 .. 1.9 (10 tokens)
            record("a", 0.5, [1.0 + 0.1 * i for i in range(10)], stream=0),
            # user a, stream 1: tokens at 2.0 .. 3.0 (11 tokens)
            record("a", 0.2, [2.0 + 0.1 * i for i in range(11)], stream=1),
            # user b: 5 tokens in a single chunk each
            record("b", 0.0, [0.3, 0.4, 0.5, 0.6, 0.7]),
        ]
        a, b = summarize(users, records, horizon_s=3.2)
        assert (a.name, a.label, a.streams, a.limit) == ("a", "a", 2, 10.0)
        assert a.tokens_client == a.tokens_server == 21
        assert a.tokens_agree
        assert a.requests_completed == 2 and a.requests_failed == 0
        assert a.first_token_s == pytest.approx(1.0)
        assert a.last_token_s == pytest.approx(3.0)
        assert a.span_s == pytest.approx(2.0)
        assert a.rate_tok_s == pytest.approx(20 / 2.0)
        # Window from a's first request sent (0.2 s, stream 1) to its last
        # token (3.0 s): 2.8 s at 10 tok/s, allowance 2.9 * 10 + 1 = 30.
        assert a.bound_window_s == pytest.approx(2.8)
        assert a.bound_allowance == pytest.approx(30.0)
        assert a.bound_ok is True
        # TTFT: 0.5 s and 1.8 s.
        assert a.ttft_p50_ms == pytest.approx(1150.0)
        assert a.ttft_p95_ms == pytest.approx(500 + 0.95 * 1300)
        assert a.series_tok_s == [0.0, 10.0, 10.0, 1.0]
        assert b.bound_ok is None and b.bound_allowance is None
        assert b.rate_tok_s == pytest.approx(4 / 0.4)
        assert b.ttft_p50_ms == pytest.approx(300.0)
        assert b.series_tok_s == [5.0, 0.0, 0.0, 0.0]

    def test_bound_exceeded_just_past_the_allowance(self):
        # 1 s window at 10 tok/s: allowance 12; 12 tokens pass, 13 do not.
        user = UserLoad("a", 1, limit=10.0)
        ok = record("a", 0.0, [i / 11 for i in range(12)])
        bad = record("a", 0.0, [i / 12 for i in range(13)])
        assert summarize_user(user, [ok], 1.0).bound_ok is True
        assert summarize_user(user, [bad], 1.0).bound_ok is False

    def test_first_tokens_delivered_late_do_not_fail_the_bound(self):
        # The engine paced 61 tokens evenly over [0.02, 1.02] s at 60 tok/s
        # (within its bound), but HTTP held the first 20 back until 0.35 s.
        # The first-to-last-token span (0.67 s) would allow 47 tokens; the
        # window from the request sent (1.02 s) allows 68.
        user = UserLoad("a", 1, limit=60.0)
        engine = [0.02 + i / 60 for i in range(61)]
        client = [max(t, 0.35) for t in engine]
        s = summarize_user(user, [record("a", 0.0, client)], 1.1)
        assert s.span_s == pytest.approx(0.67)
        assert s.bound_window_s == pytest.approx(1.02)
        assert s.bound_ok is True

    def test_multi_token_chunks_count_fully(self):
        user = UserLoad("a", 1)
        r = record("a", 0.0, [0.5, 1.5], per_chunk=3)
        s = summarize_user(user, [r], 2.0)
        assert s.tokens_client == 6
        assert s.rate_tok_s == pytest.approx(5.0)
        assert s.series_tok_s == [3.0, 3.0]

    def test_failed_and_mismatched_requests(self):
        user = UserLoad(None, 1)
        records = [
            record(None, 0.0, [0.1, 0.2, 0.3]),  # ok, 3 tokens
            record(None, 0.4, [0.5], usage=2),  # client 1 vs server 2
            record(None, 0.6, [], usage=None, status=500, error="HTTP 500: boom"),
            record(None, 0.7, [0.8], usage=None, finish=None, error="cut"),
            record("other", 0.0, [0.1]),  # another user: ignored
        ]
        s = summarize_user(user, records, 1.0)
        assert s.label == ANONYMOUS_LABEL
        assert s.requests_completed == 2
        assert s.requests_failed == 2
        assert s.tokens_client == 5  # delivered tokens of failed requests count
        assert s.tokens_server == 5  # 3 + 2
        assert s.token_count_mismatches == 1
        assert not s.tokens_agree

    def test_user_without_tokens(self):
        s = summarize_user(UserLoad("a", 1, limit=5.0), [], horizon_s=2.0)
        assert s.tokens_client == 0 and s.span_s == 0.0
        assert s.rate_tok_s is None and s.ttft_p50_ms is None
        assert s.bound_ok is True  # 0 tokens never exceed the allowance
        assert s.series_tok_s == [0.0, 0.0]

    def test_record_ok_rules(self):
        assert record("a", 0, [0.1]).ok
        assert not record("a", 0, [0.1], finish=None).ok
        assert not record("a", 0, [0.1], status=429).ok
        assert not record("a", 0, [0.1], error="x").ok
        assert record("a", 0.25, [0.75]).ttft_s == pytest.approx(0.5)
        assert RequestRecord("a", 0, 0.0).ttft_s is None

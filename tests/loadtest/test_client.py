"""The streaming client and run loop, against the scripted server
(harness.fake_openai_server; the real vLLM server: tests/e2e/test_load_tool.py)."""

from __future__ import annotations

import asyncio
import itertools
import socket
import time

import pytest

from harness.fake_openai_server import ENGINE_METRICS, SEPARATOR_TEXT
from harness.load_records import PNG_MAGIC
from vllm_output_rate.loadtest import LoadError, check_server, list_models_sync
from vllm_output_rate.loadtest.client import (
    ProgressSnapshot,
    count_chunk_tokens,
    run_load_sync,
)
from vllm_output_rate.loadtest.report import format_table, plot_rates
from vllm_output_rate.loadtest.results import LoadResult
from vllm_output_rate.loadtest.spec import ANONYMOUS_LABEL, LoadSpec, UserLoad


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_chunk_counting():
    assert count_chunk_tokens({"text": "ab", "token_ids": [5, 6]}, "completions") == 2
    assert count_chunk_tokens({"text": "", "token_ids": []}, "completions") == 0
    # Without token ids: one per chunk, even with empty text (a token whose
    # bytes the detokenizer still holds back) ...
    assert count_chunk_tokens({"text": ""}, "completions") == 1
    assert count_chunk_tokens({"delta": {"content": "x"}}, "chat") == 1
    # ... except chat's opening role chunk.
    role = {"delta": {"role": "assistant", "content": ""}}
    assert count_chunk_tokens(role, "chat") == 0
    assert count_chunk_tokens({**role, "token_ids": [3]}, "chat") == 1


class TestClientAgainstFakeServer:
    def test_counts_tokens_and_stops_at_deadline(self, fake_server):
        url, seen = fake_server
        spec = LoadSpec(
            base_url=url + "/v1",
            model="multi",
            users=[UserLoad("a", 2, limit=1000.0), UserLoad(None, 1)],
            max_tokens=10,
            duration_s=0.5,
        )
        snapshots: list[ProgressSnapshot] = []
        result = run_load_sync(spec, snapshots.append, progress_interval_s=0.1)
        assert result.ok, result.error_summary()
        assert len(result.records) >= 3
        for r in result.records:
            assert r.tokens == r.usage_completion_tokens == 10
            assert [n for _, n in r.chunks] == [3, 3, 3, 1]
            assert r.finish_reason == "length" and r.status == 200
            assert r.start_s < spec.duration_s  # never started after the deadline
            assert r.engine_metrics == ENGINE_METRICS
        a = result.user("a")
        assert a.tokens_client == a.tokens_server == 10 * a.requests_completed
        assert {r.stream for r in result.records if r.user == "a"} == {0, 1}
        assert snapshots[-1].done
        assert snapshots[-1].tokens == {
            "a": a.tokens_client,
            ANONYMOUS_LABEL: (result.user(None).tokens_client),
        }
        anon_bodies = [
            b for b in seen if b["model"] == "multi" and "vllm_xargs" not in b
        ]
        assert anon_bodies and all(b["path"] == "/v1/completions" for b in seen)

    def test_in_flight_request_finishes_after_deadline(self, fake_server):
        url, _ = fake_server
        spec = LoadSpec(url, "slow", [UserLoad("a", 1)], max_tokens=20, duration_s=0.1)
        result = run_load_sync(spec)
        assert len(result.records) == 1  # ~0.4 s request: only one started
        assert result.ok and result.records[0].tokens == 20
        assert result.elapsed_s > spec.duration_s

    @pytest.mark.parametrize(
        ("model", "error_part"),
        [
            ("bad", "HTTP 400: bad request: nope"),
            ("cut", "without a finish_reason"),
            ("inline-error", "engine died"),
        ],
    )
    def test_failures_are_recorded(self, fake_server, model, error_part):
        url, _ = fake_server
        spec = LoadSpec(url, model, [UserLoad("a", 1)], max_tokens=5, duration_s=0.2)
        result = run_load_sync(spec)
        assert not result.ok
        assert all(error_part in (r.error or "") for r in result.failed_requests)
        assert error_part in result.error_summary()[0]
        assert result.user("a").requests_failed == len(result.records)
        # Failed requests back off instead of spinning.
        assert len(result.records) <= 2

    def test_429s_are_reported_apart_and_their_retry_after_honoured(self, fake_server):
        from vllm_output_rate.loadtest.report import format_table

        url, _ = fake_server
        spec = LoadSpec(
            url, "limited", [UserLoad("a", 1)], max_tokens=5, duration_s=0.4
        )
        result = run_load_sync(spec)
        assert result.ok and not result.failed_requests  # a 429 is not an error
        summary = result.user("a")
        assert summary.requests_rejected == len(result.records) >= 2
        assert summary.requests_failed == 0
        # retry-after-ms wins over retry-after, and the stream waits for it.
        assert summary.retry_after_p50_s == pytest.approx(0.15)
        assert len(result.records) <= 4
        table = format_table(result)
        assert "429" in table and "retry" in table  # the requests cell
        assert "refused with 429" in table  # the totals line

    def test_a_user_that_thinks_pauses_after_each_answer(self, fake_server):
        url, _ = fake_server
        users = [UserLoad("quick", 1), UserLoad("reader", 1, think_s=0.2)]
        spec = LoadSpec(url, "multi", users, max_tokens=2, duration_s=0.8)
        result = run_load_sync(spec)
        assert result.ok, result.error_summary()
        reader = [r for r in result.records if r.user == "reader"]
        quick = [r for r in result.records if r.user == "quick"]
        assert 2 <= len(reader) <= 4 < len(quick)
        for before, after in itertools.pairwise(reader):
            assert after.start_s - (before.end_s or 0) >= 0.2

    def test_chat_endpoint_path(self, fake_server):
        url, seen = fake_server
        spec = LoadSpec(
            url,
            "ok",
            [UserLoad("c", 1)],
            max_tokens=3,
            duration_s=0.05,
            endpoint="chat",
        )
        result = run_load_sync(spec)
        assert result.ok
        assert seen[-1]["path"] == "/v1/chat/completions"
        assert seen[-1]["messages"][0]["role"] == "user"

    def test_unknown_model_is_a_load_error(self, fake_server):
        url, _ = fake_server
        with pytest.raises(LoadError, match="not served"):
            run_load_sync(LoadSpec(url, "nope", [UserLoad("a", 1)], duration_s=0.1))

    def test_the_check_alone_and_a_run_that_skips_it(self, fake_server):
        url, _ = fake_server
        nope = LoadSpec(url, "nope", [UserLoad("a", 1)], duration_s=0.1)
        with pytest.raises(LoadError, match="not served"):
            asyncio.run(check_server(nope))
        # A caller that checked already: the window opens without asking
        # again (the scripted server answers any model's requests).
        result = run_load_sync(nope, server_checked=True)
        assert result.records and result.ok

    def test_unreachable_server_names_the_url(self):
        url = f"http://127.0.0.1:{closed_port()}"
        with pytest.raises(LoadError, match=f"{url}/v1/models"):
            run_load_sync(LoadSpec(url, "m", [UserLoad("a", 1)], duration_s=0.1))

    def test_a_run_survives_json_table_and_plot(self, fake_server, tmp_path):
        url, _ = fake_server
        spec = LoadSpec(
            url,
            "ok",
            [UserLoad("a", 2, limit=5.0), UserLoad("b", 1)],
            max_tokens=8,
            duration_s=0.3,
        )
        before = time.monotonic()
        result = run_load_sync(spec)
        assert result.window_opened_s is not None
        assert before <= result.window_opened_s <= time.monotonic()
        again = LoadResult.read_json(result.write_json(tmp_path / "r.json"))
        assert again.users == result.users
        assert again.spec == result.spec
        lines = format_table(result).splitlines()
        row_a = next(line for line in lines if line.startswith("a "))
        row_b = next(line for line in lines if line.startswith("b "))
        assert "NO" in row_a  # 5 tok/s is far below what the fake server sends
        assert "n.a." in row_b
        png = plot_rates(
            {"stock vLLM": result, "with limits": again}, tmp_path / "p.png"
        )
        assert png.read_bytes().startswith(PNG_MAGIC)

    @pytest.mark.parametrize("endpoint", ["completions", "chat"])
    def test_text_with_unicode_line_breaks(self, fake_server, endpoint):
        # Every chunk's text holds U+0085, U+2028, U+2029 etc.; with httpx's
        # aiter_lines() each chunk was cut in two and every request failed.
        url, _ = fake_server
        spec = LoadSpec(
            url,
            "separators",
            [UserLoad("a", 2)],
            max_tokens=5,
            duration_s=0.2,
            endpoint=endpoint,
        )
        result = run_load_sync(spec)
        assert result.ok, result.error_summary()
        assert all(r.tokens == r.usage_completion_tokens == 5 for r in result.records)
        assert all(c in SEPARATOR_TEXT for c in "\x85\u2028\u2029")

    def test_list_models(self, fake_server):
        url, _ = fake_server
        assert list_models_sync(url + "/v1/")[0] == "ok"
        unreachable = f"http://127.0.0.1:{closed_port()}"
        with pytest.raises(LoadError, match=f"{unreachable}/v1/models"):
            list_models_sync(unreachable)

"""LoadResult and its JSON result file."""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness.load_records import synthetic_result
from vllm_output_rate.loadtest.results import JSON_FORMAT, LoadResult
from vllm_output_rate.loadtest.summary import CAVEAT


class TestLoadResult:
    def test_accessors(self):
        result = synthetic_result()
        assert not result.ok
        assert [r.status for r in result.failed_requests] == [503]
        assert result.total_tokens == 8 + 4 + 1
        assert result.user("user-b").tokens_client == 4
        assert result.user(None).requests_failed == 1
        with pytest.raises(KeyError):
            result.user("nobody")
        assert result.error_summary() == ["1 x HTTP 503: overloaded"]

    def test_error_summary_ranks_by_count(self):
        result = synthetic_result()
        for r in result.records[:2]:
            r.error = "timed out"
        assert result.error_summary() == [
            "2 x timed out",
            "1 x HTTP 503: overloaded",
        ]
        assert result.error_summary(limit=1) == ["2 x timed out"]
        expected = [r for r in result.failed_requests if r.error != "timed out"]
        assert result.error_summary(failed=expected) == ["1 x HTTP 503: overloaded"]


class TestJSONFile:
    def test_round_trip(self, tmp_path):
        result = synthetic_result()
        path = result.write_json(tmp_path / "sub" / "r.json")
        data = json.loads(path.read_text())
        assert data["format"] == JSON_FORMAT
        assert data["caveat"] == CAVEAT
        assert [u["label"] for u in data["users"]] == [
            "user-a",
            "user-b",
            "(anonymous)",
        ]
        assert data["users"][0]["tokens_agree"] is True
        again = LoadResult.read_json(path)
        assert again.spec == result.spec
        assert again.records == result.records
        assert again.users == result.users  # summaries recomputed from records

    def test_the_windows_clock_reading_survives_the_file(self, tmp_path):
        result = dataclasses.replace(synthetic_result(), window_opened_s=1234.5)
        again = LoadResult.read_json(result.write_json(tmp_path / "r.json"))
        assert again.window_opened_s == 1234.5
        # A file written before the field was kept reads as unknown.
        data = json.loads(result.to_json())
        del data["window_opened_monotonic_s"]
        assert LoadResult.from_dict(data).window_opened_s is None

    def test_without_chunks_keeps_token_counts(self):
        result = synthetic_result()
        small = json.loads(result.to_json(include_chunks=False))
        assert all(r["chunks"] == [] for r in small["records"])
        assert [r["tokens"] for r in small["records"]] == [4, 4, 4, 1]
        # The stored summaries still carry the rates.
        assert small["users"][0]["rate_tok_s"] == result.users[0].rate_tok_s

"""The text table and the rate chart."""

from __future__ import annotations

import pytest

from harness.load_records import PNG_MAGIC, synthetic_result
from vllm_output_rate.loadtest.report import format_table, plot_rates
from vllm_output_rate.loadtest.spec import ANONYMOUS_LABEL


class TestReport:
    def test_table(self):
        table = format_table(synthetic_result(), title="demo")
        lines = table.splitlines()
        assert lines[0].strip() == "demo"
        header = next(line for line in lines if line.lstrip().startswith("user"))
        for column in (
            "limit",
            "streams",
            "requests",
            "tokens client / server",
            "tok/s",
            "TTFT p50 / p95 ms",
            "bound held",
        ):
            assert column in header
        row_a = next(line for line in lines if line.startswith("user-a"))
        assert "8 / 8" in row_a and "yes" in row_a
        assert "20.0" in row_a  # 7 tokens over 0.35 s
        row_b = next(line for line in lines if line.startswith("user-b"))
        assert "none" in row_b and "n.a." in row_b and "2.0" in row_b
        row_anon = next(line for line in lines if line.startswith(ANONYMOUS_LABEL))
        assert "(+1 failed)" in row_anon
        assert "1 failed" in lines[-1] and "3.0 s" in lines[-1]

    def test_single_result_plot(self, tmp_path):
        path = plot_rates(synthetic_result(), tmp_path / "one.png")
        assert path.read_bytes().startswith(PNG_MAGIC)
        with pytest.raises(ValueError):
            plot_rates({}, tmp_path / "none.png")

"""Tests for the load generator, its report and the ``bench`` CLI.

Three layers:

- pure tests of the summary maths on synthetic records;
- the streaming client against a small scripted SSE server (fast, no vLLM);
- an end-to-end run against a real stock vLLM server (``-m e2e``).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_output_rate import cli
from vllm_output_rate.loadtest.loadgen import (
    ANONYMOUS_LABEL,
    CAVEAT,
    USER_FIELD,
    LoadError,
    LoadResult,
    LoadSpec,
    ProgressSnapshot,
    RequestRecord,
    UserLoad,
    bin_rates,
    bound_allowance,
    build_request_body,
    count_chunk_tokens,
    iter_sse_data,
    list_models_sync,
    normalize_base_url,
    percentile,
    run_load_sync,
    span_rate,
    summarize,
    summarize_user,
)
from vllm_output_rate.loadtest.report import format_table, plot_rates

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(
    user: str | None,
    start: float,
    times: list[float],
    *,
    stream: int = 0,
    per_chunk: int = 1,
    usage: int | None = -1,
    finish: str | None = "length",
    status: int | None = 200,
    error: str | None = None,
) -> RequestRecord:
    """A synthetic record; ``usage=-1`` means 'what the client counted'."""
    r = RequestRecord(user=user, stream=stream, start_s=start)
    for t in times:
        r.add_chunk(t, per_chunk)
    r.end_s = times[-1] if times else start
    r.finish_reason = finish
    r.usage_completion_tokens = r.tokens if usage == -1 else usage
    r.status = status
    r.error = error
    return r


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# Pure maths
# --------------------------------------------------------------------------


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
        assert bound_allowance(10.0, 20.0) == pytest.approx(10.35 * 20 + 1)
        assert bound_allowance(0.0, 50.0) == pytest.approx(18.5)


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
        # 21 tokens over 2 s at 10 tok/s: allowance 2.35 * 10 + 1 = 24.5.
        assert a.bound_allowance == pytest.approx(24.5)
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
        # 1 s span at 10 tok/s: allowance 14.5; 14 tokens pass, 15 do not.
        user = UserLoad("a", 1, limit=10.0)
        ok = record("a", 0.0, [i / 13 for i in range(14)])
        bad = record("a", 0.0, [i / 14 for i in range(15)])
        assert summarize_user(user, [ok], 1.0).bound_ok is True
        assert summarize_user(user, [bad], 1.0).bound_ok is False

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


# --------------------------------------------------------------------------
# Request bodies, SSE parsing, chunk counting, spec validation
# --------------------------------------------------------------------------


def spec_for(**kw) -> LoadSpec:
    defaults = dict(base_url="http://x", model="m", users=[UserLoad("a", 1)])
    return LoadSpec(**{**defaults, **kw})


class TestRequestBody:
    def test_completions_named_user(self):
        spec = spec_for(max_tokens=7, prompt="hi")
        body = build_request_body(spec, UserLoad("alice", 1))
        assert body == {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "return_token_ids": True,
            "vllm_xargs": {USER_FIELD: "alice"},
        }

    def test_chat_anonymous_has_no_xargs(self):
        spec = spec_for(endpoint="chat", prompt="hi", ignore_eos=False)
        body = build_request_body(spec, UserLoad(None, 1))
        assert body["messages"] == [{"role": "user", "content": "hi"}]
        assert "prompt" not in body and "vllm_xargs" not in body
        assert body["ignore_eos"] is False

    def test_extra_body_merges_xargs(self):
        spec = spec_for(
            extra_body={"temperature": 0.0, "vllm_xargs": {"k": 1}},
            return_token_ids=False,
        )
        body = build_request_body(spec, UserLoad("bob", 1))
        assert body["temperature"] == 0.0
        assert body["vllm_xargs"] == {"k": 1, USER_FIELD: "bob"}
        assert "return_token_ids" not in body
        assert spec.extra_body == {"temperature": 0.0, "vllm_xargs": {"k": 1}}

    def test_normalize_base_url(self):
        assert normalize_base_url("http://h:1/") == "http://h:1"
        assert normalize_base_url("http://h:1/v1/") == "http://h:1"
        assert normalize_base_url(" http://h:1/v1 ") == "http://h:1"


class TestSpecValidation:
    @pytest.mark.parametrize(
        "kw",
        [
            dict(users=[]),
            dict(users=[UserLoad("a", 1), UserLoad("a", 2)]),
            dict(users=[UserLoad(None, 1), UserLoad(None, 1)]),
            dict(users=[UserLoad("a", 0)]),
            dict(users=[UserLoad("", 1)]),
            dict(users=[UserLoad("a", 1, limit=0)]),
            dict(users=[UserLoad("a", 1, limit=math.inf)]),
            dict(max_tokens=0),
            dict(duration_s=0),
            dict(request_timeout_s=-1),
            dict(endpoint="embeddings"),
        ],
    )
    def test_rejects(self, kw):
        with pytest.raises(ValueError):
            spec_for(**kw)


async def _collect(lines: list[str]) -> list[str]:
    async def gen():
        for line in lines:
            yield line

    return [d async for d in iter_sse_data(gen())]


class TestSSE:
    def test_events(self):
        lines = [
            ": comment",
            'data: {"a": 1}',
            "",
            "event: x",
            "data:one",
            "data: two",
            "",
            "",
            "data: [DONE]",
        ]
        assert asyncio.run(_collect(lines)) == ['{"a": 1}', "one\ntwo", "[DONE]"]

    def test_chunk_counting(self):
        assert (
            count_chunk_tokens({"text": "ab", "token_ids": [5, 6]}, "completions") == 2
        )
        assert count_chunk_tokens({"text": "", "token_ids": []}, "completions") == 0
        # Without token ids: one per chunk, even with empty text (a token whose
        # bytes the detokenizer still holds back) ...
        assert count_chunk_tokens({"text": ""}, "completions") == 1
        assert count_chunk_tokens({"delta": {"content": "x"}}, "chat") == 1
        # ... except chat's opening role chunk.
        role = {"delta": {"role": "assistant", "content": ""}}
        assert count_chunk_tokens(role, "chat") == 0
        assert count_chunk_tokens({**role, "token_ids": [3]}, "chat") == 1


# --------------------------------------------------------------------------
# The client against a scripted SSE server
# --------------------------------------------------------------------------

FAKE_MODELS = ["ok", "multi", "bad", "cut", "inline-error", "slow"]


class _FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    requests_seen: list[dict]

    def log_message(self, *args):  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            data = {"data": [{"id": m} for m in FAKE_MODELS]}
            self._send(200, json.dumps(data).encode())
        else:
            self._send(404, b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests_seen.append({"path": self.path, **body})
        model = body["model"]
        if model == "bad":
            err = {"error": {"message": "bad request: nope", "code": 400}}
            self._send(400, json.dumps(err).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        per = 3 if model == "multi" else 1
        sent = 0
        while sent < n:
            k = min(per, n - sent)
            sent += k
            last = sent >= n
            if model == "cut" and sent > 2:
                return  # connection closes without a finish_reason
            if model == "inline-error" and sent > 2:
                self._event({"error": {"message": "engine died"}})
                return
            choice = {
                "index": 0,
                "text": "x" * k,
                "finish_reason": "length" if last else None,
                "token_ids": list(range(k)),
            }
            self._event({"choices": [choice]})
            time.sleep(0.02 if model == "slow" else 0.002)
        self._event({"choices": [], "usage": {"completion_tokens": n}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, payload: dict) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, list[dict]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHandler)
    server.daemon_threads = True
    server.requests_seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.requests_seen
    finally:
        server.shutdown()
        server.server_close()


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

    def test_unreachable_server_names_the_url(self):
        url = f"http://127.0.0.1:{closed_port()}"
        with pytest.raises(LoadError, match=f"{url}/v1/models"):
            run_load_sync(LoadSpec(url, "m", [UserLoad("a", 1)], duration_s=0.1))

    def test_json_round_trip_table_and_plot(self, fake_server, tmp_path):
        url, _ = fake_server
        spec = LoadSpec(
            url,
            "ok",
            [UserLoad("a", 2, limit=5.0), UserLoad("b", 1)],
            max_tokens=8,
            duration_s=0.3,
        )
        result = run_load_sync(spec)
        path = result.write_json(tmp_path / "sub" / "r.json")
        data = json.loads(path.read_text())
        assert data["caveat"] == CAVEAT
        assert [u["label"] for u in data["users"]] == ["a", "b"]
        again = LoadResult.read_json(path)
        assert again.users == result.users
        assert again.spec == result.spec
        small = json.loads(result.to_json(include_chunks=False))
        assert all(r["chunks"] == [] for r in small["records"])

        lines = format_table(result).splitlines()
        row_a = next(line for line in lines if line.startswith("a "))
        row_b = next(line for line in lines if line.startswith("b "))
        assert "NO" in row_a  # 5 tok/s is far below what the fake server sends
        assert "n.a." in row_b
        png = plot_rates(
            {"stock vLLM": result, "with limits": again}, tmp_path / "p.png"
        )
        assert png.read_bytes().startswith(PNG_MAGIC)


# --------------------------------------------------------------------------
# Report and CLI
# --------------------------------------------------------------------------


def synthetic_result() -> LoadResult:
    users = [
        UserLoad("user-a", 2, limit=30.0),
        UserLoad("user-b", 1),
        UserLoad(None, 1),
    ]
    spec = LoadSpec("http://x", "m", users, max_tokens=4, duration_s=3.0)
    records = [
        record("user-a", 0.0, [0.5, 0.6, 0.7, 0.8]),
        record("user-a", 0.0, [0.55, 0.65, 0.75, 0.85], stream=1),
        record("user-b", 0.0, [1.0, 1.5, 2.0, 2.5]),
        record(
            None,
            0.0,
            [0.2],
            usage=None,
            finish=None,
            status=503,
            error="HTTP 503: overloaded",
        ),
    ]
    return LoadResult.build(spec, records, elapsed_s=3.0)


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


class TestCLIParsing:
    def test_users(self):
        users = cli.parse_users("user-a:4, user-b:1,-:2,solo")
        assert [(u.name, u.streams) for u in users] == [
            ("user-a", 4),
            ("user-b", 1),
            (None, 2),
            ("solo", 1),
        ]
        assert cli.parse_users("ns:x:3")[0].name == "ns:x"

    @pytest.mark.parametrize("text", ["", "a:0", "a:x", "a:1,a:2", ":3"])
    def test_bad_users(self, text):
        with pytest.raises(Exception, match="--users"):
            cli.parse_users(text)

    def test_limits(self):
        assert cli.parse_limits("user-a:20,-:5.5") == {"user-a": 20.0, None: 5.5}
        for bad in ("a", "a:0", "a:x", "a:nan"):
            with pytest.raises(Exception, match="--limits"):
                cli.parse_limits(bad)

    def test_subcommands_registered_in_one_place(self):
        assert "bench" in [c.name for c in cli.SUBCOMMANDS]
        parser = cli.build_parser()
        args = parser.parse_args(["bench", "--users", "a:2"])
        assert args.command == "bench" and args._run is not None

    def test_bad_arguments_exit_2(self, capsys):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "--users", "a:0"])
        assert exc.value.code == 2
        assert cli.main(["bench", "--users", "a:1", "--limits", "b:3"]) == 2
        assert "not in --users" in capsys.readouterr().err

    def test_progress_line(self):
        import io

        out = io.StringIO()
        line = cli.ProgressLine(out, plain_every_s=100)
        snap = ProgressSnapshot(
            1.5, 10, {"a": 12, "b": 3}, {"a": 1, "b": 0}, {"a": 0, "b": 1}, 2
        )
        line(snap)
        line(snap)  # throttled when not a terminal
        snap.done = True
        line(snap)
        lines = out.getvalue().splitlines()
        assert len(lines) == 2
        assert "a 12 tok" in lines[0] and "in flight 2" in lines[0]
        assert "1 failed" in lines[0]

    def test_unreachable_server_exits_1(self, capsys):
        url = f"http://127.0.0.1:{closed_port()}"
        code = cli.main(
            ["bench", "--base-url", url, "--users", "a:1", "--duration", "1", "--quiet"]
        )
        assert code == 1
        err = capsys.readouterr().err
        assert f"could not reach the vLLM server at {url}/v1/models" in err

    def test_bench_against_fake_server(self, fake_server, tmp_path, capsys):
        url, _ = fake_server
        out_json, out_png = tmp_path / "o.json", tmp_path / "o.png"
        code = cli.main(
            [
                "bench",
                "--base-url",
                url,
                "--users",
                "a:2,-:1",
                "--limits",
                "a:1000",
                "--max-tokens",
                "5",
                "--duration",
                "0.3",
                "--json",
                str(out_json),
                "--plot",
                str(out_png),
            ]
        )
        captured = capsys.readouterr()
        assert code == 0, captured.err
        # --model omitted: the server's first model ("ok") is used.
        assert json.loads(out_json.read_text())["spec"]["model"] == "ok"
        assert out_png.read_bytes().startswith(PNG_MAGIC)
        assert "tokens client / server" in captured.out
        assert CAVEAT in captured.out
        assert "[" in captured.err  # progress

    def test_bench_failed_requests_exit_1(self, fake_server, capsys):
        url, _ = fake_server
        code = cli.main(
            [
                "bench",
                "--base-url",
                url,
                "--model",
                "bad",
                "--users",
                "a:1",
                "--duration",
                "0.2",
                "--quiet",
            ]
        )
        assert code == 1
        err = capsys.readouterr().err
        assert "requests failed" in err and "HTTP 400" in err

    def test_fail_on_bound(self, fake_server, capsys):
        url, _ = fake_server
        argv = [
            "bench",
            "--base-url",
            url,
            "--model",
            "ok",
            "--users",
            "a:1",
            "--limits",
            "a:1",
            "--max-tokens",
            "20",
            "--duration",
            "0.2",
            "--quiet",
        ]
        assert cli.main(argv) == 0
        assert "bound exceeded for: a" in capsys.readouterr().err
        assert cli.main([*argv, "--fail-on-bound"]) == 1


def test_module_entry_point():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "vllm_output_rate.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--users" in proc.stdout


# --------------------------------------------------------------------------
# tests/server.py with a fake server command (no vLLM)
# --------------------------------------------------------------------------

FAKE_SERVER = r"""
import http.server, pathlib, signal, subprocess, sys, time
port, mode = int(sys.argv[1]), sys.argv[2]
print("fake server starting", flush=True)
for i in range(60):
    print(f"log line {i}", flush=True)
if mode == "fail":
    print("FATAL: model not found", flush=True)
    sys.exit(3)
if mode == "busy-once":
    marker = pathlib.Path(sys.argv[3])
    if not marker.exists():
        marker.write_text("x")
        print("OSError: [Errno 98] Address already in use", flush=True)
        sys.exit(1)
child = "import signal, time\n"
if mode == "stubborn":
    child += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# An 'engine' process in the same process group.
subprocess.Popen([sys.executable, "-c", child + "time.sleep(300)"])
if mode == "hang":
    time.sleep(300)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def fake_vllm(monkeypatch):
    import sys

    from vllm_output_rate.demo import server

    monkeypatch.setattr(
        server,
        "server_command",
        lambda model_path, port, extra_args=(): [
            sys.executable,
            "-c",
            FAKE_SERVER,
            str(port),
            *extra_args,
        ],
    )
    return server


def group_gone(pgid: int) -> bool:
    import os

    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


class TestServerHelper:
    def test_yields_url_and_stops_the_whole_group(self, fake_vllm, tmp_path):
        import urllib.request

        with fake_vllm.running_server("m", ["ok"], log_dir=tmp_path) as url:
            assert isinstance(url, str) and url.startswith("http://127.0.0.1:")
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                assert response.status == 200
            assert "fake server starting" in url.log_text()
            assert url.log_path == tmp_path / "server.log"
            pgid = url.process.pid
            assert not group_gone(pgid)
            assert str(__import__("copy").deepcopy(url)) == url
        assert group_gone(pgid)

    def test_start_failure_shows_log_tail(self, fake_vllm):
        with (
            pytest.raises(fake_vllm.ServerStartError) as exc,
            fake_vllm.running_server("m", ["fail"]),
        ):
            pytest.fail("should not start")
        message = str(exc.value)
        assert "exited with code 3" in message
        assert "FATAL: model not found" in message
        assert "log line 59" in message and "log line 11" in message
        assert "log line 10" not in message  # only the last 50 lines

    def test_health_timeout(self, fake_vllm):
        with (
            pytest.raises(fake_vllm.ServerStartError, match="not healthy after 1 s"),
            fake_vllm.running_server("m", ["hang"], start_timeout_s=1),
        ):
            pytest.fail("should not start")

    def test_sigkill_after_stop_timeout(self, fake_vllm):
        with fake_vllm.running_server("m", ["stubborn"], stop_timeout_s=1) as url:
            pgid = url.process.pid
        t = time.monotonic()
        assert group_gone(pgid)
        assert time.monotonic() - t < 1

    def test_retries_when_port_is_taken(self, fake_vllm, tmp_path):
        args = ["busy-once", str(tmp_path / "marker")]
        with fake_vllm.running_server("m", args, log_dir=tmp_path) as url:
            assert url.log_path.name == "server.attempt2.log"
        assert "Address already in use" in (tmp_path / "server.log").read_text()


# --------------------------------------------------------------------------
# End to end against stock vLLM
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stock_server(
    tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    from vllm_output_rate.demo.server import running_server

    with running_server(
        tiny_model_path,
        [],
        env={"VLLM_PLUGINS": ""},  # stock vLLM: keep our plugin out
        log_dir=tmp_path_factory.mktemp("stock-server"),
    ) as url:
        yield url


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_e2e_stock_vllm(stock_server: str, tmp_path: Path, capsys):
    max_tokens = 64
    spec = LoadSpec(
        base_url=stock_server,
        model=list_models_sync(stock_server)[0],
        users=[UserLoad("user-a", 2, limit=50.0), UserLoad("user-b", 1)],
        max_tokens=max_tokens,
        duration_s=5.0,
    )
    result = run_load_sync(spec)
    assert result.ok, result.error_summary()
    assert len(result.records) >= 3
    for r in result.records:
        assert r.tokens == r.usage_completion_tokens == max_tokens
        assert r.finish_reason == "length"
        assert r.start_s < spec.duration_s
    for u in result.users:
        assert u.tokens_client == u.tokens_server > 0
        assert u.requests_completed >= u.streams
        assert u.rate_tok_s is not None and u.rate_tok_s > 0
    table = format_table(result)
    assert "user-a" in table and "user-b" in table
    png = plot_rates({"stock vLLM": result}, tmp_path / "rates.png")
    assert png.read_bytes().startswith(PNG_MAGIC)

    # Without token ids the client counts one token per chunk: check that
    # this matches the server on a lightly loaded stock server.
    fallback = run_load_sync(
        LoadSpec(
            stock_server,
            spec.model,
            [UserLoad("solo", 1)],
            max_tokens=max_tokens,
            duration_s=1.0,
            return_token_ids=False,
        )
    )
    assert fallback.ok, fallback.error_summary()
    assert all(
        r.tokens == r.usage_completion_tokens == max_tokens for r in fallback.records
    )

    # The CLI, chat endpoint, model discovered from /v1/models.
    out_json, out_png = tmp_path / "cli.json", tmp_path / "cli.png"
    code = cli.main(
        [
            "bench",
            "--base-url",
            stock_server,
            "--users",
            "user-a:1,-:1",
            "--limits",
            "user-a:1000",
            "--endpoint",
            "chat",
            "--max-tokens",
            "16",
            "--duration",
            "2",
            "--quiet",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(out_json.read_text())
    assert all(r["tokens_client"] == r["tokens_server"] > 0 for r in data["users"])
    assert all(
        sum(n for _, n in r["chunks"]) == r["usage_completion_tokens"] == 16
        for r in data["records"]
    )
    assert out_png.read_bytes().startswith(PNG_MAGIC)
    assert "bound held" in captured.out

"""``vllm-output-rate load`` (alias ``bench``): parsing, output, exit codes."""

from __future__ import annotations

import io
import json
import socket

import pytest

from harness.load_records import PNG_MAGIC
from vllm_output_rate import cli
from vllm_output_rate.cli.load import parse_limits, parse_users
from vllm_output_rate.cli.progress import ProgressLine
from vllm_output_rate.loadtest import CAVEAT, ProgressSnapshot


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(url: str, *args: str, command: str = "load") -> list[str]:
    """The argv of a short quiet load run against ``url``."""
    return [command, "--base-url", url, "--duration", "0.2", "--quiet", *args]


class TestParsing:
    def test_users(self):
        users = parse_users("user-a:4, user-b:1,-:2,solo")
        assert [(u.name, u.streams) for u in users] == [
            ("user-a", 4),
            ("user-b", 1),
            (None, 2),
            ("solo", 1),
        ]
        assert parse_users("ns:x:3")[0].name == "ns:x"

    @pytest.mark.parametrize("text", ["", "a:0", "a:x", "a:1,a:2", ":3"])
    def test_bad_users(self, text):
        with pytest.raises(Exception, match="--users"):
            parse_users(text)

    def test_limits(self):
        assert parse_limits("user-a:20,-:5.5") == {"user-a": 20.0, None: 5.5}
        for bad in ("a", "a:0", "a:x", "a:nan"):
            with pytest.raises(Exception, match="--limits"):
                parse_limits(bad)

    @pytest.mark.parametrize("command", ["load", "bench"])
    def test_load_and_its_alias_bench(self, command):
        args = cli.build_parser().parse_args([command, "--users", "a:2"])
        assert args.command == command
        assert args.func is cli.load.run
        assert [(u.name, u.streams) for u in args.users] == [("a", 2)]

    @pytest.mark.parametrize(
        "argv",
        [
            ["load", "--users", "a:0"],
            ["load"],  # --users is required
            ["load", "--users", "a", "--duration", "0"],
            ["load", "--users", "a", "--max-tokens", "x"],
            ["load", "--users", "a", "--endpoint", "embeddings"],
        ],
    )
    def test_bad_arguments_exit_2(self, argv, capsys):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        assert "error:" in capsys.readouterr().err

    def test_limits_for_unknown_users_exit_2(self, capsys):
        assert cli.main(["load", "--users", "a:1", "--limits", "b:3"]) == 2
        assert "not in --users: b" in capsys.readouterr().err


def test_progress_line():
    out = io.StringIO()
    line = ProgressLine(out, plain_every_s=100)
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


class TestAgainstTheScriptedServer:
    def test_unreachable_server_exits_1(self, capsys):
        url = f"http://127.0.0.1:{closed_port()}"
        assert cli.main(load(url, "--users", "a:1")) == 1
        err = capsys.readouterr().err
        assert f"could not reach the vLLM server at {url}/v1/models" in err

    def test_table_json_plot_and_progress(self, fake_server, tmp_path, capsys):
        url, _ = fake_server
        out_json, out_png = tmp_path / "o.json", tmp_path / "o.png"
        argv = load(url, "--users", "a:2,-:1", "--limits", "a:1000")
        argv.remove("--quiet")
        argv += ["--max-tokens", "5", "--json", str(out_json), "--plot", str(out_png)]
        code = cli.main(argv)
        captured = capsys.readouterr()
        assert code == 0, captured.err
        # --model omitted: the server's first model ("ok") is used.
        assert json.loads(out_json.read_text())["spec"]["model"] == "ok"
        assert out_png.read_bytes().startswith(PNG_MAGIC)
        assert "tokens client / server" in captured.out
        assert CAVEAT in captured.out
        assert "vllm-output-rate load: ok at" in captured.err
        assert "[" in captured.err  # progress

    @pytest.mark.parametrize("command", ["load", "bench"])
    def test_failed_requests_exit_1(self, fake_server, capsys, command):
        url, _ = fake_server
        argv = load(url, "--model", "bad", "--users", "a:1", command=command)
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "requests failed" in err and "HTTP 400" in err

    def test_fail_on_bound(self, fake_server, capsys):
        url, _ = fake_server
        argv = load(url, "--model", "ok", "--users", "a:1", "--limits", "a:1")
        argv += ["--max-tokens", "20"]
        assert cli.main(argv) == 0
        assert "bound exceeded for: a" in capsys.readouterr().err
        assert cli.main([*argv, "--fail-on-bound"]) == 1

    def test_each_user_sends_its_api_key_and_no_file_keeps_it(
        self, fake_server, tmp_path, capsys
    ):
        url, seen = fake_server
        keys = tmp_path / "keys.yaml"
        keys.write_text("a: sk-of-a\nb: sk-of-b\n")
        out_json = tmp_path / "o.json"
        argv = load(url, "--model", "ok", "--users", "a:1,b:2", "--max-tokens", "3")
        earlier = len(seen)
        assert cli.main([*argv, "--api-keys", str(keys), "--json", str(out_json)]) == 0
        sent = {
            (r["vllm_xargs"]["output_rate_user"], r["authorization"])
            for r in seen[earlier:]
        }
        assert sent == {("a", "Bearer sk-of-a"), ("b", "Bearer sk-of-b")}
        assert "sk-of" not in out_json.read_text()
        assert "sk-of" not in "".join(capsys.readouterr())

    @pytest.mark.parametrize(
        ("content", "users", "message"),
        [
            ("a: sk-a\n", "a:1,b:1", "no key for: b"),
            ("a: sk-a\n", "a:1,-:1", "no key for: -"),
            ("a: sk-a\nc: sk-c\n", "a:1", "not in --users: c"),
        ],
    )
    def test_api_keys_that_do_not_match_the_users_exit_2(
        self, tmp_path, capsys, content, users, message
    ):
        keys = tmp_path / "keys.yaml"
        keys.write_text(content)
        argv = ["load", "--users", users, "--api-keys", str(keys)]
        assert cli.main(argv) == 2
        assert message in capsys.readouterr().err

    @pytest.mark.parametrize("content", ["[a, b]", "a: 3\n", "a: [\n", "a: ''\n"])
    def test_a_malformed_api_keys_file_exits_2(self, tmp_path, capsys, content):
        keys = tmp_path / "keys.yaml"
        keys.write_text(content)
        with pytest.raises(SystemExit) as exc:
            cli.main(["load", "--users", "a:1", "--api-keys", str(keys)])
        assert exc.value.code == 2
        assert "--api-keys" in capsys.readouterr().err

    def test_client_and_server_counts_differ_exit_1(self, fake_server, capsys):
        url, _ = fake_server
        argv = load(url, "--model", "miscount", "--users", "a:1", "--max-tokens", "3")
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "client token counts differ from the server's usage for: a" in err

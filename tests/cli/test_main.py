"""The command as a whole: subcommands, the module entry point, hash-key,
exit codes."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys

import pytest

from vllm_output_rate import cli


def test_subcommands_listed_in_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("load", "bench", "demo", "hash-key"):
        assert name in out


def test_a_subcommand_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
    assert "required: COMMAND" in capsys.readouterr().err


def test_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_output_rate.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--users" in proc.stdout and "usage: vllm-output-rate load" in proc.stdout


class TestHashKey:
    def test_argument_and_stdin(self, capsys, monkeypatch):
        expected = "sha256:" + hashlib.sha256(b"s3cret").hexdigest()
        assert cli.main(["hash-key", "s3cret"]) == 0
        assert capsys.readouterr().out.strip() == expected
        monkeypatch.setattr(sys, "stdin", io.StringIO("s3cret\n"))
        assert cli.main(["hash-key"]) == 0
        assert capsys.readouterr().out.strip() == expected

    def test_empty_key_exits_2(self, capsys, monkeypatch):
        monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
        assert cli.main(["hash-key"]) == 2
        assert "empty API key" in capsys.readouterr().err


def test_interrupt_exits_130(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.hash_key, "run", interrupted)
    assert cli.main(["hash-key", "k"]) == 130
    assert "interrupted" in capsys.readouterr().err

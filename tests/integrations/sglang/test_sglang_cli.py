"""``kvbridge sglang``: help without SGLang, a clear error without it, SGLang's
own options (with the kvbridge choice) with it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from kvbridge.cli import main as cli_main
from kvbridge.cli import sglang as cli_sglang
from kvbridge.errors import ConfigError


def test_help_works_without_importing_sglang():
    code = ("import sys; from kvbridge.cli.main import main\n"
            "try:\n    main(['sglang', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print('sglang' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "kvbridge sglang -- --model-path" in out.stdout and "pip install 'sglang==0.5.23'" in out.stdout
    assert "KVBRIDGE_BOOTSTRAP_URL" in out.stdout and "KVBRIDGE_INSTANCE" in out.stdout  # the environment table
    assert out.stdout.rstrip().endswith("False")  # SGLang was not imported


def test_without_sglang_the_error_says_how_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    assert cli_main.main(["sglang", "--", "--model-path", "m"]) == 2
    err = capsys.readouterr().err
    assert "kvbridge sglang: error: SGLang is not installed" in err and "make setup-sglang" in err
    with pytest.raises(ConfigError, match="pip install 'sglang==0.5.23'"):
        cli_sglang.run(cli_main.build_parser().parse_args(["sglang", "--", "--help"]))


def test_sglang_help_lists_the_kvbridge_backend():
    pytest.importorskip("sglang.srt.server_args", reason="needs SGLang: make test-sglang")
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli.main", "sglang", "--", "--help"],
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--disaggregation-transfer-backend {mooncake,nixl,ascend,fake,mori,mooncake_tcp,kvbridge}" in out.stdout

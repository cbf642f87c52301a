"""The vLLM connector suite runs in the vLLM venv (.venv-vllm); elsewhere it is skipped
as a whole (the main suite's Makefile target leaves this folder out)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="module")
def daemon():
    from kvbridge import start_bootstrap

    with start_bootstrap(lease_ttl=5.0) as (url, token):
        yield url, token

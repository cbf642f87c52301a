"""The vLLM suite runs in .venv-vllm (``make test-vllm``; ``make test`` runs it beside the others).

Outside that venv its modules skip (``pytest.importorskip("vllm")``). Under ``make test``
``KVBRIDGE_REQUIRE_VLLM=1`` is set, and then a skip is a failure: a CI run whose vLLM, Mooncake
or model build went missing says so instead of passing with nothing tested. Tests marked ``gpu``
may still skip (CI has no GPU).
"""

from __future__ import annotations

import os

import pytest

REQUIRED = os.environ.get("KVBRIDGE_REQUIRE_VLLM") == "1"


def _refuse_skip(report: pytest.CollectReport | pytest.TestReport, gpu: bool) -> None:
    if REQUIRED and report.skipped and not gpu and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under KVBRIDGE_REQUIRE_VLLM=1 (make test): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    _refuse_skip(outcome.get_result(), gpu=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    _refuse_skip(outcome.get_result(), gpu=item.get_closest_marker("gpu") is not None)

"""The hostile attack that today's code does not defend (``kvbridge chaos --hostile``, issue 20),
asserted defended. Skipped until the fix named in ``pytestmark`` lands; then unskip it: it fails
today, and the JSON of ``kvbridge chaos --hostile --json`` records how. (Aliasing and room
collision are defended now: ``test_hostile.py`` asserts them in the quick run.)"""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.chaos.hostile import HostileSpec, run_hostile
from kvbridge.transfer.engine import mooncake_available

pytestmark = pytest.mark.skip(reason=(
    "issue 20: waits for (read_exposure) reads that need the read token, or leave out session ids and addresses "
    "without it"))


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    if not mooncake_available():
        pytest.skip("needs the Mooncake transfer engine")
    return run_hostile(HostileSpec(attacks=("read_exposure",)))


def attack(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(a for a in report["attacks"] if a["attack"] == name)


def test_reads_expose_no_sessions_or_addresses(report: dict[str, Any]) -> None:
    """An anonymous client reads GET /v1/ranks/{id} and /v1/instances; today both answer 200 with
    session ids and buffer base addresses (reads are open by default)."""
    a = attack(report, "read_exposure")
    assert a["outcome"] == "defended", a

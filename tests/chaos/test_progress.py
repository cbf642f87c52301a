"""The hostile harness judges a legitimate room by its progress (``kvbridge/chaos/progress.py``):
a room still advancing is waited for past any fixed deadline, one that stops advancing is stalled
after its window, and every wait is bounded. Sans-I/O: the signs and answers are played here."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from kvbridge.chaos import progress
from kvbridge.chaos.progress import Progress


LOAD_FACTOR = progress.load_factor


class Played(Progress):
    """Signs that change while ``moving()`` says so; no cluster behind them."""

    def __init__(self, moving: Any) -> None:
        super().__init__(None)
        self.moving, self.n = moving, itertools.count()

    def sign(self) -> tuple:
        return (next(self.n),) if self.moving() else (0,)

    def daemon_busy(self) -> bool:
        return False


@pytest.fixture(autouse=True)
def quick_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "LOOK_S", 0.02)
    monkeypatch.setattr(progress, "load_factor", lambda: 1.0)


def test_a_room_that_keeps_advancing_is_waited_for_past_its_stall_window() -> None:
    steps = [0]

    def step(seconds: float) -> int:  # (a real step polls for its answers this long)
        time.sleep(seconds / 5)
        steps[0] += 1
        return 0

    # answered only after many looks, far more than the 0.1 s window, while its signs keep moving
    waited = Played(lambda: True).wait(lambda: steps[0] >= 40, step, stall_s=0.1, ceiling_s=30.0)
    assert waited.done and waited.stalled_s is None and waited.advances > 0
    assert waited.seconds > waited.window_s  # it went on past the window, since the signs moved


def test_a_room_that_stops_advancing_is_stalled_and_an_answer_restarts_the_clock() -> None:
    answers = iter([1, 0, 0, 1])  # two answers early on, then nothing: no sign moves either
    waited = Played(lambda: False).wait(lambda: False, lambda s: time.sleep(s / 5) or next(answers, 0), stall_s=0.2,
                                        ceiling_s=30.0)
    assert not waited.done and waited.stalled_s is not None and waited.stalled_s > 0.2
    assert waited.advances == 2 and not waited.ceiling
    assert "no progress for" in waited.why()


def test_every_wait_is_bounded_by_its_ceiling() -> None:
    waited = Played(lambda: True).wait(lambda: False, lambda s: time.sleep(s / 5) or 0, stall_s=10.0, ceiling_s=0.3)
    assert not waited.done and waited.ceiling and "ceiling" in waited.why()


def test_the_load_factor_is_at_least_one_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    real = LOAD_FACTOR  # (the fixture replaced the module's)
    for load, want in ((0.0, 1.0), (3.0 * 2, 3.0), (1000.0, progress.MAX_LOAD_FACTOR)):
        monkeypatch.setattr(progress.os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        monkeypatch.setattr(progress.os, "cpu_count", lambda: 2)
        assert real() == want

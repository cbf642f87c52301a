"""``scripts/staged_layout_bench.py``'s chained layout on the CPU: the staged rooms' chain of
dependencies in three processes (two prefill ranks, one decode rank), each step a pipe message and
an event, in host memory here (the host stager, decode's slots shared between the processes). The
GPU run is the measurement (docs/performance.md); this checks that its chain moves every byte to
its page through every slot, under both grant modes, that its check sees a chunk that never
landed, and that a process of it that dies ends the run by name with no process left."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture()
def slb(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the spawned processes import the script by name too
    import staged_layout_bench

    yield staged_layout_bench
    assert not multiprocessing.active_children()  # every process of the chain was joined


@pytest.mark.parametrize("grants", ["ask", "ahead"])
def test_the_chain_lands_every_byte_through_every_slot(slb, grants):
    got = slb.chained(2048, 0, 2, "cpu", gather_slots=2, decode_slots=4, grants=grants, layers=2,
                      slot_bytes=256 << 10, timeout=120)
    assert got[f"chain_{grants}_verified"], got[f"chain_{grants}_error"]
    assert got["chunks"] > 2 * 4  # each decode slot granted, landed and scattered more than once a room
    assert got[f"chain_{grants}_room_ms"] > 0 and got[f"chain_{grants}_hold_ms"] > 0  # figures, not a speed
    assert got["bytes"] > 0


def test_a_chunk_that_was_never_scattered_fails_the_check_by_page(slb):
    got = slb.chained(2048, 0, 1, "cpu", layers=2, slot_bytes=256 << 10, timeout=120, fault="drop")
    assert not got["chain_ask_verified"]
    assert "logical page" in got["chain_ask_error"] and "bytes wrong" in got["chain_ask_error"]


def test_a_process_that_dies_ends_the_run_by_name_and_the_others_are_stopped(slb):
    with pytest.raises(RuntimeError, match=r"chained rooms \(2048 tokens\): prefill cp0 exited 3"):
        slb.chained(2048, 0, 1, "cpu", layers=2, slot_bytes=256 << 10, timeout=60, fault="die")
    # (the fixture checks that no process of the chain is left)


def test_an_unknown_grant_mode_is_refused_by_name(slb):
    with pytest.raises(ValueError, match="grants must be one of"):
        slb.chained(2048, 0, 1, "cpu", grants="eager")

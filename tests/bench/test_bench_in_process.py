"""The bench's rooms with every rank a thread of one process (``RigSpec.in_process``), the layout
``scripts/staged_process_bench.py`` sets beside every rank its own process: the same rank classes
and commands, direct and staged rooms landed and checked. On the CPU the IPC engine moves host
memory within one process (the layout two processes cannot share on the CPU)."""

from __future__ import annotations

import threading
import time

import pytest

from kvbridge.bench.procs import thread_cpu_s
from kvbridge.bench.rig import Rig, RigSpec
from kvbridge.bench.sweep import BenchSpec, load_busy, run_sweep
from kvbridge.errors import ConfigError
from kvbridge.worker.cluster import start_bootstrap


def test_staged_and_direct_rooms_with_every_rank_a_thread():
    before = threading.active_count()
    spec = BenchSpec(tokens=[1024], cps=[2], layers=2, engine="ipc", reps=1, verify=True, verify_every=True,
                     allocs=["random"], raw_mooncake=False, staged=True, staging_slot_bytes=256 << 10,
                     staging_slots=(2, 4), in_process=True)
    with start_bootstrap(extra_args=("--lease-ttl", "30"), with_token=False) as (url, _):
        (row,) = run_sweep(spec, url, None, show_progress=False)
    assert not row["kvbridge_failures"] and not row["verify_errors"], row
    assert row["rooms_verified"] == 4 and row["bytes_verified"] > 0  # warm-up + 1 per method, every room checked
    assert row["kvbridge_gbps"] > 0 and row["staged_gbps"] > 0 and row["engine_gbps"] > 0
    assert row["staged_slices"] > 2  # more than one staged chunk: the slot cycle ran
    names = {t.name for t in threading.enumerate()}
    assert not {"bench-prefill", "bench-decode"} & names and threading.active_count() <= before + 2


def test_rooms_in_an_engines_order_decode_asking_first():
    """``ask_first``: decode's request (and the room's ticket, at CP 2) is in before the prefill
    ranks' send(), which then post from their own thread; every room lands and is checked."""
    spec = BenchSpec(tokens=[1024], cps=[2], layers=2, engine="ipc", reps=2, verify=True, verify_every=True,
                     allocs=["contiguous"], raw_mooncake=False, staged=False, in_process=True, ask_first=True)
    with start_bootstrap(extra_args=("--lease-ttl", "30"), with_token=False) as (url, _):
        (row,) = run_sweep(spec, url, None, show_progress=False)
    assert not row["kvbridge_failures"] and not row["verify_errors"], row
    assert row["ask_first"] and row["rooms_verified"] == 3 and row["kvbridge_p50_ms"] > 0


def test_rooms_sent_early_are_timed_from_the_end_of_the_forwards_tail():
    """``send_early_ms``: every prefill rank calls send() as the forward's last ``send_early_ms``
    start (a timer on the CPU, a sleep kernel on a GPU), with that work's event as ``ready_event``,
    and a room's time runs from the work's end. Nothing may be read before the event: a write that
    ignored it would land within a few ms, long before the 300 ms tail ends, and the room's time
    from the tail's end would be negative."""
    spec = BenchSpec(tokens=[1024], cps=[2], layers=2, engine="ipc", reps=2, verify=True, verify_every=True,
                     allocs=["contiguous"], raw_mooncake=False, staged=False, in_process=True, ask_first=True,
                     send_early_ms=300.0)
    with start_bootstrap(extra_args=("--lease-ttl", "30"), with_token=False) as (url, _):
        (row,) = run_sweep(spec, url, None, show_progress=False)
    assert not row["kvbridge_failures"] and not row["verify_errors"], row
    assert row["send_early_ms"] == 300.0 and row["rooms_verified"] == 3
    assert row["kvbridge_p50_ms"] > 0 and row["send_p50_ms"] > 0
    assert abs(row["forward_p50_ms"] - 300.0) < 1.0  # the tail each room's time was counted from


def test_rooms_in_flight_land_at_once_each_on_its_own_pages_and_aux_row():
    """``rooms_in_flight``: beside the rooms one at a time, three rooms at once, direct and staged.
    Decode asks for all three (each on its own block of decode pages, its own aux row), both prefill
    ranks send all three from one instant; every room of every turn lands, carries its own aux row
    (``run_kvbridge_load`` checks the room id the row echoes) and is byte-checked on its pages."""
    spec = BenchSpec(tokens=[1024], cps=[2], layers=2, engine="ipc", reps=1, verify=True, verify_every=True,
                     allocs=["random"], raw_mooncake=False, staged=True, staging_slot_bytes=256 << 10,
                     staging_slots=(2, 4), in_process=True, rooms_in_flight=3)
    with start_bootstrap(extra_args=("--lease-ttl", "30"), with_token=False) as (url, _):
        (row,) = run_sweep(spec, url, None, show_progress=False)
    assert not row["kvbridge_failures"] and not row["verify_errors"], row
    # one at a time: warm-up + 1 per method (2 each); at once: (warm-up + 1) x 3 rooms per method
    assert row["rooms_in_flight"] == 3 and row["rooms_verified"] == 2 * 2 + 2 * 2 * 3
    assert row["bytes_verified"] == row["bytes"]  # each room: every byte checked
    for m in ("kvbridge", "staged"):
        assert row[f"{m}_load_gbps"] > 0 and row[f"{m}_load_room_p50_ms"] > 0
        # ranks that share a process: their own threads only, no process total
        busy = row[f"{m}_load_busy"]
        assert set(busy) == {"decode", "prefill cp0", "prefill cp1"}, busy
        for rank, threads in busy.items():
            assert {"loop", "commands", "pump"} <= set(threads) and "process" not in threads, (rank, threads)
        assert busy["decode"]["loop"] > 0 and busy["prefill cp0"]["commands"] > 0


def test_thread_cpu_is_the_threads_own_and_none_once_it_ended():
    """``procs.thread_cpu_s``: a thread that spins shows its CPU time, one that sleeps next to it
    shows almost none, and a finished thread is not asked about (None)."""
    go, stop = threading.Event(), threading.Event()

    def spin() -> None:
        go.set()
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        stop.wait(30)

    spinner = threading.Thread(target=spin)
    sleeper = threading.Thread(target=lambda: stop.wait(30))
    spinner.start(), sleeper.start()
    try:
        go.wait(30)
        deadline = time.monotonic() + 30
        while (thread_cpu_s(spinner) or 0.0) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread_cpu_s(spinner) >= 0.2
        assert thread_cpu_s(sleeper) < 0.05
    finally:
        stop.set()
        spinner.join(30), sleeper.join(30)
    assert thread_cpu_s(spinner) is None and thread_cpu_s(None) is None


def test_load_busy_names_the_busiest_named_thread_over_the_loads_time():
    cpu = {"decode": {"loop": 0.9, "commands": 0.1, "process": 1.8, "other": 0.8},
           "prefill cp0": {"loop": 0.6, "commands": 0.3, "pump": 0.95}}
    busy, busiest = load_busy(cpu, 1.0)
    assert busiest == "decode loop 0.90"  # the pump (it may spin while it waits), process and other: never the busiest
    assert busy["decode"] == {"commands": 0.1, "loop": 0.9, "other": 0.8, "process": 1.8}
    assert load_busy(cpu, 0.0) == (None, None) and load_busy({}, 1.0) == (None, None)
    assert load_busy({"decode": {"process": 1.0, "pump": 0.5}}, 2.0) == ({"decode": {"process": 0.5, "pump": 0.25}},
                                                                         None)


def test_rooms_in_flight_are_bounded_by_the_pages_the_rig_holds():
    with pytest.raises(ConfigError, match="rooms_in_flight must be at least 1"):
        Rig(RigSpec(cp=1, max_tokens=1024, bootstrap="http://127.0.0.1:9", rooms_in_flight=0))
    spec = BenchSpec(tokens=[1024], cps=[1], layers=1, engine="ipc", reps=1, allocs=["contiguous"],
                     raw_mooncake=False, staged=False, in_process=True)
    with start_bootstrap(extra_args=("--lease-ttl", "30"), with_token=False) as (url, _):
        rig = Rig(RigSpec(cp=1, max_tokens=1024, bootstrap=url, layers=1, engine="ipc", raw_mooncake=False,
                          in_process=True, rooms_in_flight=2))
        try:
            pages = rig.allocation("contiguous", 1024)
            assert set(rig.room_pages(pages, 1).page_ids).isdisjoint(rig.room_pages(pages, 0).page_ids)
            with pytest.raises(ConfigError, match="3 rooms at once: the rig holds pages for 2"):
                rig.run_kvbridge_load([1, 2, 3], pages, 1024)
        finally:
            rig.close()
    assert spec.rooms_in_flight == 1  # the default: rooms one at a time only


def test_a_forwards_tail_needs_decode_asking_first():
    with pytest.raises(ConfigError, match="send_early_ms .* needs ask_first"):
        Rig(RigSpec(cp=1, max_tokens=1024, bootstrap="http://127.0.0.1:9", send_early_ms=5.0))
    with pytest.raises(ConfigError, match="non-negative"):
        Rig(RigSpec(cp=1, max_tokens=1024, bootstrap="http://127.0.0.1:9", ask_first=True, send_early_ms=-1.0))

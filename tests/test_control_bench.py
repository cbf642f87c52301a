"""scripts/control_bench.py (the README's figure for the control path in one process) runs
and reports rooms that reached Success; scripts/control_rtt.py (the README's figures for one
control hop, kvbridge's channel and ZMQ) runs against its echo processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_control_bench_runs_rooms_to_success():
    done = subprocess.run([sys.executable, str(SCRIPTS / "control_bench.py"), "--cp", "2", "--pages", "3", "--rooms",
                           "5", "--gap-ms", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cp 2, 3 pages" in done.stdout and "1 ms idle before each" in done.stdout
    assert "receiver() -> Success p50" in done.stdout


def test_control_bench_in_the_engines_order_decode_asking_first():
    """--ask-first: decode asks before the prefill ranks send (what an engine's decode rank does
    while prefill computes); the clock runs from their send() to decode's Success; --layers 61
    gives the GPU benches' slice count."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "control_bench.py"), "--cp", "2", "--pages", "3", "--rooms",
                           "5", "--ask-first", "--layers", "61"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cp 2, 3 pages x 61+1 layers" in done.stdout
    assert "decode asked first, send() -> Success p50" in done.stdout


@pytest.mark.parametrize("written", [False, True], ids=["inline", "written"])
def test_control_bench_times_a_layer_wise_rooms_last_send_with_the_aux_row_inline_or_written(written):
    """--aux-last: the pages land before the clock, which runs from the last sends (the aux row
    alone on its owner) to decode's Success; --aux-written: decode takes the row as a write."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "control_bench.py"), "--cp", "2", "--pages", "3", "--rooms",
                           "5", "--aux-last", *(["--aux-written"] if written else [])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pages landed, the last send() (the aux row alone) -> Success" in done.stdout
    assert "-> Success p50" in done.stdout and f"aux row {'written' if written else 'in the report'}" in done.stdout


def test_control_rtt_reports_both_round_trips_of_both_channels():
    """ZMQ is an optional comparison (kvbridge does not depend on pyzmq): without it the script
    says it skipped it."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "control_rtt.py"), "--rounds", "100", "--idle-ms", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    try:
        import zmq  # noqa: F401
    except ImportError:
        assert len(lines) == 3 and lines[2].startswith("ZMQ round trip: skipped (pyzmq is not installed")
        pairs = [("kvbridge channel", lines[0], lines[1])]
    else:
        assert len(lines) == 4
        pairs = [("kvbridge channel", lines[0], lines[1]), ("ZMQ", lines[2], lines[3])]
    for name, hot, idle in pairs:
        assert hot.startswith(name) and idle.startswith(name)
        assert "back to back: p50" in hot and "after 1 ms idle: p50" in idle
        assert "(100 round trips)" in hot and "(50 round trips)" in idle


def test_wake_probe_reports_each_idle_and_spin_pair():
    """scripts/wake_probe.py (round 14's wake-up cost of a device host): one line per (idle, spin)."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "wake_probe.py"), "--rounds", "20", "--idle-ms", "0", "1",
                           "--spin-us", "0", "100"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["idle 0 ms, spin 0 us", "idle 0 ms, spin 100 us",
                                                  "idle 1 ms, spin 0 us", "idle 1 ms, spin 100 us"]
    assert all("round trip p50" in ln and "(20 trips)" in ln for ln in lines)


def test_layerwise_gpu_bench_on_the_cpu_traces_the_tail_hop_by_hop_in_both_orders(tmp_path):
    """scripts/layerwise_gpu_bench.py --cpu-smoke (its CPU check; the GPU run is on a device host)
    with --trace-dir and both orders: every room verified, the send timings per order and mode (in
    the launch order the last send returned before the forward's end, in the readback order after
    it), and the tail's hop table from the ranks' trace lines, one complete room per order and
    mode, whose hops add up to its tail."""
    trace = tmp_path / "trace"
    done = subprocess.run([sys.executable, str(SCRIPTS / "layerwise_gpu_bench.py"), "--cpu-smoke", "--tokens", "1024",
                           "--cp", "1", "--rooms", "2", "--orders", "readback", "launch", "--trace-dir", str(trace),
                           "--json", str(tmp_path / "rows.json")],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "| readback | 1024 | 1 |" in out and "| launch | 1024 | 1 |" in out and out.count("| all |") == 2
    assert "fwd end -> finish() returned (ms)" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert sorted({(r["order"], r["mode"]) for r in rows}) == [("launch", "layerwise"), ("launch", "whole"),
                                                             ("readback", "layerwise"), ("readback", "whole")]
    assert len(rows) == 8 and sum(r["warmup"] for r in rows) == 4 and all(r["ok"] for r in rows)
    for r in rows:  # the launch order sends before the first token is read back; the readback order after
        assert (r["last_send_s"] < 0) == (r["order"] == "launch"), r
    for order in ("readback", "launch"):
        hops = [ln for ln in out.splitlines() if ln.startswith(f"| {order} | 1024 | 1 | layerwise |") or
                ln.startswith(f"| {order} | 1024 | 1 | whole |")]
        assert len(hops) == 4  # the send timings' rows and the hop table's
        table = [ln for ln in hops if ln.count("|") == 12]
        assert len(table) == 2
        for row in table:
            cells = [c.strip() for c in row.strip("|").split("|")]
            hops_ms, tail_ms = [float(c) for c in cells[4:-2]], float(cells[-2])
            assert cells[-1] == "1" and len(hops_ms) == 5
            assert abs(sum(hops_ms) - tail_ms) <= 0.03  # one room: the hops add up to its tail (rounding aside)
    assert len(list(trace.glob("decode-*.log"))) == 1 and len(list(trace.glob("prefill-*.log"))) == 1


def test_trace_ranks_reads_a_room_rank_by_rank(tmp_path):
    """scripts/trace_ranks.py: each event of a traced room at its first time, in ms after decode's
    request, p50 over the rooms after the warm-up ones; a folder of logs (one per rank) reads as one."""
    p, d = "rank=bench-prefill-x/dp0/cp{}/tp0/pp0", "rank=bench-decode-x/dp0/tp0"

    def room(n: int, t0: float, ticket_ms: float) -> list[str]:
        at = lambda ms: f"@{t0 + ms / 1e3:.6f}"  # noqa: E731
        return [f"trace room={n} {d} +0.1ms {at(0)} requested from (cp, tp, pp) ranks [(0, 0, 0), (1, 0, 0)]",
                f"trace room={n} {p.format(0)} {at(0.4)} request from dec pages=128",
                f"trace room={n} {p.format(0)} +1ms {at(0.4)} target dec pages=128 first_page=0 pools=target",
                f"trace room={n} {p.format(1)} {at(0.5)} request from dec pages=128",
                f"trace room={n} {p.format(1)} {at(ticket_ms)} decided for dec by p-cp0",
                f"trace room={n} {p.format(1)} +1ms {at(ticket_ms)} target dec pages=128 first_page=0 pools=target",
                f"trace room={n} {p.format(0)} +1ms {at(1.2)} -> dec pages=64[0..126] slices=123 bytes=1",
                f"trace room={n} {p.format(1)} +1ms {at(ticket_ms + 0.8)} -> dec pages=64[1..127] slices=123 bytes=1",
                f"trace room={n} {p.format(0)} +1ms {at(2.5)} write of 64 pages to dec done",
                f"trace room={n} {p.format(1)} +1ms {at(3.4)} write of 64 pages +aux to dec done",
                f"trace room={n} {d} +3ms {at(2.9)} report from cp0 pages=64",
                f"trace room={n} {d} +3ms {at(3.7)} report from cp1 pages=64 +aux",
                f"trace room={n} {d} +4ms {at(4.0)} committed pages_by_rank={{0: 64, 1: 64}} aux_owner=cp1",
                f"trace room={n} bench final Success {at(4.2)}"]

    logs = tmp_path / "logs"
    logs.mkdir()
    lines = room(1, 10.0, 9.0) + room(2, 20.0, 1.2) + room(3, 30.0, 1.4) + room(4, 40.0, 1.0)
    (logs / "decode.log").write_text("\n".join(ln for ln in lines if "decode" in ln or "bench final" in ln) + "\n")
    (logs / "prefill.log").write_text("\n".join(ln for ln in lines if "prefill" in ln) + "\n")
    done = subprocess.run([sys.executable, str(SCRIPTS / "trace_ranks.py"), str(logs), "--skip", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {ln.split("|")[1].strip(): ln.split("|")[2].strip() for ln in done.stdout.splitlines()[2:]}
    assert "(3 rooms)" in done.stdout  # the first room (a warm-up) left out
    assert rows["cp1: decision"] == "1.20" and rows["cp1: write posted"] == "2.00"  # p50 of 1.2, 1.4, 1.0 (+0.8)
    assert rows["cp0: request"] == "0.40" and rows["decode: committed"] == "4.00"
    assert rows["decode: cp1's report"] == "3.70" and rows["bench: Success seen"] == "4.20"
    order = [ln.split("|")[1].strip() for ln in done.stdout.splitlines()[2:]]
    assert order.index("cp1: decision") < order.index("cp1: write posted") < order.index("decode: committed")


def test_idle_probe_reports_each_gaps_hand_offs_and_work_and_holds_the_latency_request_around_a_command():
    """scripts/device/idle_probe.py (issue 33, round 19; no GPU): one row per idle time with the
    thread and process hand-offs and send()'s slice of work; --hold runs a command and passes its
    exit status through, saying whether the CPU latency request was held."""
    probe = SCRIPTS / "device" / "idle_probe.py"
    done = subprocess.run([sys.executable, str(probe), "--rounds", "3", "--gaps", "0", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith("as is")]
    assert [r.split("|")[0].split()[-2] for r in rows] == ["0", "1"]
    for row in rows:
        assert "thread first" in row and "process first" in row and row.rstrip().endswith("ms")
    held = subprocess.run([sys.executable, str(probe), "--hold", "--", sys.executable, "-c", "raise SystemExit(3)"],
                          capture_output=True, text=True, timeout=60)
    assert held.returncode == 3, held.stderr[-2000:]
    assert "cpu_dma_latency 0 held while" in held.stdout or "NOT held while" in held.stdout


def test_control_bench_sends_early_and_times_rooms_from_the_kv_whole():
    """--send-early: every rank calls send() while a timer (the forward's tail) still runs, with it
    as ready_event; the clock runs from the tail's end; without --ask-first it is refused."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "control_bench.py"), "--cp", "2", "--pages", "3", "--rooms",
                           "5", "--ask-first", "--send-early", "20"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "send() 20 ms before the KV is whole, KV whole -> Success p50" in done.stdout
    # a write that ignored the event would land before the timer ends: a negative time from the KV whole
    assert float(done.stdout.split("KV whole -> Success p50 ")[1].split()[0]) > 0
    refused = subprocess.run([sys.executable, str(SCRIPTS / "control_bench.py"), "--send-early", "5"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--send-early needs --ask-first" in refused.stderr

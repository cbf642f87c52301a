"""The work on a control_bench room's critical path, segment by segment, as counts that do not
depend on the machine's load: Python function calls and C calls (``sys.setprofile`` on every
thread) from where a segment opens to where it closes, on one thread, median per room.

    .venv/bin/python scripts/control_calls.py -- --pages 2 [--cp 2] [--rooms 150]
    DETAIL=40 ...      the 40 most frequent calls of each segment
    CPUTIME=1 ...      no profiler: each segment's thread CPU time (``time.thread_time``) instead

Segments: decode's receiver() + init() up to the request handed to the channel; prefill's
loop from the channel's wait to submit_write; the engine's thread from the copy to the report
handed to the channel; decode's loop from the channel's wait to the commit. numpy's ufunc
calls are not profiler events: they do not show in the counts (CPUTIME does show them)."""
import time, sys, threading, statistics, collections, os
from _probes import run_control_bench, wrap
local = threading.local()
seg_counts = collections.defaultdict(list)   # seg -> list of (py, c) per occurrence
detail = collections.defaultdict(collections.Counter)
active = [False]
cpu_us = collections.defaultdict(list)
def prof(frame, event, arg):
    s = getattr(local, "seg", None)
    if s is None: return
    if event == "call":
        local.py += 1
        if os.environ.get("DETAIL"): detail[s][frame.f_code.co_filename.split("/")[-1] + ":" + frame.f_code.co_name] += 1
    elif event == "c_call":
        local.c += 1
        if os.environ.get("DETAIL"): detail[s]["C:" + getattr(arg, "__qualname__", str(arg))] += 1
def open_seg(name):
    if not active[0]: return
    local.seg, local.py, local.c = name, 0, 0
    local.t0 = time.thread_time()
def close_seg(name=None):
    s = getattr(local, "seg", None)
    if s is None or (name and s != name): return
    cpu_us[s].append((time.thread_time() - local.t0) * 1e6)
    seg_counts[s].append((local.py, local.c)); local.seg = None
import kvbridge as kvb
n = [0]
orig_recv = kvb.DecodeEndpoint.receiver
def receiver(self, *a, **k):
    n[0] += 1; active[0] = n[0] > 50
    open_seg("1 decode: receiver()+init() -> request sent")
    return orig_recv(self, *a, **k)
kvb.DecodeEndpoint.receiver = receiver
T = "kvbridge.transfer."
req_close = lambda: close_seg("1 decode: receiver()+init() -> request sent")
ok = [
 wrap(T+"channel.clients", "Clients", "send_frame", req_close) or wrap(T+"channel_client", "PeerSet", "send_frame", req_close),
 wrap(T+"channel.server", "Server", "recv_ready", lambda: open_seg("2 prefill: socket read + decode + checks + plan -> submit"), None) or wrap(T+"channel", "_Channel", "recv_ready", lambda: open_seg("2 prefill: socket read + decode + checks + plan -> submit") if threading.current_thread().name.startswith("kvb-prefill") else open_seg("5 decode: socket read + decode + ledger + commit"), None),
 wrap(T+"engine.local", "LocalEngine", "submit_write", lambda: close_seg("2 prefill: socket read + decode + checks + plan -> submit")),
 wrap(T+"engine.local", "LocalEngine", "_land", None, lambda: open_seg("4 engine: landed -> report sent")),
 wrap(T+"channel.server", "Server", "send_frame", lambda: close_seg("4 engine: landed -> report sent")) or wrap(T+"channel_server", "ControlServer", "send_frame", lambda: close_seg("4 engine: landed -> report sent")),
 wrap(T+"channel.clients", "Clients", "recv_ready", lambda: open_seg("5 decode: socket read + decode + ledger + commit")) or True,
 wrap(T+"decode.machine", "DecodeRooms", "_maybe_commit", None, lambda: close_seg("5 decode: socket read + decode + ledger + commit")) or wrap(T+"decode.room", "DecodeRooms", "_maybe_commit", None, lambda: close_seg("5 decode: socket read + decode + ledger + commit")) or wrap(T+"decode_rooms", "RoomBook", "_maybe_commit", None, lambda: close_seg("5 decode: socket read + decode + ledger + commit")),
]
assert all(ok), ok
CPU = os.environ.get('CPUTIME')
if not CPU: threading.setprofile(prof); sys.setprofile(prof)
run_control_bench()
sys.setprofile(None); threading.setprofile(None)
tot = 0
for s in sorted(seg_counts):
    py = statistics.median(p for p, c in seg_counts[s]); c = statistics.median(c for p, c in seg_counts[s])
    cu = statistics.median(cpu_us[s])
    print("%-60s py %5.0f  C %5.0f  cpu %6.1f us (n=%d)" % (s, py, c, cu, len(seg_counts[s]))); tot += (cu if CPU else py + c)
    if os.environ.get("DETAIL"):
        k = len(seg_counts[s])
        print("    " + ", ".join("%s %.1f" % (f, v / k) for f, v in detail[s].most_common(int(os.environ["DETAIL"]))))
print(("critical path thread-CPU us: %.0f" if CPU else "critical path calls (py + C): %.0f") % tot)

"""Where a control_bench room's time goes, hop by hop: probes (``perf_counter`` at the entry or
exit of the functions each hop starts and ends with) on the same rooms as
``scripts/control_bench.py``, p50 of each hop over the timed rooms (the first 50 are warm-up).

    .venv/bin/python scripts/control_hops.py -- --pages 2 [--cp 2] [--rooms 300]

Everything after ``--`` goes to control_bench. With CP > 1 a prefill event is its last
occurrence in the room (the last rank decides). The probes name modules of this tree and,
failing that, of older trees (so one script measures commits across the rooms merge); on a
machine shared with other work read the hops beside each other, not one figure alone."""
import time, statistics, collections
from _probes import run_control_bench, wrap, wrap_message
rooms = []  # list of dict event -> [times]
cur = [None]
def mark(ev):
    if cur[0] is not None:
        cur[0][ev].append(time.perf_counter())
def at(ev):
    return lambda: mark(ev)
import kvbridge as kvb
orig_recv = kvb.DecodeEndpoint.receiver
def receiver(self, *a, **k):
    cur[0] = collections.defaultdict(list); rooms.append(cur[0]); mark("recv")
    return orig_recv(self, *a, **k)
kvb.DecodeEndpoint.receiver = receiver
T = "kvbridge.transfer."
ok = [
 wrap(T+"channel.clients", "Clients", "send_frame", at("req_sent")) or wrap(T+"channel_client", "PeerSet", "send_frame", at("req_sent")),
 wrap_message(T+"prefill.machine", at("p_msg")) or wrap(T+"prefill.machine", "PrefillRooms", "message", at("p_msg")) or wrap(T+"prefill", "PrefillEndpoint", "_on_message", at("p_msg")),
 wrap(T+"engine.local", "LocalEngine", "submit_write", at("submit"), at("submitted")),
 wrap(T+"engine.local", "LocalEngine", "_land", None, at("landed")),
 wrap(T+"channel.server", "Server", "send_frame", at("report_sent")) or wrap(T+"channel_server", "ControlServer", "send_frame", at("report_sent")),
 wrap_message(T+"decode.machine", at("d_msg"), at("d_msg_end")) or wrap(T+"decode.machine", "DecodeRooms", "message", at("d_msg"), at("d_msg_end")) or wrap(T+"decode_rooms", "RoomBook", "on_message", at("d_msg"), at("d_msg_end")),
 wrap(T+"rooms", "RoomHandle", "wait", None, at("done"), only="KVReceiver") or wrap(T+"lifecycle", "RoomHandle", "wait", None, at("done"), only="KVReceiver"),
]
assert all(ok), ok
run_control_bench()
order = ["recv", "req_sent", "p_msg", "submit", "submitted", "landed", "report_sent", "d_msg", "d_msg_end", "done"]
names = {"req_sent": "receiver() + init() -> request handed to the channel (decode)", "p_msg": "request trip: send, wake, read, decode -> prefill machine",
 "submit": "parse + checks + plan (prefill loop)", "submitted": "engine submit_write", "landed": "engine worker wakes + copies",
 "report_sent": "copy done -> report handed to the channel (engine thread)", "d_msg": "report trip: send, wake, read, decode -> decode machine",
 "d_msg_end": "report handled: ledger + commit (decode loop)", "done": "waiter wakes (main)"}
hops = collections.defaultdict(list); totals = []
for r in rooms[50:]:
    if not all(r.get(e) for e in order): continue
    # request-side events: the first after recv; prefill/report events: the last occurrence before done
    if any(not [x for x in r[e] if x <= r["done"][0]] for e in order): print("missing", [e for e in order if not [x for x in r[e] if x <= r["done"][0]]]); continue
    t = {e: (min if e in ("recv", "req_sent") else max)(x for x in r[e] if x <= r["done"][0]) for e in order}
    for a, b in zip(order, order[1:]):
        hops[b].append((t[b] - t[a]) * 1e3)
    totals.append((t["done"] - t["recv"]) * 1e3)
print("rooms", len(totals))
for e in order[1:]:
    print("| %-48s | %.3f |" % (names[e], statistics.median(hops[e])))
print("| %-48s | %.3f |" % ("total (p50 of the room's own total)", statistics.median(totals)))
print("| %-48s | %.3f |" % ("sum of hop p50s", sum(statistics.median(hops[e]) for e in order[1:])))

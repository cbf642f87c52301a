"""How often a control_bench room wakes a thread, counts that do not depend on the machine's load
as the wall clock does: the writes into a loop's wake pipe (``Wakeup.post``), the loop turns that
returned messages and the empty ones (woken for nothing to read), and each thread's voluntary
context switches (``/proc``, Linux: GIL and lock waits, epoll sleeps), per timed room (the first
50 rooms are warm-up).

    .venv/bin/python scripts/control_wakes.py -- --pages 2 [--cp 2] [--rooms 200]

Everything after ``--`` goes to control_bench. Threads are counted by name, the CP ranks' and
engines' together. The context switches include the GIL's hand-offs, which a loaded machine
makes more of: compare trees in the same call, beside each other."""
import collections
import os
import threading

from _probes import run_control_bench

import kvbridge as kvb
import kvbridge.transfer.channel.transport as transport


def who(thread: threading.Thread | None = None) -> str:
    name = (thread or threading.current_thread()).name
    return name if name == "MainThread" else "-".join(name.split("-")[:2])


def switches() -> dict[str, int]:
    """Voluntary context switches of this process's threads, by thread name."""
    out: collections.Counter = collections.Counter()
    names = {t.native_id: who(t) for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                n = int(f.read().split("voluntary_ctxt_switches:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue
        out[names.get(int(tid), "other")] += n
    return out


posts: collections.Counter = collections.Counter()
turns: collections.Counter = collections.Counter()
rooms, on, start = [0], [False], {}
orig_receiver = kvb.DecodeEndpoint.receiver


def receiver(self, *a, **k):
    rooms[0] += 1
    if rooms[0] == 51:
        on[0] = True
        start.update(switches())
    return orig_receiver(self, *a, **k)


orig_post, orig_recv = transport.Wakeup.post, transport.Channel.recv_ready


def post(self, item=None):
    if on[0]:
        posts[who()] += 1
    return orig_post(self, item)


def recv_ready(self, timeout_ms):
    out = orig_recv(self, timeout_ms)
    if on[0]:
        turns[(who(), "with messages" if out else "empty")] += 1
    return out


orig_close = kvb.DecodeEndpoint.close
end: dict = {}


def close(self, *a, **k):
    if on[0] and not end:
        on[0] = False
        end.update(switches())
    return orig_close(self, *a, **k)


kvb.DecodeEndpoint.receiver, kvb.DecodeEndpoint.close = receiver, close
transport.Wakeup.post, transport.Channel.recv_ready = post, recv_ready
run_control_bench()
n = max(1, rooms[0] - 50)
print(f"per timed room ({n} rooms):")
for t, c in sorted(posts.items()):
    print(f"| wake-pipe writes from {t:<28} | {c / n:.2f} |")
for (t, kind), c in sorted(turns.items()):
    print(f"| loop turns of {t:<20} {kind:<14} | {c / n:.2f} |")
for t in sorted(end):
    print(f"| voluntary switches of {t:<27} | {(end[t] - start.get(t, 0)) / n:.2f} |")

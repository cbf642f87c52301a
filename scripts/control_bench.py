"""What kvbridge's control path costs on its own: prefill CP ranks and one decode rank as
endpoints in ONE process over the local engine (an in-process memcpy on a worker thread),
against a real bootstrap daemon. No process hand-offs, no network: a room's time from
``receiver()`` to Success is the request, its checks, the plan, the post, the completion
report, the ledger and the commit, in Python, plus the memcpy of its few pages.

    .venv/bin/python scripts/control_bench.py [--cp 1] [--pages 16] [--rooms 300] [--gap-ms 0] [--ask-first] [--layers 4]
        [--aux-last] [--aux-written] [--send-early MS] [--poller US]

The prefill side has sent its pages before the timer starts (as when decode asks last);
decode blocks in ``KVReceiver.wait()``. ``--ask-first``: the engines' order instead, decode asks
(and, at CP > 1, every rank has the room's decision) before the prefill ranks send, and the
clock runs from their ``send()`` calls (one after the other, on this thread) to decode's
Success. Each room's synthetic aux row is made before the clock, as an engine's forward makes
its row before it sends. ``--aux-last``: a layer-wise room's tail (decode asks first, the pages are sent and land
before the clock, which runs from the last sends, the aux row alone on its owner, to Success);
``--aux-written``: decode takes the aux row as a write into its rows instead of in the report
(``DecodeConfig(aux_inline=False)``, what every decode rank did before wire 14). ``--layers``:
target layers (default 4; 61 gives the GPU benches' slices per rank). Compare with ``kvbridge bench --trace``, where the
same steps run in separate processes. ``--gap-ms``: idle time before each timed room (the
benches leave the cluster idle between rooms; on a VM every thread then wakes slower).
``--send-early MS`` (with ``--ask-first``): the ranks call ``send()`` MS ms before their KV is whole,
a timer's event as ``ready_event`` (an engine whose forward still runs, as vLLM's ``wait_for_save``),
and the clock runs from the KV whole to Success. ``--poller US``: a thread polls a room that never
moves every US us during the timed rooms and times each ``poll()`` (an engine's scheduler's polls).

Besides the p50 it prints the process's CPU time per timed room, every thread's together
(``time.process_time``; ``--gap-ms`` sleeps cost none): the work a room costs, which a loaded
machine moves far less than the wall-clock p50 (every endpoint here shares one GIL, so the
p50 is about that work plus the threads' wake-ups).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import numpy as np
import torch

import kvbridge as kvb
from kvbridge.bench.procs import TimerForward
from kvbridge.layout import OwnerLanes
from kvbridge.transfer.engine.local import LocalFabric
from kvbridge.worker.resources import allocate_buffers, aux_schema_of, build_contract, build_specs
from kvbridge.worker.synthetic import fill_pages, make_aux

PRESET, LAYERS, PAGE = "deepseek-v3.2-fp8", 4, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--pages", type=int, default=16, help="pages per room")
    ap.add_argument("--rooms", type=int, default=300, help="timed rooms (after 50 warm-up rooms)")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each timed room")
    ap.add_argument("--ask-first", action="store_true",
                    help="decode asks before prefill sends (an engine's order: decode admits the request while "
                         "prefill computes); the clock runs from the prefill ranks' send() to decode's Success")
    ap.add_argument("--layers", type=int, default=LAYERS,
                    help="target layers (+1 draft): 61 gives the GPU benches' slice count per rank (2 per layer)")
    ap.add_argument("--aux-last", action="store_true",
                    help="a layer-wise room's tail: decode asks first, every rank sends its pages (not the last "
                         "send) and they land; the clock runs from the last sends (the aux row alone on its owner) "
                         "to decode's Success")
    ap.add_argument("--aux-written", action="store_true",
                    help="decode takes the aux row as a write into its aux rows (DecodeConfig(aux_inline=False)) "
                         "instead of in the report that carries it")
    ap.add_argument("--send-early", type=float, default=0.0, metavar="MS",
                    help="with --ask-first: every prefill rank calls send() MS ms before its KV is whole, with a "
                         "timer's event as ready_event (vLLM's wait_for_save: the forward's last layers still run); "
                         "the clock runs from the KV whole to decode's Success")
    ap.add_argument("--poller", type=float, default=0.0, metavar="US",
                    help="during the timed rooms a thread polls a room that never moves (a prefill rank's sender "
                         "no decode rank asks for) every US microseconds, as an engine's scheduler polls its "
                         "requests, and times each poll(): what a poll waits for the loop's turn and the GIL")
    args = ap.parse_args()
    args.ask_first = args.ask_first or args.aux_last
    if args.send_early and (not args.ask_first or args.aux_last):
        ap.error("--send-early needs --ask-first (and not --aux-last)")
    specs = build_specs(PRESET, args.layers, PAGE, 1)
    contract = build_contract(PRESET, args.layers, PAGE, 1, "interleaved")
    schema = aux_schema_of(contract)
    fabric, lanes = LocalFabric(), OwnerLanes(args.cp, "interleaved")
    n = args.pages * PAGE
    with kvb.start_bootstrap(with_token=False) as (url, _):
        prefill = [kvb.PrefillEndpoint(kvb.PrefillConfig(instance="cb-p", cp_rank=r, cp_size=args.cp),
                                       kvb.create_engine("local", fabric=fabric), specs,
                                       allocate_buffers(specs, 2 * args.pages), contract, kvb.BootstrapClient(url),
                                       schema) for r in range(args.cp)]
        aux = torch.zeros((4, schema.row_bytes), dtype=torch.uint8)
        decode = kvb.DecodeEndpoint(kvb.DecodeConfig(instance="cb-d", aux_inline=not args.aux_written),
                                    kvb.create_engine("local", fabric=fabric),
                                    specs, allocate_buffers(specs, 2 * args.pages), contract, kvb.BootstrapClient(url),
                                    aux, schema)
        for ep in (*prefill, decode):
            ep.start()
        owned = [lanes.owned_pages(r, args.pages) for r in range(args.cp)]
        for r, ep in enumerate(prefill):
            for (pool, layer), buf in ep.buffers.tensors.items():
                fill_pages(specs[pool], buf, 1, layer, owned[r], owned[r], n)
        last = lanes.owner_of_token(n - 1, PAGE, args.pages)
        dst = np.arange(args.pages) + args.pages

        def send(r: int, s: Any, row: Any, ready: Any = None) -> None:
            if args.aux_last:  # the pages went before the clock: the last send carries the row alone
                s.send(owned[r][:0], owned[r][:0], is_last=True, aux=row if r == last else None)
                return
            s.send(owned[r], owned[r], is_last=True, aux=row if r == last else None, ready_event=ready)

        def pages_landed(senders: list[Any]) -> None:
            """``--aux-last``: every rank's pages sent (not the last send) and landed, before the clock."""
            for r, s in enumerate(senders):
                s.send(owned[r], owned[r], num_tokens_ready=n)
            deadline = time.monotonic() + 10
            while any(ep.machine.writing for ep in prefill) and time.monotonic() < deadline:
                time.sleep(0.0002)

        def ask(i: int) -> Any:
            recv = decode.receiver(i, "cb-p")
            recv.init(dst, 0, n)
            return recv

        def room(i: int) -> float:
            """Decode asks last (the clock from its receiver() to Success) or, ``--ask-first``, first
            (as an engine's decode rank does while prefill still computes: the clock from the
            prefill ranks' send(), the forward's end, to decode's Success)."""
            senders = []
            row = make_aux(schema, i, n)  # the engine's aux row, made by its forward: before the clock
            for r, ep in enumerate(prefill):
                s = ep.sender(i)
                s.init(n)
                if not args.ask_first:
                    send(r, s, row)
                senders.append(s)
            if args.ask_first:
                recv = ask(i)
                deadline = time.monotonic() + 10
                while any(s.poll() == kvb.KVPoll.Bootstrapping for s in senders) and time.monotonic() < deadline:
                    time.sleep(0.0002)  # every rank has decode's request (and, at CP > 1, the room's decision)
                if args.aux_last:
                    pages_landed(senders)
            time.sleep(args.gap_ms / 1e3)
            t0 = time.perf_counter()
            early = args.send_early / 1e3
            ready = TimerForward(time.monotonic() + early) if early else None  # the KV whole at t0 + early
            if args.ask_first:
                for r, s in enumerate(senders):
                    send(r, s, row, ready)
            else:
                recv = ask(i)
            state = recv.wait(10)
            dt = time.perf_counter() - t0 - early
            if state != kvb.KVPoll.Success:
                raise SystemExit(f"room {i}: {state.name}: {recv.failure_reason}")
            for s in senders:
                s.wait(10)
                s.close()
            recv.close()
            return dt

        for i in range(1, 51):
            room(i)
        polls: list[float] = []
        stop = threading.Event()
        if args.poller:
            idle = prefill[0].sender(99)  # no decode rank asks for room 99: it stays Bootstrapping
            idle.init(n)

            def poller() -> None:
                while not stop.wait(args.poller / 1e6):
                    t = time.perf_counter()
                    idle.poll()
                    polls.append(time.perf_counter() - t)

            poll_thread = threading.Thread(target=poller, name="poller", daemon=True)
            poll_thread.start()
        cpu0 = time.process_time()
        times = [room(i) for i in range(100, 100 + args.rooms)]
        cpu_ms = (time.process_time() - cpu0) * 1e3 / args.rooms
        stop.set()
        if args.poller:
            poll_thread.join(5)
            idle.close()
        for ep in (decode, *prefill):
            ep.close()
    ms = sorted(t * 1e3 for t in times)
    clock = "decode asked first, send() -> Success" if args.ask_first else "receiver() -> Success"
    if args.send_early:
        clock = f"decode asked first, send() {args.send_early:g} ms before the KV is whole, KV whole -> Success"
    if args.aux_last:
        clock = "pages landed, the last send() (the aux row alone) -> Success"
    print(f"control path, one process, local engine: cp {args.cp}, {args.pages} pages x {args.layers}+1 layers "
          f"({PRESET}), {args.rooms} rooms, {args.gap_ms:g} ms idle before each: {clock} p50 {statistics.median(ms):.2f} ms, "
          f"p90 {ms[int(0.9 * len(ms))]:.2f} ms; process CPU {cpu_ms:.2f} ms per room (every thread); "
          f"aux row {'written' if args.aux_written else 'in the report'}")
    if polls:
        us = sorted(p * 1e6 for p in polls)
        print(f"poll() of an idle room every {args.poller:g} us during the timed rooms: {len(us)} polls, p50 "
              f"{statistics.median(us):.1f} us, p99 {us[int(0.99 * len(us))]:.1f} us, max {us[-1]:.1f} us; "
              f"{sum(u > 100 for u in us)} over 100 us, {sum(u > 1000 for u in us)} over 1 ms")


if __name__ == "__main__":
    main()

"""A prefill CP rank of a kind-pool model (``_kind_rooms.py``) in its own process, over Mooncake
(test harness for ``test_kind_rooms_mooncake.py``). Prints ``{"ready": true}`` once serving, then
per command (JSON lines on stdin):

    {"op": "send", "room": R, "num_tokens": N, "cuts": [t1, ...], "width": W}   chunked sends of R
        (W: layer ranges of W target layers per chunk, layer-wise; absent: whole chunks); once
        final, prints {"room", "state", "reason", "bytes", "bytes_staged", "chunks", "paths"}
    {"op": "quit"}

``--staging`` / ``--slot-bytes``: its staging setting and slot size. Its pools hold the seeded bytes of ``_kind_rooms.buffers(specs, seed=11)``."""

from __future__ import annotations

import faulthandler
import signal

# first, before the heavy imports: SIGUSR1 writes every thread's stack to stderr (_cluster.ChildProc
# sends it to a start that has not answered in time)
faulthandler.register(signal.SIGUSR1, all_threads=True)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import kvbridge as kvb  # noqa: E402
from _kind_rooms import AUX, buffers, contract, model_specs, send_room, send_room_layers  # noqa: E402
from kvbridge.bootstrap.client import BootstrapClient  # noqa: E402
from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--instance", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--cp-rank", type=int, default=0)
    ap.add_argument("--cp-size", type=int, default=1)
    ap.add_argument("--staging", default="never")
    ap.add_argument("--slot-bytes", type=int, default=0)
    args = ap.parse_args()
    specs = model_specs(args.model)
    client = BootstrapClient(args.bootstrap)
    cfg = PrefillConfig(instance=args.instance, cp_rank=args.cp_rank, cp_size=args.cp_size, staging=args.staging,
                        staging_slot_bytes=args.slot_bytes)
    ep = PrefillEndpoint(cfg, kvb.create_engine("mooncake"), specs, buffers(specs, seed=11), contract(specs), client,
                         AUX)
    ep.start()
    lanes = kvb.OwnerLanes(args.cp_size, "interleaved")
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            room, n = cmd["room"], cmd["num_tokens"]
            with ep.sender(room) as tx:
                width = cmd.get("width")
                if width:
                    top = ep.contract.model.target_layers
                    ranges = [(a, min(a + width, top)) for a in range(0, top, width)]
                    send_room_layers(tx, n, tuple(cmd["cuts"]), lanes, args.cp_rank, room, specs, ranges)
                else:
                    send_room(tx, n, tuple(cmd["cuts"]), lanes, args.cp_rank, room, specs)
                deadline = time.monotonic() + 60
                while tx.poll() not in (kvb.KVPoll.Success, kvb.KVPoll.Failed) and time.monotonic() < deadline:
                    time.sleep(0.01)
                print(json.dumps({"room": room, "state": tx.poll().name, "reason": tx.failure_reason,
                                  "bytes": tx.stats["bytes"], "bytes_staged": tx.stats.get("bytes_staged", 0),
                                  "chunks": tx.stats.get("chunks", 0), "paths": tx.stats.get("paths", {})}),
                      flush=True)
    finally:
        ep.close(timeout=2)
        client.close()


if __name__ == "__main__":
    main()

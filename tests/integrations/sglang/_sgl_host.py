"""A child process hosting SGLang servers (their ranks) for the backend tests.

    python _sgl_host.py '<json config>'

config: {"role": "prefill" | "decode", "servers": [...]} where a prefill server is
{"name", "cp", "tp", "mode": "replicated" | "balanced" | "interleaved", "port",
"cluster": url or "", "heads": KV heads of an MHA/GQA model (0: DeepSeek V3.2)} and a
decode server (one attention TP rank) {"name", "cluster": url or "", "tp": [rank, size],
"heads", "http_port" (names the decode instance: its TP ranks share it)}. It
registers kvbridge's backend (``install()``, as SGLang's plugin loader would),
builds every rank (``_sgl_world.RankWorld``), prints {"ready": true}, then runs the
servers' loops, reading one JSON command per stdin line:

    {"op": "add", "server", "room", ...}   prefill: n, chunk, optimistic, hold_after, bad_pages;
                                           decode: n, prefix, addr
    {"op": "resume" | "abort", "server", "room"}
    {"op": "untouched", "server"}          decode: pages no transfer was given still hold their poison
    {"op": "quit"}

and printing one JSON line per event ({"server", "room", "event": "computed" | "done", ...}).
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore")
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")

from kvbridge.integrations.sglang import install  # noqa: E402

install()

import _sgl_sched as sched  # noqa: E402
import _sgl_world as world  # noqa: E402
from _sgl_world import server_args  # noqa: E402


def prefill_server(cfg: dict) -> sched.PrefillServer:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    env = {"KVBRIDGE_BOOTSTRAP_URL": cfg.get("cluster", "")}
    with world.environ(env):  # what start_disagg_service does on the prefill's TokenizerManager
        server = get_kv_class(TransferBackend.KVBRIDGE, KVClassType.BOOTSTRAP_SERVER)
        cfg["_daemon"] = server(host="127.0.0.1", port=cfg["port"])
    sharding = cfg["mode"] == "interleaved"
    if cfg["mode"] == "balanced":
        env["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] = "1"
    heads = cfg.get("heads", 0)  # > 0: an MHA/GQA model with that many KV heads
    args = server_args("prefill", cfg["port"], sharding, **(world.MHA_ARGS if heads else {}))
    worlds = [world.RankWorld("prefill", args, {"attn_cp_rank": cp, "attn_cp_size": cfg["cp"], "attn_tp_rank": tp,
                                                "attn_tp_size": cfg["tp"], "attn_dp_rank": 0, "attn_dp_size": 1}, env,
                              mha_heads=heads)
              for cp in range(cfg["cp"]) for tp in range(cfg["tp"])]  # fmt: skip
    return sched.PrefillServer(cfg["name"], worlds, cfg["tp"] if sharding else 1, f"127.0.0.1:{cfg['port']}")


def decode_server(cfg: dict) -> sched.DecodeServer:
    tp_rank, tp_size = cfg.get("tp", (0, 1))  # one attention TP rank of a decode server of tp_size ranks
    heads = cfg.get("heads", 0)
    ranks = {"attn_cp_rank": 0, "attn_cp_size": 1, "attn_tp_rank": tp_rank, "attn_tp_size": tp_size,
             "attn_dp_rank": 0, "attn_dp_size": 1}  # fmt: skip
    args = server_args("decode", port=cfg.get("http_port", 30000), **(world.MHA_ARGS if heads else {}))
    rank = world.RankWorld("decode", args, ranks, {"KVBRIDGE_BOOTSTRAP_URL": cfg.get("cluster", "")}, mha_heads=heads)
    return sched.DecodeServer(cfg["name"], rank)


def main() -> None:
    config = json.loads(sys.argv[1])
    build = prefill_server if config["role"] == "prefill" else decode_server
    servers = {cfg["name"]: build(cfg) for cfg in config["servers"]}
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [commands.put(json.loads(line)) for line in sys.stdin], daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)
    while True:
        try:
            cmd = commands.get(timeout=0.002)
        except queue.Empty:
            cmd = None
        if cmd is not None:
            op, server = cmd.pop("op"), servers.get(cmd.pop("server", ""))
            if op == "quit":
                break
            if op == "add":
                server.add(**cmd)
            elif op == "abort":
                server.abort(cmd["room"])
            elif op == "resume":
                server.reqs[cmd["room"]].hold_after = None
            elif op == "untouched":
                print(json.dumps({"untouched": server.untouched()}), flush=True)
        for server in servers.values():
            server.step()
            while server.events:
                print(json.dumps(server.events.pop(0), default=float), flush=True)
        time.sleep(0.001)
    for server in servers.values():
        for w in getattr(server, "worlds", None) or [server.w]:
            w.mgr.close()


if __name__ == "__main__":
    main()

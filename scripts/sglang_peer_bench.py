"""Peer benchmark: SGLang's own Mooncake backend against kvbridge's, both driven through SGLang's
classes (``get_kv_class`` -> manager, sender, receiver, bootstrap server; ``KVArgs``;
``MetadataBuffers``) on the same workload, every room byte-checked.

    PYTHONPATH=. .venv-sglang/bin/python scripts/sglang_peer_bench.py            # 16 layers, 5 rooms a size
    PYTHONPATH=. .venv-sglang/bin/python scripts/sglang_peer_bench.py --quick    # 4 layers, 2 rooms (CI)
    ... --layers 61 --rooms 20 --json out.json
    ... --configs auto --rooms 10                                   # stock against auto alone
    ... --configs auto --rooms 10 --rank-processes                  # each prefill CP rank its own process
    ... --configs auto --stock-cp2 --rooms 30                       # stock CP 1 and 2 against auto (README)

Workload: DeepSeek V3.2's latent cache geometry (656 B per token per layer, fp8 with scales, page
64), requests of 1K, 8K and 32K tokens (``--sizes``), one at a time, each on fresh random page ids
on both sides. Configurations: ``mooncake`` CP 1 (``--stock-cp2``: CP 2 too, all its CP ranks
transferring, each kvbridge row then set against the stock row of its own CP size); ``kvbridge`` CP 1 and CP 2 (all CP ranks
transfer, SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1) with the default
``KVBRIDGE_STAGING=auto`` (kvbridge picks direct or staged per target by its slice count and
size); ``kvbridge staged`` CP 1 and CP 2 with ``KVBRIDGE_STAGING=always`` on both servers (every
page through decode's staging area; ``--staged-sizes``); with ``--direct`` also ``kvbridge
direct`` CP 1 and CP 2 (``KVBRIDGE_STAGING=never``: the direct path where auto would stage);
``--configs`` names the groups beside the stock backend (``auto``, ``staged``, ``direct``). The
path column is what the prefill senders report for each room (``room_stats["paths"]``), never
assumed. Both backends use Mooncake TCP on loopback (``MC_FORCE_TCP=1``). The stock backend runs
with ``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES=16``: with its default it posts a whole
request's pages of every layer as one Mooncake batch, which at 8K tokens and more fills Mooncake's
TCP per-peer queue, and the session is then blacklisted and every later room fails.

Two child processes (this script with ``--child``): one holds every prefill server, one every
decode server (``--rank-processes``: a prefill child per CP rank instead, each holding its rank of
every configuration, as a deployment runs one process per rank); each configuration first moves one uncounted warm-up room, then the rooms go round
robin over the configurations (room i of each before room i + 1 of any). Latency is decode's,
from ``send_metadata`` to ``poll() == Success``; GB/s is the rooms' KV bytes over their summed
latencies; ``send`` is the CPU time (``time.thread_time``) one prefill rank's ``send()`` takes on
the thread that calls it, SGLang's scheduler thread in a server (p50 over every rank of every
room). ``KVBRIDGE_TRACE=1`` with ``--logs``: kvbridge's trace lines in the children's logs. Every
room's decode pages start poisoned and must equal the prefill pages they came from, byte for byte,
in every layer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _child import Child

PAGE, ROW = 64, 656  # tokens per page, bytes per token per layer
POISON = 0xEE
# (label, backend, CP size, KVBRIDGE_STAGING of both servers; None: the stock backend, which has no such setting)
CONFIGS = (("mooncake", "mooncake", 1, None), ("kvbridge", "kvbridge", 1, "auto"), ("kvbridge", "kvbridge", 2, "auto"),
           ("kvbridge staged", "kvbridge", 1, "always"), ("kvbridge staged", "kvbridge", 2, "always"))
DIRECT = (("kvbridge direct", "kvbridge", 1, "never"), ("kvbridge direct", "kvbridge", 2, "never"))  # --direct
# --stock-cp2: the stock backend with its CP ranks all transferring too (its _get_cp_rank_page_bounds split), so
# that kvbridge's CP 2 rows are set against the stock backend's CP 2 on the same ranks and cores
STOCK_CP2 = ("mooncake", "mooncake", 2, None)
# --configs: the stock backend always, then these groups of kvbridge's configurations
GROUPS = {"auto": CONFIGS[1:3], "staged": CONFIGS[3:5], "direct": DIRECT}
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
                "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 65536,
                "torch_dtype": "bfloat16"}  # fmt: skip
CHILD_ENV = {"MC_FORCE_TCP": "1", "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES": "16", "HF_HUB_OFFLINE": "1",
             "KVBRIDGE_HOST": "127.0.0.1", "PYTHONUNBUFFERED": "1", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
             "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"}  # fmt: skip


def server_name(label: str, cp: int) -> str:
    return f"{label.replace(' ', '-')}{cp}"


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range (``private_ports``), never one given
    before: the children bind theirs only once SGLang is imported, and meanwhile the kernel hands no
    one such a port."""
    from kvbridge.chaos.ports import spare_port  # the parent's alone: the children skip the import

    return spare_port()


# -- the child: SGLang ranks of every configuration ------------------------------------------------


class Rank:
    """One SGLang rank: its KV pools (one uint8 tensor per layer, ``pages`` pages of 64 x 656 B),
    its MetadataBuffers, its KVArgs and the manager ``get_kv_class`` gives for ``backend``."""

    def __init__(self, role: str, backend: str, server_args: Any, layers: int, pages: int, cp: tuple[int, int]) -> None:
        import numpy as np
        import torch
        from sglang.srt.disaggregation import utils
        from sglang.srt.disaggregation.base.conn import KVArgs

        # the rank's place in the attention grid: kvbridge's settings and the stock manager read it as they start
        stamp_ranks(*cp)
        self.pool = [torch.full((pages, PAGE * ROW), POISON, dtype=torch.uint8) for _ in range(layers)]
        self.views = [t.numpy() for t in self.pool]
        if role == "prefill":  # page p of layer l: a pattern of (p, l), so decode can check any page
            for layer, v in enumerate(self.views):
                v[:] = pattern(np.arange(pages), layer)
        self.meta = utils.MetadataBuffers(8, hidden_size=32, hidden_states_dtype=torch.bfloat16,
                                          max_sampling_mask_tokens=16, max_top_logprobs_num=4)
        kv = KVArgs()
        kv.engine_rank, kv.pp_rank, kv.system_dp_rank, kv.prefill_start_layer = 0, 0, 0, 0
        kv.kv_cache_dtype_str, kv.kv_layout, kv.page_size, kv.num_draft_entries = "fp8_e4m3", None, PAGE, 0
        kv.kv_data_ptrs = [t.data_ptr() for t in self.pool]
        kv.kv_data_lens = [t.nbytes for t in self.pool]
        kv.kv_item_lens = [PAGE * ROW] * layers
        kv.kv_layer_ids = list(range(layers))
        kv.aux_data_ptrs, kv.aux_data_lens, kv.aux_item_lens = self.meta.get_buf_infos()
        kv.ib_device, kv.gpu_id = None, 0
        kv.state_types, kv.state_data_ptrs, kv.state_data_lens = [], [], []
        kv.state_item_lens, kv.state_layer_ids = [], []
        self.backend = utils.TransferBackend(backend)
        manager = utils.get_kv_class(self.backend, utils.KVClassType.MANAGER)
        mode = utils.DisaggregationMode.PREFILL if role == "prefill" else utils.DisaggregationMode.DECODE
        self.mgr = manager(kv, mode, server_args, True)
        if backend == "mooncake" and role == "prefill" and cp[1] > 1:  # each stock CP rank sends its own pages
            m = self.mgr
            if (m.attn_cp_rank, m.attn_cp_size) != cp or not m.enable_all_cp_ranks_for_transfer or m.is_dummy_cp_rank:
                raise RuntimeError(f"stock CP rank {cp}: the manager is CP rank {(m.attn_cp_rank, m.attn_cp_size)}, "
                                   f"all ranks transfer {m.enable_all_cp_ranks_for_transfer}, dummy {m.is_dummy_cp_rank}")

    def cls(self, kind: str) -> Any:
        from sglang.srt.disaggregation import utils

        return utils.get_kv_class(self.backend, getattr(utils.KVClassType, kind))


def stamp_ranks(cp_rank: int, cp_size: int) -> None:
    """This process's place in SGLang's attention grid (read by managers when they start)."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=cp_size, tp_rank=cp_rank, moe_tp_size=cp_size, attn_cp_rank=cp_rank, attn_cp_size=cp_size, attn_tp_rank=0,
                                        attn_tp_size=1, attn_dp_rank=0, attn_dp_size=1, attn_dcp_size=1,
                                        attn_dcp_rank=0)  # fmt: skip


def pattern(pages: Any, layer: int) -> Any:
    """Page p of layer l holds byte ``(p * 31 + l * 7 + j) % 251`` at offset j: row c of a sliding
    window over ``(0, 1, .., 250, 0, ..)`` is ``(c + j) % 251``, so a page is a copy of window row
    ``(p * 31 + l * 7) % 251`` (a gather of rows, not arithmetic on every byte of every page)."""
    import numpy as np

    base = (np.arange(PAGE * ROW + 251) % 251).astype(np.uint8)
    rows = np.lib.stride_tricks.sliding_window_view(base, PAGE * ROW)
    return rows[(np.asarray(pages, dtype=np.int64).reshape(-1) * 31 + layer * 7) % 251]


def wait_poll(handles: list, want: set[int], timeout: float) -> int:
    """Poll every rank's handle until the MIN (SGLang's all-reduce) is in ``want`` or Failed."""
    deadline = time.monotonic() + timeout
    while True:
        state = min(int(h.poll()) for h in handles)
        if state in want or state == 0:
            return state
        if time.monotonic() > deadline:
            return -1
        time.sleep(0.0002)


def prefill_room(ranks: list[Rank], addr: str, room: int, n: int, pages: list[int]) -> dict:
    import numpy as np

    senders = [r.cls("SENDER")(r.mgr, addr, room, False) for r in ranks]
    state = wait_poll(senders, {2}, 60)  # WaitingForInput
    send_cpu = []  # what each rank's send() costs the thread that calls it (SGLang's scheduler), CPU seconds
    if state == 2:
        for r, s in zip(ranks, senders):
            prefix = s.pop_decode_prefix_len()
            s.init(len(pages) - prefix // PAGE, 0)
            r.meta.bootstrap_room[0, 0] = room  # what set_buf writes for the room
            indices = np.asarray(pages, dtype=np.int64)
            start = time.thread_time()
            s.send(indices, None, num_kv_tokens=n)
            send_cpu.append(time.thread_time() - start)
        state = wait_poll(senders, {4}, 120)
    # kvbridge's account of the room on each rank (the stock sender has none): the path of each
    # decode target, and the bytes that went through staging
    stats = [s.room_stats for s in senders if hasattr(s, "room_stats")]
    for s in senders:
        s.clear() if state == 4 else None
    return {"room": room, "side": "prefill", "state": state,
            "paths": sorted({p for st in stats for p in st.get("paths", {}).values()}),
            "bytes": sum(st.get("bytes", 0) for st in stats), "send_cpu": send_cpu,
            "bytes_staged": sum(st.get("bytes_staged", 0) for st in stats)}  # fmt: skip


def decode_room(rank: Rank, addr: str, room: int, n: int, src: list[int], dst: list[int]) -> dict:
    import numpy as np

    deadline = time.monotonic() + 60
    while not rank.mgr.try_ensure_parallel_info(addr):  # the decode scheduler asks until it knows the prefill
        if time.monotonic() > deadline:
            return {"room": room, "side": "decode", "state": -1, "ok": False, "error": "no prefill info"}
        time.sleep(0.01)
    dst_arr = np.asarray(dst, dtype=np.int64)
    for v in rank.views:
        v[dst_arr] = POISON
    receiver = rank.cls("RECEIVER")(rank.mgr, addr, room)
    receiver.init(0)
    state = wait_poll([receiver], {2}, 60)
    start = time.perf_counter()
    if state == 2:
        receiver.send_metadata(dst_arr.astype(np.int32), 0, None, decode_prefix_len=0)
        state = wait_poll([receiver], {4}, 120)
    latency = time.perf_counter() - start
    ok = state == 4 and all(np.array_equal(v[dst_arr], pattern(src, layer)) for layer, v in enumerate(rank.views))
    if state == 4 and hasattr(receiver, "clear"):
        receiver.clear()
    return {"room": room, "side": "decode", "state": state, "ok": bool(ok), "latency_s": latency}


def child(cfg: dict) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if os.environ.get("KVBRIDGE_TRACE") == "1":  # kvbridge's trace lines, one per room event, into --logs
        logging.getLogger("kvbridge").setLevel(logging.INFO)
    from kvbridge.integrations.sglang import install

    install()
    from sglang.srt.disaggregation import utils
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    role, layers, pages = cfg["role"], cfg["layers"], cfg["pages"]

    def server_args(backend: str, port: int) -> Any:
        return ServerArgs(model_path=cfg["model"], skip_tokenizer_init=True, device="cpu", disaggregation_mode=role,
                          disaggregation_transfer_backend=backend, host="127.0.0.1", port=cfg["http_port"],
                          disaggregation_bootstrap_port=port)  # fmt: skip

    # SGLang's Mooncake manager reads the published runtime context, like a scheduler process
    publish(server_args("mooncake", cfg["ports"]["mooncake1"]), role="scheduler",
            ranks=SpawnRanks(world_rank=0, dp_rank=0, gpu_id=0))
    get_parallel().override_permanently(pp_group=None)  # no process groups: one rank, no pipeline
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import init_mooncake_transfer_engine

    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    servers: dict[str, list[Rank]] = {}
    keep = []
    for label, backend, cp, staging in cfg["configs"]:
        name = server_name(label, cp)
        port = cfg["ports"][name]
        # read by each manager as it starts (kvbridge's settings: KVBRIDGE_STAGING), as a server's
        # environment would be: set for this configuration's ranks on both sides, then dropped
        os.environ["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] = "1" if cp > 1 else "0"
        os.environ.pop("KVBRIDGE_STAGING", None)
        if staging is not None:
            os.environ["KVBRIDGE_STAGING"] = staging
        if role == "prefill" and not cfg.get("cp_rank"):  # start_disagg_service on the prefill's TokenizerManager
            keep.append(utils.get_kv_class(utils.TransferBackend(backend), utils.KVClassType.BOOTSTRAP_SERVER)(
                host="127.0.0.1", port=port))
        sa = server_args(backend, port)
        if backend == "mooncake":  # the stock manager takes its bootstrap port from the published context
            publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=0, gpu_id=0))
            get_parallel().override_permanently(pp_group=None)
        count = cp if role == "prefill" else 1
        mine = range(count) if cfg.get("cp_rank") is None else [i for i in range(count) if i == cfg["cp_rank"]]
        servers[name] = [Rank(role, backend, sa, layers, pages, (i, count)) for i in mine]
    os.environ.pop("KVBRIDGE_STAGING", None)
    stamp_ranks(0, 1)  # what SGLang's Mooncake manager may read again at run time: one rank
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        ranks, addr = servers[cmd["server"]], f"127.0.0.1:{cfg['ports'][cmd['server']]}"
        if role == "prefill":
            out = prefill_room(ranks, addr, cmd["room"], cmd["n"], cmd["src"])
        else:
            out = decode_room(ranks[0], addr, cmd["room"], cmd["n"], cmd["src"], cmd["dst"])
        print(json.dumps(out), flush=True)
    for ranks in servers.values():
        for r in ranks:
            if hasattr(r.mgr, "close"):
                r.mgr.close()
    for server in keep:
        if hasattr(server, "close"):
            server.close()
    os._exit(0)  # SGLang's Mooncake manager keeps non-daemon threads


# -- the parent -------------------------------------------------------------------------------


def _child(cfg: dict, log: Path) -> Child:
    return Child([sys.executable, __file__], cfg, log, CHILD_ENV, f"the {cfg['role']} child")


def run(layers: int, sizes: list[int], rooms: int, workdir: Path, staged_sizes: list[int] | None = None,
        configs: tuple = CONFIGS, rank_processes: bool = False) -> list[dict]:
    """``staged_sizes``: the sizes the ``kvbridge staged`` configurations run (default: ``sizes``).
    ``rank_processes``: each prefill CP rank in a child process of its own (as a deployment runs
    them), not every rank in one."""
    import numpy as np

    model = workdir / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    max_pages = max(sizes) // PAGE
    pages = max_pages + max(64, max_pages // 4) + 1  # free pages to draw random ids from (page 0: SGLang's padding)
    ports = {server_name(label, cp): free_port() for label, _, cp, _ in configs}
    common = {"layers": layers, "pages": pages, "model": str(model), "ports": ports, "configs": configs}
    max_cp = max(cp for _, _, cp, _ in configs)
    if rank_processes:  # rank i's child holds rank i of every configuration that has one (rank 0: the bootstrap servers)
        prefills = [_child({**common, "role": "prefill", "http_port": free_port(), "cp_rank": i},
                           workdir / f"prefill-cp{i}.log") for i in range(max_cp)]
    else:
        prefills = [_child({**common, "role": "prefill", "http_port": free_port()}, workdir / "prefill.log")]
    decode = _child({**common, "role": "decode", "http_port": free_port()}, workdir / "decode.log")
    cps = {server_name(label, cp): cp for label, _, cp, _ in configs}
    rng = np.random.default_rng(0)
    rows = []
    try:
        for c in (*prefills, decode):
            c.next(300)
        room = 1 << 40

        def one(server: str, n: int) -> tuple[dict, dict]:
            k = n // PAGE
            src = (rng.permutation(pages - 1)[:k] + 1).tolist()
            dst = (rng.permutation(pages - 1)[:k] + 1).tolist()
            senders = prefills[:cps[server]] if rank_processes else prefills
            for c in senders:
                c.send(op="room", server=server, room=room, n=n, src=src)
            decode.send(op="room", server=server, room=room, n=n, src=src, dst=dst)
            d = decode.next(300)
            parts = [c.next(300) for c in senders]
            p = {"room": room, "side": "prefill", "state": min(x["state"] for x in parts),
                 "paths": sorted({q for x in parts for q in x["paths"]}),
                 "bytes": sum(x["bytes"] for x in parts), "bytes_staged": sum(x["bytes_staged"] for x in parts),
                 "send_cpu": [c for x in parts for c in x["send_cpu"]]}
            return d, p

        def sizes_of(staging: str | None) -> list[int]:
            return (staged_sizes or sizes) if staging == "always" else sizes

        for label, _, cp, _ in configs:  # warm-up, not counted: connections and first-use set-up on both sides
            room += 1
            one(server_name(label, cp), min(sizes))
        # round robin: room i of every configuration before room i + 1 of any, so that a change in the
        # machine's load (its cores are shared) falls on every configuration alike
        runs: dict[tuple[str, int], dict] = {}
        for n in sizes:
            for _ in range(rooms):
                for label, _, cp, staging in configs:
                    if n not in sizes_of(staging):
                        continue
                    room += 1
                    d, p = one(server_name(label, cp), n)
                    acc = runs.setdefault((server_name(label, cp), n), {"lat": [], "ok": 0, "failed": 0, "paths": {},
                                                                        "posted": 0, "staged": 0,
                                                                        "send_cpu": []})  # fmt: skip
                    if d["state"] == 4 and p["state"] == 4:
                        acc["lat"].append(d["latency_s"])
                        acc["ok"] += d["ok"]
                        path = "+".join(p["paths"]) or "-"  # the room's path: its senders' targets', joined
                        acc["paths"][path] = acc["paths"].get(path, 0) + 1
                        acc["posted"] += p["bytes"]
                        acc["staged"] += p["bytes_staged"]
                        acc["send_cpu"] += p["send_cpu"]
                    else:
                        acc["failed"] += 1
        for label, _, cp, staging in configs:
            for n in sizes_of(staging):
                acc, nbytes = runs[(server_name(label, cp), n)], n * ROW * layers
                lat, posted = acc["lat"], acc["posted"]
                rows.append({"backend": label, "cp": cp, "staging": staging, "tokens": n, "rooms": rooms,
                             "succeeded": len(lat), "failed": acc["failed"], "bytes_checked": acc["ok"],
                             "paths": acc["paths"], "staged_share": acc["staged"] / posted if posted else None,
                             "mb_per_room": nbytes / 1e6, "p50_ms": float(np.median(lat)) * 1e3 if lat else None,
                             "gb_s": nbytes * len(lat) / sum(lat) / 1e9 if lat else None,
                             "latencies_ms": [round(x * 1e3, 3) for x in lat],
                             "send_cpu_ms": float(np.median(acc["send_cpu"])) * 1e3 if acc["send_cpu"] else None})  # fmt: skip
    finally:
        decode.stop()  # first: its ranks deregister from daemons the prefill child runs
        for c in reversed(prefills):  # rank 0's child, which runs the bootstrap servers, last
            c.stop()
    stock = {(r["tokens"], r["cp"]): r for r in rows if r["backend"] == "mooncake"}
    for r in rows:
        # against the stock backend at the same CP size where it ran (--stock-cp2), else its CP 1
        base_cp = r["cp"] if (r["tokens"], r["cp"]) in stock else 1
        base = stock.get((r["tokens"], base_cp), {})
        r["base_cp"] = base_cp
        r["ratio"] = r["gb_s"] / base["gb_s"] if r["gb_s"] and base.get("gb_s") else None
        r["p50_ratio"] = r["p50_ms"] / base["p50_ms"] if r["p50_ms"] and base.get("p50_ms") else None
    return rows


def table(rows: list[dict], layers: int) -> str:
    out = [f"SGLang peer benchmark: {layers} layers x {ROW} B per token, page {PAGE}, random pages, Mooncake TCP "
           "(loopback), one room at a time; staging = KVBRIDGE_STAGING of both servers; path = what the prefill "
           "senders report per room; ratio = GB/s over SGLang's Mooncake backend at the same size, p50 x = p50 "
           "over its p50 (vs: the stock backend's CP size it is set against: the row's own where it ran, else 1); "
           "send = CPU ms one prefill rank's send() takes on the calling thread (SGLang's scheduler), p50",
           f"{'backend':<15} {'cp':>2} {'staging':<7} {'path':<17} {'tokens':>6} {'MB/room':>8} {'rooms':>5} "
           f"{'ok':>3} {'bytes ok':>8} {'p50 ms':>8} {'p50 x':>6} {'GB/s':>6} {'ratio':>6} {'vs':>2} {'send':>6}"]  # fmt: skip

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in rows:
        out.append(f"{r['backend']:<15} {r['cp']:>2} {r['staging'] or '-':<7} {path_cell(r['paths']):<17} "
                   f"{r['tokens']:>6} {r['mb_per_room']:>8.1f} {r['rooms']:>5} {r['succeeded']:>3} "
                   f"{r['bytes_checked']:>8} {f(r['p50_ms'], '8.1f')} {f(r['p50_ratio'], '6.2f')} "
                   f"{f(r['gb_s'], '6.2f')} {f(r['ratio'], '6.2f')} {r['base_cp']:>2} {f(r['send_cpu_ms'], '6.3f')}")  # fmt: skip
    return "\n".join(out)


def path_cell(paths: dict[str, int]) -> str:
    """``staged``, ``direct``, or the rooms of each where they differed (``direct 3/staged 2``);
    ``-`` for the stock backend, whose senders report no path."""
    if len(paths) <= 1:
        return next(iter(paths), "-")
    return "/".join(f"{p} {n}" for p, n in sorted(paths.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 layers, 2 rooms a size (CI: under two minutes)")
    ap.add_argument("--layers", type=int, default=None, help="KV layers (default 16; --quick 4; DeepSeek: 61)")
    ap.add_argument("--sizes", default="1024,8192,32768", help="request sizes in tokens, multiples of 64")
    ap.add_argument("--rooms", type=int, default=None, help="rooms per size and configuration (default 5; --quick 2)")
    ap.add_argument("--staged-sizes", default="", help="sizes of the 'kvbridge staged' rows (default: --sizes)")
    ap.add_argument("--direct", action="store_true", help="also 'kvbridge direct' CP 1 and 2 (KVBRIDGE_STAGING=never "
                    "on both servers): the direct path at every size, where auto would stage")
    ap.add_argument("--configs", default="", help="kvbridge's configurations beside the stock backend, any of "
                    f"{','.join(GROUPS)} (default auto,staged; with --direct also direct): e.g. 'auto' for auto "
                    "against stock alone (fewer ranks: less memory, shorter runs)")
    ap.add_argument("--rank-processes", action="store_true", help="each prefill CP rank in a child process of "
                    "its own (a deployment's layout); default: every prefill rank in one child")
    ap.add_argument("--stock-cp2", action="store_true", help="also the stock backend at CP 2 (all CP ranks "
                    "transfer, SGLang's own page split), and kvbridge's CP 2 rows set against it instead of the "
                    "stock CP 1 row")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    ap.add_argument("--logs", default="", help="keep the children's logs in this directory")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(s <= 0 or s % PAGE for s in sizes):
        ap.error(f"--sizes must be positive multiples of {PAGE}")
    # --quick (CI) stages at every size too: 1K is one chunk smaller than a slot, 8K several chunks,
    # and at 4 layers 32K (86 MB) is more than decode's default 64 MiB area, so it streams through
    # the slots (reuse, back-pressure)
    staged = [int(s) for s in args.staged_sizes.split(",")] if args.staged_sizes else sizes
    if any(s not in sizes for s in staged):
        ap.error(f"--staged-sizes {args.staged_sizes}: each must be one of --sizes {args.sizes}")
    layers = args.layers or (4 if args.quick else 16)
    rooms = args.rooms or (2 if args.quick else 5)
    groups = [g for g in args.configs.split(",") if g] or ["auto", "staged", *(["direct"] if args.direct else [])]
    if args.direct and "direct" not in groups:
        groups.append("direct")
    if any(g not in GROUPS for g in groups) or len(set(groups)) != len(groups):
        ap.error(f"--configs {args.configs}: each of {', '.join(GROUPS)} at most once")
    configs = CONFIGS[:1] + ((STOCK_CP2,) if args.stock_cp2 else ()) + tuple(c for g in GROUPS if g in groups
                                                                               for c in GROUPS[g])
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        rows = run(layers, sizes, rooms, Path(args.logs), staged, configs, args.rank_processes)
    else:
        with tempfile.TemporaryDirectory(prefix="sglang-peer-bench-") as tmp:
            rows = run(layers, sizes, rooms, Path(tmp), staged, configs, args.rank_processes)
    print(table(rows, layers))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    # a failed room, a byte that differs, or a room whose path is not the one its servers' mode forces
    bad = [r for r in rows if r["failed"] or r["bytes_checked"] != r["rooms"]
           or (r["staging"] == "always" and r["paths"] != {"staged": r["rooms"]})
           or (r["staging"] == "never" and r["paths"] != {"direct": r["rooms"]})]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Peer benchmark: SGLang's own Mooncake backend against kvbridge's, both driven through SGLang's
classes (``get_kv_class`` -> manager, sender, receiver, bootstrap server; ``KVArgs``;
``MetadataBuffers``) on the same workload, every room byte-checked.

    PYTHONPATH=. .venv-sglang/bin/python scripts/sglang_peer_bench.py            # 16 layers, 5 rooms a size
    PYTHONPATH=. .venv-sglang/bin/python scripts/sglang_peer_bench.py --quick    # 4 layers, 2 rooms (CI)
    ... --layers 61 --rooms 20 --json out.json

Workload: DeepSeek V3.2's latent cache geometry (656 B per token per layer, fp8 with scales, page
64), requests of 1K, 8K and 32K tokens (``--sizes``), one at a time, each on fresh random page
ids on both sides. Configurations: ``mooncake`` CP 1, ``kvbridge`` CP 1 and CP 2 (all CP ranks
transfer, SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1). Both backends use Mooncake TCP on
loopback (``MC_FORCE_TCP=1``). The stock backend runs with
``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES=16``: with its default it posts a whole request's
pages of every layer as one Mooncake batch, which at 8K tokens and more fills Mooncake's TCP
per-peer queue, and the session is then blacklisted and every later room fails.

Two child processes (this script with ``--child``): one holds every prefill server, one every
decode server; each configuration first moves one uncounted warm-up room. Latency is decode's,
from ``send_metadata`` to ``poll() == Success``; GB/s is the rooms' KV bytes over their summed
latencies. Every room's decode pages start poisoned and must equal the prefill
pages they came from, byte for byte, in every layer.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PAGE, ROW = 64, 656  # tokens per page, bytes per token per layer
POISON = 0xEE
CONFIGS = (("mooncake", 1), ("kvbridge", 1), ("kvbridge", 2))
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
                "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 65536,
                "torch_dtype": "bfloat16"}  # fmt: skip
CHILD_ENV = {"MC_FORCE_TCP": "1", "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES": "16", "HF_HUB_OFFLINE": "1",
             "KVBRIDGE_HOST": "127.0.0.1", "PYTHONUNBUFFERED": "1", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
             "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the child: SGLang ranks of every configuration ------------------------------------------------


class Rank:
    """One SGLang rank: its KV pools (one uint8 tensor per layer, ``pages`` pages of 64 x 656 B),
    its MetadataBuffers, its KVArgs and the manager ``get_kv_class`` gives for ``backend``."""

    def __init__(self, role: str, backend: str, server_args: Any, layers: int, pages: int, cp: tuple[int, int]) -> None:
        import numpy as np
        import torch
        from sglang.srt.disaggregation import utils
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.runtime_context import get_parallel

        if backend == "kvbridge":  # the rank's place in the attention grid (kvbridge's settings read it)
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
    import numpy as np

    pages = np.asarray(pages, dtype=np.int64).reshape(-1, 1)
    return ((pages * 31 + layer * 7 + np.arange(PAGE * ROW)) % 251).astype(np.uint8)


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
    if state == 2:
        for r, s in zip(ranks, senders):
            prefix = s.pop_decode_prefix_len()
            s.init(len(pages) - prefix // PAGE, 0)
            r.meta.bootstrap_room[0, 0] = room  # what set_buf writes for the room
            s.send(np.asarray(pages, dtype=np.int64), None, num_kv_tokens=n)
        state = wait_poll(senders, {4}, 120)
    for s in senders:
        s.clear() if state == 4 else None
    return {"room": room, "side": "prefill", "state": state}


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
    for backend, cp in CONFIGS:
        name, port = f"{backend}{cp}", cfg["ports"][f"{backend}{cp}"]
        env = {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1" if cp > 1 else "0"}
        os.environ.update(env)
        if role == "prefill":  # start_disagg_service on the prefill's TokenizerManager
            keep.append(utils.get_kv_class(utils.TransferBackend(backend), utils.KVClassType.BOOTSTRAP_SERVER)(
                host="127.0.0.1", port=port))
        sa = server_args(backend, port)
        count = cp if role == "prefill" else 1
        servers[name] = [Rank(role, backend, sa, layers, pages, (i, count)) for i in range(count)]
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


class Child:
    def __init__(self, cfg: dict, log: Path) -> None:
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, **CHILD_ENV})  # fmt: skip
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put({"exited": self.proc.poll()})

    def next(self, timeout: float) -> dict:
        try:
            out = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer from the {self.proc.args[-1][:40]} child within {timeout:.0f}s") from None
        if "exited" in out:
            raise RuntimeError(f"a child exited ({out['exited']}); see {self.log.name}")
        return out

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def run(layers: int, sizes: list[int], rooms: int, workdir: Path) -> list[dict]:
    import numpy as np

    model = workdir / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    max_pages = max(sizes) // PAGE
    pages = max_pages + max(64, max_pages // 4) + 1  # free pages to draw random ids from (page 0: SGLang's padding)
    ports = {f"{b}{cp}": free_port() for b, cp in CONFIGS}
    common = {"layers": layers, "pages": pages, "model": str(model), "ports": ports}
    prefill = Child({**common, "role": "prefill", "http_port": free_port()}, workdir / "prefill.log")
    decode = Child({**common, "role": "decode", "http_port": free_port()}, workdir / "decode.log")
    rng = np.random.default_rng(0)
    rows = []
    try:
        for c in (prefill, decode):
            c.next(300)
        room = 1 << 40

        def one(server: str, n: int) -> tuple[dict, dict]:
            k = n // PAGE
            src = (rng.permutation(pages - 1)[:k] + 1).tolist()
            dst = (rng.permutation(pages - 1)[:k] + 1).tolist()
            prefill.send(op="room", server=server, room=room, n=n, src=src)
            decode.send(op="room", server=server, room=room, n=n, src=src, dst=dst)
            return decode.next(300), prefill.next(300)

        for backend, cp in CONFIGS:
            server = f"{backend}{cp}"
            room += 1
            one(server, min(sizes))  # warm-up, not counted: connections and first-use set-up on both sides
            for n in sizes:
                lat, ok, failed = [], 0, 0
                for _ in range(rooms):
                    room += 1
                    d, p = one(server, n)
                    if d["state"] == 4 and p["state"] == 4:
                        lat.append(d["latency_s"])
                        ok += d["ok"]
                    else:
                        failed += 1
                nbytes = n * ROW * layers
                rows.append({"backend": backend, "cp": cp, "tokens": n, "rooms": rooms, "succeeded": len(lat),
                             "failed": failed, "bytes_checked": ok, "mb_per_room": nbytes / 1e6,
                             "p50_ms": float(np.median(lat)) * 1e3 if lat else None,
                             "gb_s": nbytes * len(lat) / sum(lat) / 1e9 if lat else None})  # fmt: skip
    finally:
        decode.stop()  # first: its ranks deregister from daemons the prefill child runs
        prefill.stop()
    stock = {r["tokens"]: r["gb_s"] for r in rows if r["backend"] == "mooncake"}
    for r in rows:
        base = stock.get(r["tokens"])
        r["ratio"] = r["gb_s"] / base if r["gb_s"] and base else None
    return rows


def table(rows: list[dict], layers: int) -> str:
    out = [f"SGLang peer benchmark: {layers} layers x {ROW} B per token, page {PAGE}, random pages, Mooncake TCP "
           "(loopback), one room at a time; ratio = GB/s over SGLang's Mooncake backend at the same size",
           f"{'backend':<9} {'cp':>2} {'tokens':>6} {'MB/room':>8} {'rooms':>5} {'ok':>3} {'bytes ok':>8} "
           f"{'p50 ms':>8} {'GB/s':>6} {'ratio':>6}"]  # fmt: skip

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in rows:
        out.append(f"{r['backend']:<9} {r['cp']:>2} {r['tokens']:>6} {r['mb_per_room']:>8.1f} {r['rooms']:>5} "
                   f"{r['succeeded']:>3} {r['bytes_checked']:>8} {f(r['p50_ms'], '8.1f')} {f(r['gb_s'], '6.2f')} "
                   f"{f(r['ratio'], '6.2f')}")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 layers, 2 rooms a size (CI: under two minutes)")
    ap.add_argument("--layers", type=int, default=None, help="KV layers (default 16; --quick 4; DeepSeek: 61)")
    ap.add_argument("--sizes", default="1024,8192,32768", help="request sizes in tokens, multiples of 64")
    ap.add_argument("--rooms", type=int, default=None, help="rooms per size and configuration (default 5; --quick 2)")
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
    layers = args.layers or (4 if args.quick else 16)
    rooms = args.rooms or (2 if args.quick else 5)
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        rows = run(layers, sizes, rooms, Path(args.logs))
    else:
        with tempfile.TemporaryDirectory(prefix="sglang-peer-bench-") as tmp:
            rows = run(layers, sizes, rooms, Path(tmp))
    print(table(rows, layers))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["failed"] or r["bytes_checked"] != r["rooms"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

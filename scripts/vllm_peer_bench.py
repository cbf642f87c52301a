"""Peer benchmark: vLLM's own MooncakeConnector (and NixlConnector where NIXL runs) against
kvbridge's connector on Mooncake (and on NIXL where it runs), each driven through vLLM's real classes on the same workload, every
room byte-checked.

    PYTHONPATH=. .venv-vllm/bin/python scripts/vllm_peer_bench.py            # 8K and 32K tokens, 3 rooms a size
    PYTHONPATH=. .venv-vllm/bin/python scripts/vllm_peer_bench.py --quick    # small rooms, 1 a size (CI)
    ... --models gqa --sizes 8192 --rooms 5 --json out.json

Each connector is built the way vLLM builds it: a ``KVTransferConfig`` from the JSON a user
types after ``--kv-transfer-config``, vLLM's ``Scheduler`` (which makes the scheduler side
through ``KVConnectorFactory``), and the worker side from ``KVConnectorFactory.create_connector``
over KV caches that vLLM's ``allocate_kv_cache`` lays out on the CPU (LBHNC, the layout vLLM's
MooncakeConnector demands; MLA has one). vLLM's distributed state is initialised in every
process (gloo, world 1), as a CPU worker does. This script plays the model runner: per step it
hands the scheduler's output to the worker connector in vLLM's order (bind, start_load_kv, the
"forward" that writes the step's tokens, wait_for_save, get_transfer_results,
get_block_ids_with_load_errors, clear) and feeds the scheduler a ``ModelRunnerOutput``.

One process per connector and side (a vLLM engine holds one connector): prefill and decode of
each connector in processes of their own. Flow per room, as vLLM's P/D proxy runs it: the
prompt goes to prefill with ``do_remote_decode`` (Mooncake: plus the proxy's ``transfer_id``),
prefill's engine steps until the request finishes (its blocks held for the transfer), then the
prompt goes to decode with the params prefill returned (Mooncake: the proxy's
``remote_engine_id``/``remote_bootstrap_addr``/``transfer_id``). Latency is decode's, from
``add_request`` until its scheduler saw ``finished_recving``; GB/s is the rooms' KV bytes over
their summed latencies. Rooms go round robin over the connectors (room i of each before room
i + 1 of any); one uncounted warm-up room per connector and model first (the connections,
NIXL's handshake, Mooncake's bootstrap query). Block ids are scattered: both sides' free
queues are shuffled with the room's seed before each room, once every block of earlier rooms is
back (the same seed for every connector, so every connector moves the same block ids; the ids
a room held are read inside the engine's step, so a slow poll cannot miss them). Prefill's
pages hold a stamp of (room, layer, logical page) and a shifted byte window; decode's blocks
start poisoned and every page of every layer must equal what prefill wrote. While one
connector's decode is timed, every other connector's processes are stopped (SIGSTOP, resumed
by SIGCONT after): an idle vLLM NixlConnector process spins NIXL's progress thread (0.4-0.9
of a core on the 2-core machine), which on a small host takes the CPU from the connector being
timed; ``--shared`` leaves them running. The timed connector's own processes always run, its
own spinning threads included.

Configuration of vLLM's connectors on this CPU (nothing of vLLM's is patched):

    MooncakeConnector   "mooncake_protocol": "tcp"; "bootstrap_server_address" pointing at
                        vLLM's own MooncakeBootstrapServer started on 127.0.0.1 (left to
                        itself prefill's TP rank 0 binds it on 0.0.0.0); VLLM_HOST_IP=127.0.0.1
                        (its side channel and engine address). Its worker asks
                        ``torch.accelerator.current_device_index()`` first thing, which raises
                        "Cannot access accelerator device when none is available" on a CPU
                        torch: the child answers 0 for it (the CPU "device" vLLM's CpuPlatform
                        then sets, a no-op). It posts a room's slices as one Mooncake batch: over
                        ~2,048 slices Mooncake's TCP per-peer queue overflows ("queue-full"), so
                        MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER is raised (MOONCAKE_ENV).
    NixlConnector       "backends": ["UCX"], kv_buffer_device "cpu", UCX_TLS=tcp (UCX TCP
                        loopback); side channel on 127.0.0.1 (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT).
    KVBridgeConnector   a kvbridge bootstrap daemon on 127.0.0.1, staging auto (--kvbridge-staging
                        always|never forces kvbridge's path, recorded in its rows); row ``kvbridge`` on
                        Mooncake TCP ("engine": "mooncake"), row ``kvbridge-nixl`` on kvbridge's
                        NIXL engine ("engine": "nixl": UCX with the same UCX_TLS=tcp as NixlConnector,
                        the same blocks), each compared with each of vLLM's connectors.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _child import Child

ROOT = Path(__file__).resolve().parents[1]
POISON = 0xEE
CONNECTORS = ("mooncake", "nixl", "kvbridge", "kvbridge-nixl")
KVBRIDGE_ENGINE = {"kvbridge": "mooncake", "kvbridge-nixl": "nixl"}  # kvbridge's rows: its transfer engine
READY_S = 600  # a child's start-up (vLLM's imports and set-up): minutes on a loaded 2-core machine
# the tests' shapes (tests/integrations/vllm/_vllm_config.py) with more layers
MODELS: dict[str, dict[str, Any]] = {
    "gqa": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=16, head_dim=64, vocab_size=512,
                max_position_embeddings=65536, torch_dtype="bfloat16", rms_norm_eps=1e-6, bos_token_id=1,
                eos_token_id=2),
    "mla": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=256,
                intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                num_hidden_layers=8, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
                v_head_dim=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=8, vocab_size=512, max_position_embeddings=65536, torch_dtype="bfloat16",
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, rope_theta=10000.0),
}  # fmt: skip
# vLLM's block size on the CPU: 128 by default for GQA (CPU_ATTN refuses 16: "No common block size
# for 16 (CPU_ATTN: [MultipleOf(32)])"), and 16 for MLA (vLLM's CPU MLA backend forces it)
BLOCK = {"gqa": 128, "mla": 16}
# the attention backend each workload asks for, as ``--attention-backend`` does: on a host with AMX
# vLLM picks AMX_MLA for MLA, which refuses block 16 ("No common block size for 16 (AMX_MLA:
# [MultipleOf(32)])" from NixlConnector's and MooncakeConnector's workers); CPU_MLA keeps the
# workload (block 16, 18 KiB slices) the same on every x86 host
ATTENTION_BACKEND = {"gqa": None, "mla": "CPU_MLA"}
# 32768: the largest Mooncake 0.3.13 accepts of those tried (65536 is "Invalid ..., using default 1024");
# a 32K-token MLA room of 8 layers, block 16, is 16,384 slices in one batch
MOONCAKE_ENV = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "32768", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "32768"}
CHILD_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_TLS": "tcp",
             "UCX_NET_DEVICES": "lo", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "MC_FORCE_TCP": "1",
             "VLLM_LOGGING_LEVEL": "WARNING", "KVBRIDGE_HOST": "127.0.0.1", **MOONCAKE_ENV}  # fmt: skip


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range (``private_ports``), never one given
    before: a child binds it minutes later (vLLM's start-up), and meanwhile the kernel hands no one such
    a port (a NIXL side channel whose bind fails leaves its connector waiting for ever)."""
    from kvbridge.chaos.ports import spare_port  # the parent's alone: the children skip the import

    return spare_port()


def transfer_json(connector: str, role: str, cfg: dict) -> str:
    """The ``--kv-transfer-config`` a user types for this connector and role."""
    if connector in KVBRIDGE_ENGINE:
        extra = {"bootstrap_url": cfg["kvbridge_url"], "bootstrap_token": cfg["kvbridge_token"],
                 "instance": f"{cfg['tag']}-{'p' if role == 'kv_producer' else 'd'}",
                 "engine": KVBRIDGE_ENGINE[connector], "staging": cfg.get("kvbridge_staging", "auto")}
        if role == "kv_consumer":  # decode checks prefill's contract at start-up (on its engine's transport)
            extra["prefill_instance"] = f"{cfg['tag']}-p"
        return json.dumps({"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
                           "kv_role": role, "kv_connector_extra_config": extra})
    if connector == "mooncake":
        return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                           "kv_connector_extra_config": {"mooncake_protocol": "tcp",
                                                         "bootstrap_server_address": cfg["mooncake_bootstrap"]}})
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                       "kv_connector_extra_config": {"backends": ["UCX"]}})


# -- a child: one vLLM engine (scheduler + one worker) with one connector ---------------------------


class Engine:
    def __init__(self, cfg: dict) -> None:
        import numpy as np
        import torch
        from vllm.config import (AttentionConfig, CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                                 ParallelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config)
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        self.cfg, self.np, self.torch = cfg, np, torch
        self.role, self.connector_name = cfg["role"], cfg["connector"]
        self.block_size = bs = cfg["block_size"]
        kv = KVTransferConfig(**json.loads(cfg["transfer_json"]), engine_id=cfg["engine_id"])
        max_len = cfg["max_tokens"] + 2 * bs
        mc = ModelConfig(model=cfg["model"], tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                         max_model_len=max_len)
        sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=cfg["max_batched"], max_model_len=max_len,
                             enable_chunked_prefill=True, is_encoder_decoder=False)
        vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True),
                        scheduler_config=sc, kv_transfer_config=kv, device_config=DeviceConfig("cpu"),
                        parallel_config=ParallelConfig(tensor_parallel_size=1),
                        attention_config=AttentionConfig(backend=cfg.get("attention_backend")))
        layout = "LBHNC"
        vc.cache_config.kv_cache_layout = layout
        self.vc = vc
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{cfg['dist_port']}")
            initialize_model_parallel(1, 1)
        layers = mc.hf_config.num_hidden_layers
        if mc.use_mla:
            head = mc.hf_config.kv_lora_rank + mc.hf_config.qk_rope_head_dim
            specs = {f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(block_size=bs, num_kv_heads=1,
                                                                           head_size=head, dtype=torch.bfloat16)
                     for i in range(layers)}
        else:
            specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
                block_size=bs, num_kv_heads=mc.get_total_num_kv_heads(), head_size=mc.get_head_size(),
                dtype=torch.bfloat16) for i in range(layers)}
        page = next(iter(specs.values())).page_size_bytes
        (self.kvcc,) = get_kv_cache_configs(vc, [specs], [page * layers * cfg["num_blocks"]])
        vc.cache_config.num_gpu_blocks = self.kvcc.num_blocks
        self.scheduler = Scheduler(vc, self.kvcc, StructuredOutputManager(vc), block_size=bs)
        self.caches = allocate_kv_cache(self.kvcc, torch.device("cpu"), KVCacheLayout[layout])
        # [B, H, N, C] uint8 view per layer, by layer index; a block of a layer is one contiguous page
        self.pages = [self.caches[f"model.layers.{i}.self_attn.attn"].view(torch.uint8).numpy().reshape(
            self.kvcc.num_blocks, -1) for i in range(layers)]
        for p in self.pages:
            p[:] = POISON if self.role == "kv_consumer" else 0
        if self.connector_name == "mooncake":
            # MooncakeConnectorWorker asks torch for the accelerator's index; a CPU torch raises
            torch.accelerator.current_device_index = lambda: 0
            from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import MooncakeBootstrapServer

            if self.role == "kv_producer":  # the prefill server's bootstrap, on loopback
                host, port = cfg["mooncake_bootstrap"].rsplit(":", 1)
                self.bootstrap = MooncakeBootstrapServer(host, int(port))
                self.bootstrap.start()
        with set_current_vllm_config(vc):
            self.worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, self.kvcc)
            self.worker.register_kv_caches(self.caches)
            # what EngineCore does after the workers registered their caches: the workers' handshake
            # metadata to the scheduler side (NIXL's side channel listens from there)
            meta = self.worker.get_handshake_metadata()
            connector = self.scheduler.get_kv_connector()
            if meta is not None and connector is not None:
                connector.set_xfer_handshake_metadata_pp_aware({(0, 0): meta})
        self.outputs: dict[str, Any] = {}
        self.recved: dict[str, float] = {}
        self.failed: set[str] = set()
        self.invalid: set[int] = set()
        self.seeds: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}  # by request: the ids it held after a step's schedule()
        self.lock = threading.Lock()
        self.stop = False
        threading.Thread(target=self._loop, daemon=True).start()

    # -- vLLM's engine loop, with this script as the model runner ------------------------------

    def _loop(self) -> None:
        while not self.stop:
            with self.lock:
                busy = self.scheduler.has_requests() or self._held()
                if busy:
                    self.step()
            time.sleep(0.0005 if busy else 0.002)

    def _held(self) -> bool:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < self.kvcc.num_blocks - 1

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        self.note_block_ids(so.num_scheduled_tokens)
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        sampled: dict[str, list[int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():  # the forward pass
            req = self.scheduler.requests[req_id]
            start = req.num_computed_tokens - n
            if self.role == "kv_producer" and req_id in self.seeds:
                self.write(req_id, start, min(req.num_computed_tokens, req.num_prompt_tokens))
            sampled[req_id] = [7] if req.num_computed_tokens >= req.num_tokens else []
        w.start_load_kv(None)
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        now = time.perf_counter()
        for r in res.finished_recving or ():
            self.recved.setdefault(r, now)
        self.failed |= set(res.failed_recving or ())
        self.invalid |= invalid
        kvo = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                finished_recving=res.finished_recving or None, failed_recving=res.failed_recving,
                                invalid_block_ids=invalid)
        ids = list(sampled)
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={k: i for i, k in enumerate(ids)},
                                sampled_token_ids=[sampled[k] for k in ids], kv_connector_output=kvo)
        for eco in self.scheduler.update_from_output(so, out).values():
            for o in eco.outputs:
                self.outputs[o.request_id] = o

    def note_block_ids(self, scheduled: dict[str, int]) -> None:
        """Each request's block ids, read right after ``schedule()`` in every step. vLLM allocates
        blocks only in ``schedule()`` and frees them only in ``update_from_output()``, both inside
        ``step()``: read here, a request's ids are seen however late the command's thread polls.
        A decode room lives a few steps, and a thread that polls for it may first run after the
        request is gone (a loaded host: the ids read [], and [] passes the byte check). A request
        gains blocks when first allocated (decode's async load schedules no token) or in a step
        that schedules it (``scheduled``): only then are its ids read again (decode's steps are
        timed: a 32K MLA room holds 2,048 blocks)."""
        kvm = self.scheduler.kv_cache_manager
        for req_id in self.scheduler.requests:
            if req_id in self.block_ids and req_id not in scheduled:
                continue
            ids = kvm.get_block_ids(req_id)[0]
            if ids:
                self.block_ids[req_id] = list(ids)

    # -- the bytes ------------------------------------------------------------------------------

    def content(self, seed: int, layer: int, logical: Any) -> Any:
        """Logical pages ``logical`` of layer ``layer`` of room ``seed``: a window of (0..250)
        shifted by a hash of the three, its first 8 bytes the stamp (seed, layer, page)."""
        np = self.np
        nbytes = self.pages[0].shape[1]
        logical = np.asarray(logical, dtype=np.int64)
        base = (np.arange(nbytes + 251) % 251).astype(np.uint8)
        rows = np.lib.stride_tricks.sliding_window_view(base, nbytes)
        out = rows[(logical * 31 + layer * 7 + seed * 13) % 251].copy()
        stamp = (np.int64(seed) << 40) + (np.int64(layer) << 24) + logical
        out[:, :8] = stamp.astype("<i8").view(np.uint8).reshape(-1, 8)
        return out

    def write(self, req_id: str, start: int, stop: int) -> None:
        """Prefill's forward pass over tokens [start, stop): the pages they complete (whole blocks:
        the prompts here are whole blocks)."""
        np, bs = self.np, self.block_size
        first, last = start // bs, -(-stop // bs)
        blocks = np.asarray(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0], dtype=np.int64)
        logical = np.arange(first, last)
        for layer, p in enumerate(self.pages):
            p[blocks[logical]] = self.content(self.seeds[req_id], layer, logical)

    def check(self, blocks: list[int], seed: int) -> int:
        """Decode: bytes of the room's blocks that differ from what prefill wrote; the blocks are
        poisoned again after."""
        np = self.np
        ids = np.asarray(blocks, dtype=np.int64)
        wrong = 0
        for layer, p in enumerate(self.pages):
            wrong += int(np.count_nonzero(p[ids] != self.content(seed, layer, np.arange(len(ids)))))
            p[ids] = POISON
        return wrong

    # -- requests -------------------------------------------------------------------------------

    def shuffle(self, seed: int) -> None:
        """Scattered block ids: every free block taken and given back in the seed's order (vLLM's
        allocator hands out blocks in free-queue order)."""
        import random

        pool = self.scheduler.kv_cache_manager.block_pool
        blocks = pool.get_new_blocks(pool.get_num_free_blocks())
        blocks.sort(key=lambda b: b.block_id)
        random.Random(seed).shuffle(blocks)
        pool.free_blocks(blocks)

    def add(self, req_id: str, prompt: list[int], params: dict | None, max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.extra_args = {"kv_transfer_params": dict(params)} if params is not None else None
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(self.block_size, sha256))
        self.scheduler.add_request(req)

    def wait(self, cond: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if cond():
                    return True
            time.sleep(0.0002)
        return False

    def prefill(self, cmd: dict) -> dict:
        req_id, seed = cmd["req_id"], cmd["seed"]
        if not self.idle(60):  # the shuffle permutes the free queue it finds: all of it, or other ids
            return {"ok": False, "params": None, "blocks": [], "error": "blocks of an earlier room still held"}
        with self.lock:
            self.shuffle(seed)
            self.seeds[req_id] = seed
            self.add(req_id, cmd["prompt"], cmd["params"], 1)
        ok = self.wait(lambda: req_id in self.outputs and self.outputs[req_id].finish_reason is not None, 120)
        with self.lock:
            out, blocks = self.outputs.get(req_id), self.block_ids.get(req_id, [])
        return {"ok": ok, "params": getattr(out, "kv_transfer_params", None), "blocks": blocks}

    def decode(self, cmd: dict) -> dict:
        req_id, pages = cmd["req_id"], cmd["pages"]
        if not self.idle(60):  # as prefill's: every block back before the shuffle
            return {"ok": False, "wrong": -1, "blocks": [], "latency_s": None, "stats": {},
                    "error": "blocks of an earlier room still held"}
        with self.lock:
            self.shuffle(cmd["seed"])
            start = time.perf_counter()
            self.add(req_id, cmd["prompt"], cmd["params"], 1)
        ok = self.wait(lambda: req_id in self.recved or req_id in self.failed, 120)
        end = self.recved.get(req_id)
        self.wait(lambda: req_id in self.outputs and self.outputs[req_id].finish_reason is not None, 30)
        with self.lock:
            blocks = self.block_ids.get(req_id, [])
            failed = req_id in self.failed or bool(self.invalid & set(blocks))
            # fewer ids than pages: pages nobody checked, never a pass
            wrong = self.check(blocks[:pages], cmd["seed"]) if ok and not failed and len(blocks) >= pages else -1
        return {"ok": ok and not failed and wrong >= 0, "wrong": wrong, "blocks": blocks[:pages],
                "latency_s": (end - start) if end else None, "stats": self.room_stats(req_id)}

    def room_stats(self, req_id: str) -> dict:
        """kvbridge's own account of a room (its worker side keeps one per request): the seconds in
        each state, the slices, the path; {} for vLLM's connectors."""
        side = getattr(self.worker, "worker_side", None)
        return dict(side.room_stats.get(req_id, {})) if side is not None else {}

    def idle(self, timeout: float) -> bool:
        """Every request gone and every block back (prefill: the transfer released them)."""
        return self.wait(lambda: not self.scheduler.has_requests() and not self._held(), timeout)


def child(cfg: dict) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        engine = Engine(cfg)
    except Exception as exc:  # the peer cannot run here: say why, precisely
        import traceback

        traceback.print_exc()
        print(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        os._exit(0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "prefill":
            out = engine.prefill(cmd)
        elif cmd["op"] == "decode":
            out = engine.decode(cmd)
        else:
            out = {"idle": engine.idle(cmd.get("timeout", 30)), "stats": engine.room_stats(cmd.get("req_id", ""))}
        print(json.dumps(out), flush=True)
    engine.stop = True
    try:
        with engine.lock:
            engine.worker.shutdown()
    except Exception:  # noqa: BLE001 - vLLM's connectors' shutdown paths may raise on the way out
        pass
    os._exit(0)  # the connectors keep non-daemon threads


# -- the parent -------------------------------------------------------------------------------


def _child(cfg: dict, log: Path) -> Child:
    return Child(["nice", sys.executable, __file__], cfg, log, {**CHILD_ENV, **cfg.get("env", {})},
                 f"{cfg['connector']} {cfg['role']}")


def nixl_missing() -> str:
    """Why vLLM's NixlConnector cannot run in this venv ('' if it can)."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        return f"import nixl._api failed ({exc}): install nixl==1.5.1 nixl-cu12==1.5.1 --no-deps"
    return ""


class paused:
    """The other connectors' processes stopped (SIGSTOP) while one connector's decode runs, resumed
    (SIGCONT) after: on a small host an idle peer is not idle (vLLM's NixlConnector starts NIXL's
    progress thread, which spins: 0.4-0.9 of a core per process measured on the 2-core machine), and
    it would take the CPU from the connector being timed, which on its own hosts it would not."""

    def __init__(self, children: list[Child]) -> None:
        self.pids = [ch.proc.pid for ch in children if ch.proc.poll() is None]

    def __enter__(self) -> paused:
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 2.0  # SIGSTOP lands asynchronously: wait until each has stopped
        while any(_state(pid) not in "Tt" for pid in self.pids) and time.monotonic() < deadline:
            time.sleep(0.0005)
        return self

    def __exit__(self, *exc: object) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped; "T" too where it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "T"


def same_block_ids(seen: list[tuple[list[int] | None, list[int] | None]], pages: int) -> bool:
    """Whether every connector's room moved the same blocks: ``seen`` holds each connector's
    (decode's ids, prefill's ids) for one room. Each list must name all ``pages`` blocks (an empty
    or short one is ids not seen, never "the same") and equal the first connector's."""
    first = seen[0] if seen else None
    return bool(seen) and all(b is not None and pb is not None and len(b) == len(pb) == pages and
                              (b, pb) == first for b, pb in seen)


def run(models: list[str], sizes: list[int], rooms: int, connectors: list[str], workdir: Path,
        pause: bool = True, kvbridge_staging: str = "auto") -> tuple[list, dict]:
    import numpy as np

    from kvbridge import start_bootstrap

    rows, skipped = [], {}
    for c in ("nixl", "kvbridge-nixl"):
        if c in connectors and (why := nixl_missing()):
            skipped[c] = why
            connectors = [x for x in connectors if x != c]
    with start_bootstrap(lease_ttl=10.0) as (url, token):
        for kind in models:
            bs = BLOCK[kind]
            model = workdir / f"model-{kind}"
            model.mkdir(exist_ok=True)
            (model / "config.json").write_text(json.dumps(MODELS[kind]))
            max_tokens = max(sizes)
            num_blocks = max_tokens // bs * 5 // 4 + 16
            children: dict[tuple[str, str], Child] = {}
            boot: dict[str, str] = {}  # Mooncake: the prefill's bootstrap server (host:port)
            live = []
            try:
                for c in connectors:
                    common = {"connector": c, "model": str(model), "block_size": bs, "num_blocks": num_blocks,
                              "max_tokens": max_tokens, "max_batched": 8192, "attention_backend": ATTENTION_BACKEND[kind], "tag": f"{kind}-{c}-{os.getpid()}",
                              "kvbridge_url": url, "kvbridge_token": token, "kvbridge_staging": kvbridge_staging,
                              "mooncake_bootstrap": f"127.0.0.1:{free_port()}"}  # fmt: skip
                    for role in ("kv_producer", "kv_consumer"):
                        cfg = {**common, "role": role, "engine_id": f"{common['tag']}-{role}",
                               "transfer_json": transfer_json(c, role, common),
                               "dist_port": free_port(),  # gloo's (world 1): picked here, beside the others
                               "env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}}
                        children[(c, role)] = _child(cfg, workdir / f"{kind}-{c}-{role}.log")
                    boot[c] = common["mooncake_bootstrap"]
                for c in connectors:
                    answers = [children[(c, r)].next(READY_S) for r in ("kv_producer", "kv_consumer")]
                    errors = [a["error"] for a in answers if not a["ready"]]
                    if errors:
                        skipped[f"{c} ({kind})"] = "; ".join(errors)
                    else:
                        live.append(c)
                rng = np.random.default_rng(0)
                counter = [0]

                def room(c: str, n: int, seed: int) -> dict:
                    counter[0] += 1
                    req_id = f"{kind}-{c}-{n}-{counter[0]}"
                    prompt = [int(t) for t in rng.integers(3, 500, n)]
                    pre, dec = children[(c, "kv_producer")], children[(c, "kv_consumer")]
                    params: dict[str, Any] = {"do_remote_decode": True}
                    if c == "mooncake":
                        params["transfer_id"] = req_id
                    p = pre.call(op="prefill", req_id=req_id, prompt=prompt, params=params, seed=seed)
                    if not p["ok"]:
                        return {"ok": False, "error": "prefill did not finish"}
                    dparams = p["params"]
                    if c == "mooncake":  # the proxy's params for decode (vLLM's mooncake proxy example)
                        dparams = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": req_id,
                                   "remote_engine_id": f"{kind}-{c}-{os.getpid()}-kv_producer",
                                   "remote_bootstrap_addr": f"http://{boot[c]}"}
                    # the timed part, with every other connector's processes stopped (--shared: left running)
                    others = [ch for (cc, _), ch in children.items() if cc != c] if pause else []
                    with paused(others):
                        d = dec.call(op="decode", req_id=req_id, prompt=prompt, params=dparams, seed=seed,
                                     pages=n // bs)
                    idle = pre.call(op="idle", timeout=60, req_id=req_id)
                    return {**d, "prefill_blocks": p["blocks"][: n // bs], "prefill_freed": idle["idle"],
                            "prefill_stats": idle["stats"]}

                for c in live:  # warm-up, not counted
                    room(c, min(sizes), 1)
                acc: dict[tuple[str, int], dict] = {}
                for n in sizes:
                    for i in range(rooms):
                        seed = 1000 + i * 7 + n  # the same block ids for every connector
                        blocks_seen = []
                        for c in live:
                            r = room(c, n, seed)
                            a = acc.setdefault((c, n), {"lat": [], "ok": 0, "failed": 0, "same_blocks": 0,
                                                        "freed": 0, "kvbridge": []})
                            if r.get("stats"):  # kvbridge's rooms: where the time went
                                a["kvbridge"].append({"decode": r["stats"], "prefill": r.get("prefill_stats")})
                            if r["ok"] and r.get("latency_s"):
                                a["lat"].append(r["latency_s"])
                                a["ok"] += r["wrong"] == 0
                            else:
                                a["failed"] += 1
                            a["freed"] += bool(r.get("prefill_freed"))
                            blocks_seen.append((r.get("blocks"), r.get("prefill_blocks")))
                        same = same_block_ids(blocks_seen, n // bs)
                        for c in live:
                            acc[(c, n)]["same_blocks"] += same
                layer_bytes = 0
                for c in live:
                    for n in sizes:
                        a = acc[(c, n)]
                        cfgm = MODELS[kind]
                        per_token = (cfgm["kv_lora_rank"] + cfgm["qk_rope_head_dim"]) * 2 if kind == "mla" else \
                            2 * cfgm["num_key_value_heads"] * cfgm["head_dim"] * 2
                        layer_bytes = per_token
                        nbytes = n * per_token * cfgm["num_hidden_layers"]
                        lat = a["lat"]
                        rows.append({"model": kind, "connector": c, "block": bs, "layers": cfgm["num_hidden_layers"],
                                     "bytes_per_token_layer": layer_bytes, "tokens": n, "rooms": rooms,
                                     "succeeded": len(lat), "failed": a["failed"], "bytes_ok": a["ok"],
                                     "same_blocks": a["same_blocks"], "prefill_freed": a["freed"],
                                     "mb_per_room": nbytes / 1e6, "others_paused": pause, "kvbridge_rooms": a["kvbridge"],
                                     "staging": kvbridge_staging if c in KVBRIDGE_ENGINE else None,
                                     "p50_ms": float(np.median(lat)) * 1e3 if lat else None,
                                     "gb_s": nbytes * len(lat) / sum(lat) / 1e9 if lat else None})  # fmt: skip
            finally:
                for ch in children.values():
                    if ch.proc.poll() is None and "consumer" in ch.name:
                        ch.stop()
                for ch in children.values():
                    ch.stop()
    for r in rows:  # each kvbridge row over each of vLLM's connectors, same model and size
        if r["connector"] not in KVBRIDGE_ENGINE:
            continue
        for peer in rows:
            if peer["model"] == r["model"] and peer["tokens"] == r["tokens"] and peer["connector"] not in KVBRIDGE_ENGINE:
                ok = r["gb_s"] and peer["gb_s"]
                r[f"gb_s_x_{peer['connector']}"] = r["gb_s"] / peer["gb_s"] if ok else None
                r[f"p50_x_{peer['connector']}"] = r["p50_ms"] / peer["p50_ms"] if ok else None
    return rows, skipped


def table(rows: list[dict], skipped: dict) -> str:
    peers = sorted({r["connector"] for r in rows} - set(KVBRIDGE_ENGINE))
    head = (f"{'model':<5} {'connector':<13} {'block':>5} {'layers':>6} {'tokens':>6} {'MB/room':>8} {'rooms':>5} "
            f"{'ok':>3} {'bytes ok':>8} {'same ids':>8} {'p50 ms':>8} {'GB/s':>6}"
            + "".join(f" {'GB/s x ' + p:>16} {'p50 x ' + p:>15}" for p in peers))
    out = ["vLLM peer benchmark: scattered blocks, Mooncake TCP (and UCX TCP) loopback, one room at a time; "
           "kvbridge = kvbridge's connector on Mooncake, kvbridge-nixl = on its NIXL engine (UCX, as NixlConnector); "
           "x <peer> = this kvbridge row's GB/s over the peer's, its p50 over the peer's", head]

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in rows:
        line = (f"{r['model']:<5} {r['connector']:<13} {r['block']:>5} {r['layers']:>6} {r['tokens']:>6} "
                f"{r['mb_per_room']:>8.1f} {r['rooms']:>5} {r['succeeded']:>3} {r['bytes_ok']:>8} "
                f"{r['same_blocks']:>8} {f(r['p50_ms'], '8.1f')} {f(r['gb_s'], '6.2f')}")
        for p in peers:
            line += f" {f(r.get('gb_s_x_' + p), '16.2f')} {f(r.get('p50_x_' + p), '15.2f')}"
        out.append(line)
    for name, why in skipped.items():
        out.append(f"not run: {name}: {why}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="rooms of 1K tokens (GQA) and 512 (MLA), 1 room a size (CI)")
    ap.add_argument("--models", default="gqa,mla", help="gqa (Llama-shaped, 2 KV heads x 64, 16 layers, block 128) "
                    "and/or mla (DeepSeek V3-shaped latent 576, 8 layers, block 16)")
    ap.add_argument("--sizes", default="8192,32768", help="request sizes in tokens, multiples of 128")
    ap.add_argument("--rooms", type=int, default=None, help="counted rooms per size and connector (default 3; --quick 1)")
    ap.add_argument("--connectors", default=",".join(CONNECTORS), help=f"any of {','.join(CONNECTORS)}")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    ap.add_argument("--logs", default="", help="keep the children's logs in this directory")
    ap.add_argument("--shared", action="store_true", help="leave the other connectors' processes running while "
                    "one connector's decode is timed (default: stopped, SIGSTOP/SIGCONT)")
    ap.add_argument("--kvbridge-staging", default="auto", choices=("auto", "always", "never"),
                    help="kvbridge's rows only: its connector's staging setting (default auto; always/never force "
                    "the staged or direct path, recorded in each row as 'staging')")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    sizes = [1024] if args.quick else [int(s) for s in args.sizes.split(",")]
    if any(s <= 0 or s % 128 for s in sizes):
        ap.error("--sizes must be positive multiples of 128")
    rooms = args.rooms or (1 if args.quick else 3)
    models = [m for m in args.models.split(",") if m]
    connectors = [c for c in args.connectors.split(",") if c]
    if any(m not in MODELS for m in models) or any(c not in CONNECTORS for c in connectors):
        ap.error(f"--models from {sorted(MODELS)}, --connectors from {CONNECTORS}")
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        rows, skipped = run(models, sizes, rooms, connectors, Path(args.logs), pause=not args.shared,
                                 kvbridge_staging=args.kvbridge_staging)
    else:
        with tempfile.TemporaryDirectory(prefix="vllm-peer-bench-") as tmp:
            rows, skipped = run(models, sizes, rooms, connectors, Path(tmp), pause=not args.shared,
                                 kvbridge_staging=args.kvbridge_staging)
    print(table(rows, skipped))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "not_run": skipped}, indent=1))
    bad = [r for r in rows if r["failed"] or r["bytes_ok"] != r["rooms"]]
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    sys.exit(main())

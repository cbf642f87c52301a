"""One SGLang rank's memory and KV manager, built from SGLang's own classes on the CPU,
and the metadata row a request carries (``_sgl_sched.py`` drives them).

A rank is SGLang's ``DSATokenToKVPool`` (MLA latent + NSA index K, DeepSeek V3.2's
cache) and an ``MLATokenToKVPool`` for the NextN draft layer; SGLang's
``MetadataBuffers`` and ``ReqToMetadataIdxAllocator``; a ``KVArgs`` filled the way
``PrefillBootstrapQueue._init_kv_manager`` and ``DecodePreallocQueue._init_kv_manager``
fill it (SGLang's ``get_kv_transfer_buf_infos``, ``build_kv_layer_ids``,
``setup_state_kv_args``, ``MetadataBuffers.get_buf_infos``); and the manager SGLang
would get from ``get_kv_class(TransferBackend.KVBRIDGE, ...)`` (looked up at call time:
``install()`` re-points only SGLang's own modules). Its place in the
attention DP x CP x TP grid is stamped into SGLang's ``get_parallel()`` before its
pools and manager are built, so several ranks share one process.

A pipeline stage (``pp_rank``/``pp_size`` in its ranks) holds SGLang's share of a model of
``layers`` target layers (``get_pp_indices``, as ``make_pp_layers`` splits them): its pools start
at the stage's first layer, its ``KVArgs`` carry ``prefill_start_layer``/``prefill_end_layer``, and,
as on CUDA without ``SGLANG_ENABLE_PP_SPEC``, every stage lists the draft pool (``stage_draft``
False: only the last stage does, as with it). ``buffers`` and ``specs`` are the stage's own layers.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.distributed.utils import get_pp_indices
from sglang.srt.disaggregation import utils as disagg_utils
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    KVClassType,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    TransferBackend,
    build_kv_layer_ids,
    get_kv_transfer_buf_infos,
    get_pd_kv_layout,
    is_mla_backend,
    setup_state_kv_args,
)
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs

from kvbridge.worker.synthetic import PAD_BYTE, SENTINEL_BYTE, as_bytes, token_bytes

PAGE, LAYERS, POOL_PAGES, META_ROWS = 64, 2, 24, 12
HIDDEN, TOP_LOGPROBS, DSA_TOPK = 32, 4, 8
MHA_HEAD_DIM = 16  # bf16: 32 B per head per token
NOT_COMPUTED = 0xC3  # prefill rows no chunk has computed yet: an early page would carry them
PREFIX_MARK = 0x11  # decode pages of a cached prefix: never written by a transfer


@contextlib.contextmanager
def environ(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class RankWorld:
    """One SGLang rank's memory and KV manager (see the module docstring)."""

    def __init__(self, role: str, server_args: ServerArgs, ranks: dict[str, int], env: dict[str, str],
                 mha_heads: int = 0, layers: int = LAYERS, stage_draft: bool = True) -> None:
        """``mha_heads`` > 0: an MHA/GQA model instead (SGLang's ``MHATokenToKVPool``, that many KV
        heads in the whole row, sharded over attention TP as SGLang shards them; no draft). The
        metadata rows carry SGLang's KV checksum when the server arguments enable it."""
        get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, **ranks)
        self.role, self.ranks, self.mha_heads, self.layers = role, ranks, mha_heads, layers
        pp_rank, pp_size = ranks.get("pp_rank", 0), ranks.get("pp_size", 1)
        self.stage = get_pp_indices(layers, pp_rank, pp_size)
        self.with_draft = stage_draft or pp_rank == pp_size - 1
        if mha_heads:
            self._mha_pools(mha_heads, ranks.get("attn_tp_size", 1))
        else:
            self._dsa_pools()
        self.meta = MetadataBuffers(META_ROWS, hidden_size=HIDDEN, hidden_states_dtype=torch.bfloat16,
                                    max_sampling_mask_tokens=16, max_top_logprobs_num=TOP_LOGPROBS,
                                    output_dsa_topk_indices_dim=DSA_TOPK,
                                    kv_checksum_enabled=bool(server_args.disaggregation_enable_kv_checksum))
        self.meta_alloc = ReqToMetadataIdxAllocator(META_ROWS)
        self.kv_args = self._kv_args(ranks.get("attn_tp_rank", 0))
        with environ(env):
            manager = disagg_utils.get_kv_class(TransferBackend.KVBRIDGE, KVClassType.MANAGER)
            mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
            self.mgr = manager(self.kv_args, mode, server_args, is_mla_backend(self.pool))
        # the specs this rank's endpoint uses (head-sharded k/v: this rank's heads; a stage: its layers)
        if self.mgr.stage is not None:
            self.specs = self.mgr.endpoint.specs
        else:
            self.specs = self.mgr.contract("replicated", mha_heads or None)[0]
        tensors = {t.data_ptr(): t for t in self._tensors()}
        self.buffers = {(p.name, layer): as_bytes(tensors[b.ptr], p.bytes_per_page)
                        for p in self.mgr.cache.pools.values() for layer, b in zip(p.layer_ids, p.buffers)
                        if p.name in self.specs and layer in self.specs[p.name].layer_ids}
        for buf in self.buffers.values():
            buf[:] = NOT_COMPUTED if role == "prefill" else SENTINEL_BYTE

    def _mha_pools(self, heads: int, tp_size: int) -> None:
        local = max(1, heads // tp_size)  # SGLang: get_num_kv_heads(tp_size)
        self.pool = MHATokenToKVPool(size=POOL_PAGES * PAGE, page_size=PAGE, dtype=torch.bfloat16, head_num=local,
                                     head_dim=MHA_HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                                     enable_alt_stream=False)  # fmt: skip
        self.draft = None

    def _tensors(self) -> list[torch.Tensor]:
        if self.mha_heads:
            return [*self.pool.k_buffer, *self.pool.v_buffer]
        draft = self.draft.kv_buffer if self.draft is not None else []
        return [*self.pool.kv_buffer, *draft, *self.pool.index_k_with_scale_buffer]

    def _dsa_pools(self) -> None:
        start, end = self.stage
        self.pool = DSATokenToKVPool(size=POOL_PAGES * PAGE, page_size=PAGE, kv_lora_rank=512, dtype=torch.bfloat16,
                                     qk_rope_head_dim=64, layer_num=end - start, device="cpu", index_head_dim=128,
                                     enable_memory_saver=False, kv_cache_dim=576, start_layer=start, end_layer=end)
        self.draft = MLATokenToKVPool(size=POOL_PAGES * PAGE, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=512,
                                      qk_rope_head_dim=64, layer_num=1, device="cpu", enable_memory_saver=False,
                                      start_layer=self.layers) if self.with_draft else None

    def _kv_args(self, engine_rank: int) -> KVArgs:
        """As ``PrefillBootstrapQueue._init_kv_manager`` / ``DecodePreallocQueue._init_kv_manager``."""
        kv_args = KVArgs()
        kv_args.engine_rank, kv_args.pp_rank, kv_args.system_dp_rank = engine_rank, self.ranks.get("pp_rank", 0), 0
        kv_args.kv_cache_dtype_str = "auto"
        kv_args.kv_layout = get_pd_kv_layout(self.pool)
        kv_args.prefill_start_layer = self.pool.start_layer
        kv_args.prefill_end_layer = getattr(self.pool, "end_layer", None)
        ptrs, lens, items = get_kv_transfer_buf_infos(self.pool)
        dptrs, dlens, ditems = self.draft.get_contiguous_buf_infos() if self.draft is not None else ([], [], [])
        kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs + dptrs, lens + dlens, items + ditems
        kv_args.num_draft_entries = len(dptrs)
        kv_args.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=self.pool, draft_token_to_kv_pool=self.draft,
                                                  num_draft_entries=len(dptrs), num_hidden_layers=self.layers)
        kv_args.page_size = self.pool.page_size
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = self.meta.get_buf_infos()
        kv_args.ib_device, kv_args.gpu_id = None, 0
        if self.mha_heads and self.role == "prefill":  # PrefillBootstrapQueue._init_kv_manager (decode: not set)
            kv_args.kv_head_num, kv_args.total_kv_head_num = self.pool.head_num, self.mha_heads
        setup_state_kv_args(kv_args, self.pool, self.draft, self.layers, req_to_token_pool=None)
        return kv_args

    def write_rows(self, room: int, pages: np.ndarray, start: int, end: int, num_tokens: int, shard: int) -> None:
        """A chunk "runs": rows ``[start, end)`` of every pool and layer land in their pages (the
        last chunk also writes the last page's compute padding). With a KV shard of N ranks,
        this rank holds page id p (p % N == its rank) as local page p // N."""
        tokens = np.arange(start, end if end < num_tokens else -(-num_tokens // PAGE) * PAGE)
        page_ids = pages[tokens // PAGE]
        if shard > 1:
            mine = page_ids % shard == self.ranks["attn_tp_rank"]
            tokens, page_ids = tokens[mine], page_ids[mine] // shard
        slots = page_ids * PAGE + tokens % PAGE
        for (pool, layer), buf in self.buffers.items():
            spec = self.specs[pool]
            rows = token_bytes(room, pool, layer, tokens, spec.full_bytes_per_token)
            if spec.head_sharded:  # this rank's heads of the whole row
                rows = np.ascontiguousarray(rows[:, spec.head_start * spec.head_bytes : spec.head_stop * spec.head_bytes])
            rows[tokens >= num_tokens] = PAD_BYTE
            spec.write_rows(buf, slots, rows)


def expected_metadata(room: int) -> dict[str, Any]:
    """What prefill's ``MetadataBuffers.set_buf`` writes for a room (its first token, cached
    counts, logprobs, the NextN draft state): deterministic per room."""
    rng = np.random.default_rng(room)
    return dict(
        first_token=int(room % 50_000 + 1), cached=[int(room % 5), 2, 1, 0],
        logprob=float(-rng.random()), top_val=rng.random(TOP_LOGPROBS).astype(np.float32).tolist(),
        top_idx=rng.integers(0, 50_000, TOP_LOGPROBS).tolist(), topk_p=float(rng.random()),
        topk_index=int(rng.integers(0, 50_000)), hidden=rng.standard_normal(HIDDEN).astype(np.float32).tolist(),
        dsa_topk=rng.integers(0, 4096, DSA_TOPK).tolist(),
    )  # fmt: skip


def metadata_req(room: int, meta_idx: int) -> SimpleNamespace:
    """A request as ``MetadataBuffers.set_buf`` reads it."""
    m = expected_metadata(room)
    logprob = SimpleNamespace(output_token_logprobs_val=[m["logprob"]], output_token_logprobs_idx=[m["first_token"]],
                              output_top_logprobs_val=[m["top_val"]], output_top_logprobs_idx=[m["top_idx"]])
    return SimpleNamespace(
        metadata_buffer_index=meta_idx, output_ids=[m["first_token"]], cached_tokens=m["cached"][0],
        cached_tokens_device=m["cached"][1], cached_tokens_host=m["cached"][2], cached_tokens_storage=m["cached"][3],
        get_mm_token_counts=lambda: (0, 0, 0), return_logprob=True, logprob=logprob, return_sampling_mask=False,
        hidden_states_tensor=torch.tensor(m["hidden"], dtype=torch.bfloat16),
        output_topk_p=torch.tensor([m["topk_p"]]), output_topk_index=torch.tensor([m["topk_index"]]),
        output_dsa_topk_indices=torch.tensor(m["dsa_topk"], dtype=torch.int32), bootstrap_room=room,
    )  # fmt: skip


def metadata_errors(bufs: tuple, room: int) -> list[str]:
    """Check what decode's ``MetadataBuffers.get_buf`` returns against ``expected_metadata``."""
    m = expected_metadata(room)
    (out_ids, cached, lp_val, lp_idx, top_val, top_idx, _, _, _, topk_p, topk_index, hidden, dsa, echo) = bufs
    got = dict(first_token=int(out_ids[0]), cached=cached[:4].tolist(), logprob=float(lp_val[0]),
               top_val=top_val[:TOP_LOGPROBS].tolist(), top_idx=top_idx[:TOP_LOGPROBS].tolist(),
               topk_p=float(topk_p[0]), topk_index=int(topk_index[0]), hidden=hidden.float().tolist(),
               dsa_topk=dsa.tolist())  # fmt: skip
    want = dict(m, hidden=torch.tensor(m["hidden"], dtype=torch.bfloat16).float().tolist(),
                top_val=np.asarray(m["top_val"], np.float32).tolist(), logprob=float(np.float32(m["logprob"])),
                topk_p=float(np.float32(m["topk_p"])))  # fmt: skip
    errors = [f"room {room}: metadata {k} = {got[k]!r}, expected {want[k]!r}" for k in want if got[k] != want[k]]
    if int(echo[0]) != room:
        errors.append(f"room {room}: bootstrap_room echo {int(echo[0])}")
    return errors


def server_args(role: str, bootstrap_port: int = 8998, sharding: bool = False, **more: Any) -> ServerArgs:
    kw = dict(model_path="tiny-deepseek-v3.2", served_model_name="tiny-deepseek-v3.2", disaggregation_mode=role,
              disaggregation_transfer_backend="kvbridge", host="127.0.0.1", disaggregation_bootstrap_port=bootstrap_port,
              speculative_algorithm="NEXTN", speculative_eagle_topk=1, dtype="bfloat16",
              enable_kv_cache_sharding=sharding)  # fmt: skip
    return ServerArgs(**{**kw, **more})


# An MHA/GQA model (no draft): what server_args() takes for it.
MHA_ARGS = dict(model_path="tiny-gqa", served_model_name="tiny-gqa", speculative_algorithm=None,
                speculative_eagle_topk=None)  # fmt: skip

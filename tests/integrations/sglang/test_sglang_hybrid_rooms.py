"""Hybrid models moved END TO END through kvbridge's rooms by kvbridge's SGLang backend, each
through SGLang 0.5.23's REAL pool classes on the CPU: a Mamba hybrid (Qwen3-Next class:
``HybridLinearKVPool`` + ``MambaPool``), a sliding-window model (gpt-oss class: ``SWAKVPool``) and
DeepSeek-V4 (``DeepSeekV4TokenToKVPool``, the CUDA layout: FlashMLA pages padded to whole 576-byte
rows, C4 compressor rings per SWA page, C128 state by request row; and ``v4-fp8``, its uniform fp8
pool under ``--dsv4-attn-backend trtllm``: 512 e4m3 B a row, no scales, no padding; both construct
on the CPU, ``KVArgs.kv_layout`` from SGLang's ``get_pd_kv_layout``), with
``MetadataBuffers``; their ``KVArgs`` filled by SGLang's own ``setup_state_kv_args`` (and, for V4,
``get_contiguous_buf_infos``, as SGLang's ``_init_kv_manager`` does), kvbridge's real manager, sender
and receiver (through ``get_kv_class``), a prefill and a decode endpoint in this process at one
cluster daemon, real Mooncake TCP on loopback between two engines.

Driven as SGLang's schedulers drive a backend: decode's metadata goes through SGLang's own
``DecodePreallocQueue._send_kv_metadata`` (kvbridge's hook, patches.py, hands the receiver the
token count and the request first; the queue around it is a namespace with what that method
reads); prefill sends two chunks, the last with SGLang's state indices as its payload builders make
them (``_mamba_payload``, ``_swa_payload``, V4's ``request_state_transfer_indices``). Every byte
decode needs is compared with the prefill bytes SGLang's own addressing names (for V4's C4 rings,
``translate_from_swa_loc_to_state_loc``), every other byte of decode's pools must keep its poison
(padding after each V4 page included), and the bytes posted are the bytes needed, no more."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.disaggregation.utils", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

import _sgl_world as world  # noqa: E402
from kvbridge.integrations.sglang.building import building  # noqa: E402
from _sgl_procs import CHILD_ENV, free_port  # noqa: E402

PAGE, TOKENS, SLOTS = 16, 256, 4
Q, K_, V_, HEADS = 32, 32, 64, 4
POISON = 0x5A
RANKS = {"attn_cp_rank": 0, "attn_cp_size": 1, "attn_tp_rank": 0, "attn_tp_size": 1, "attn_dp_rank": 0,
         "attn_dp_size": 1, "pp_rank": 0, "pp_size": 1}  # fmt: skip


WINDOW = 40  # the scheduler's sliding_window_size of the SWA model
V4_PAGE, V4_WINDOW = 256, 128  # DeepSeek-V4: KV and SWA page, sliding window


def _swa_pool():
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=TOKENS, size_swa=128, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=8,
                     swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3], device="cpu")


def _mamba_pool(tp: int = 1, stage: tuple[int, int] = (0, 4)):
    """Mamba layers 0 and 2, full attention 1 and 3; a pipeline stage's pool holds its own layers."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    mamba, full = [i for i in (0, 2) if stage[0] <= i < stage[1]], [i for i in (1, 3) if stage[0] <= i < stage[1]]
    shape = Mamba2StateShape.create(tp_world_size=tp, intermediate_size=V_, n_groups=2, num_heads=HEADS, head_dim=16,
                                    state_size=16, conv_kernel=4, conv_shard_groups=[Q, K_, V_])
    mp = MambaPool(size=SLOTS, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=mamba),
                   mamba_layer_ids=mamba, device="cpu")
    return HybridLinearKVPool(size=TOKENS, dtype=torch.bfloat16, page_size=PAGE, head_num=1, head_dim=8,
                              full_attention_layer_ids=full, device="cpu", mamba_pool=mp, start_layer=stage[0])


def _v4_pool(dtype=None):
    """DeepSeek-V4's pool as SGLang builds it for CUDA (FlashMLA layout; under ``--dsv4-attn-backend
    trtllm`` with an fp8 dtype, its uniform fp8 pool; both construct on the CPU): layers of ratios
    128, 128, 4, 128; KV and SWA pages of 256 tokens; window 128."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return DeepSeekV4TokenToKVPool(max_num_reqs=4, swa_size=1024, c4_size=512, c128_size=16, c4_state_pool_size=64,
                                   c128_state_pool_size=8, page_size=V4_PAGE, swa_page_size=V4_PAGE,
                                   dtype=dtype or torch.uint8, c4_state_dtype=torch.float32,
                                   c128_state_dtype=torch.float32,
                                   qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, layer_num=4,
                                   device="cpu", enable_memory_saver=False, compression_ratios=[128, 128, 4, 128],
                                   sliding_window=V4_WINDOW)


class Rank:
    """One SGLang rank of the hybrid model: its pools, metadata rows, KVArgs and kvbridge manager."""

    def __init__(self, role: str, port: int, env: dict[str, str], model: str, tp: tuple[int, int] = (1, 0),
                 kv_heads: int = 0, serve_port: int = 0, pp: tuple[int, int] = (0, 1),
                 stage: tuple[int, int] = (0, 4), config: bool = False) -> None:
        """``pp`` (rank, size) and ``stage``: a pipeline stage holding layers ``stage`` (mamba);
        ``config``: the queue carries the model config (Qwen3-Next's layer pattern, SGLang's class)."""
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.utils import (DisaggregationMode, KVClassType, MetadataBuffers,
                                                     ReqToMetadataIdxAllocator, TransferBackend, build_kv_layer_ids,
                                                     get_kv_class, get_kv_transfer_buf_infos, get_pd_kv_layout,
                                                     is_mla_backend, setup_state_kv_args)
        from sglang.srt.disaggregation.prefill import _transfer_start_layer
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0,
                                            **{**RANKS, "pp_rank": pp[0], "pp_size": pp[1],
                                               "attn_tp_size": tp[0], "attn_tp_rank": tp[1], "tp_size": tp[0],
                                               "tp_rank": tp[1], "moe_tp_size": tp[0], "moe_ep_size": 1,
                                               "moe_dp_size": 1})
        self.model = model
        self.pool = _mamba_pool(tp[0], stage) if model == "mamba" else {
            "swa": _swa_pool, "v4": _v4_pool, "v4-fp8": lambda: _v4_pool(torch.float8_e4m3fn)}[model]()
        v4 = model.startswith("v4")
        self.meta = MetadataBuffers(world.META_ROWS, hidden_size=world.HIDDEN, hidden_states_dtype=torch.bfloat16,
                                    max_sampling_mask_tokens=16, max_top_logprobs_num=world.TOP_LOGPROBS,
                                    output_dsa_topk_indices_dim=world.DSA_TOPK, kv_checksum_enabled=False)
        self.meta_alloc = ReqToMetadataIdxAllocator(world.META_ROWS)
        a = KVArgs()  # as PrefillBootstrapQueue._init_kv_manager / DecodePreallocQueue._init_kv_manager fill it
        a.engine_rank, a.pp_rank, a.system_dp_rank, a.kv_cache_dtype_str = 0, pp[0], 0, "auto"
        a.kv_layout, a.prefill_start_layer, a.prefill_end_layer = get_pd_kv_layout(self.pool), 0, None
        a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = get_kv_transfer_buf_infos(self.pool)
        a.num_draft_entries = 0
        a.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=self.pool, draft_token_to_kv_pool=None,
                                            num_draft_entries=0, num_hidden_layers=4)
        a.page_size, a.ib_device, a.gpu_id = V4_PAGE if v4 else PAGE, None, 0
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = self.meta.get_buf_infos()
        setup_state_kv_args(a, self.pool, None, 4, req_to_token_pool=None)
        hf = None
        if config:
            from sglang.srt.configs.qwen3_next import Qwen3NextConfig

            hf = Qwen3NextConfig(num_hidden_layers=4, full_attention_interval=2)  # full attention 1, 3; linear 0, 2
            a.prefill_start_layer = _transfer_start_layer(pool=self.pool, hf_text_config=hf)
        if kv_heads:  # as PrefillBootstrapQueue._init_kv_manager sets them for MHA/GQA
            a.kv_head_num, a.total_kv_head_num = self.pool.full_kv_pool.head_num, kv_heads
        self.kv_args = a
        more = world.MHA_ARGS if not v4 else dict(model_path="tiny-deepseek-v4", served_model_name="tiny-v4",
                                                          speculative_algorithm=None, speculative_eagle_topk=None)
        args = world.server_args(role, port, port=serve_port or free_port(), **more)  # (port: names the instance)
        # the queue SGLang's _init_kv_manager runs on (patches.py names it): the pool and the window
        window = V4_WINDOW if v4 else WINDOW
        queue = SimpleNamespace(token_to_kv_pool=self.pool, scheduler=SimpleNamespace(sliding_window_size=window))
        if hf is not None:  # what kvbridge reads of SGLang's ModelConfig
            queue.scheduler.model_config = SimpleNamespace(num_hidden_layers=4, hf_text_config=hf,
                                                           full_attention_layer_ids=None, swa_attention_layer_ids=None)
        with world.environ(env), building(queue):
            manager = get_kv_class(TransferBackend.KVBRIDGE, KVClassType.MANAGER)
            mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
            self.mgr = manager(a, mode, args, is_mla_backend(self.pool))
        get_parallel().clear_stamp()

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        if self.model.startswith("v4"):
            p = self.pool
            return {"c4": list(p.kv_pools[4].kv_buffer), "c4_index": list(p.index_pools[4].index_k_with_scale_buffer),
                    "c128": list(p.kv_pools[128].kv_buffer), "swa": list(p.swa_kv_pool.kv_buffer),
                    "c4_state": [p.compress_state_pools[2].kv_score_buffer.kv_score],
                    "c4_index_state": [p.indexer_compress_state_pools[2].kv_score_buffer.kv_score],
                    "c128_state": [p.compress_state_pools[i].kv_score_buffer.kv_score for i in (0, 1, 3)]}
        if self.model == "swa":
            full, swa = self.pool.full_kv_pool, self.pool.swa_kv_pool
            return {"k": list(full.k_buffer), "v": list(full.v_buffer), "swa_k": list(swa.k_buffer),
                    "swa_v": list(swa.v_buffer)}
        c = self.pool.mamba_pool.mamba_cache
        return {"k": list(self.pool.full_kv_pool.k_buffer), "v": list(self.pool.full_kv_pool.v_buffer),
                "conv": list(c.conv[0]), "temporal": list(c.temporal)}


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def _runs(starts: np.ndarray, length: int) -> np.ndarray:
    """Byte indices of runs of ``length`` bytes from each of ``starts``."""
    return (np.asarray(starts, np.int64)[:, None] + np.arange(length)).reshape(-1)


def _rows(t: torch.Tensor, rows: np.ndarray) -> np.ndarray:
    """Byte indices of whole rows (first-axis items) of ``t``."""
    width = t[0].nbytes
    return _runs(np.asarray(rows) * width, width)


@contextlib.contextmanager
def _pair(daemon, model: str, staging: dict[str, str] | None = None):
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    from kvbridge.integrations.sglang import install

    install()
    env = {**CHILD_ENV, "KVBRIDGE_BOOTSTRAP_URL": daemon.url, **(staging or {})}
    port = free_port()
    backend = {"dsv4_attn_backend": "trtllm"} if model == "v4-fp8" else {}  # SGLang's uniform fp8 V4 pool
    with use_context(create_context(ServerArgs(model_path="dummy", device="cpu", **backend), role="scheduler")):
        prefill = Rank("prefill", port, env, model)
        try:
            decode = Rank("decode", 8998, env, model)
            try:
                yield SimpleNamespace(prefill=prefill, decode=decode, addr=f"127.0.0.1:{port}")
            finally:
                decode.mgr.close()
        finally:
            prefill.mgr.close()


def _until(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# -- the three models' requests: what SGLang hands each side, and what decode needs of it --------

def _open_receiver(d, addr: str, room: int, n: int, dst_pages: np.ndarray, page: int, dst_state, row: int = 0):
    """Decode's side of a room as SGLang opens it: the receiver, its prefill instance, then SGLang's
    own ``DecodePreallocQueue._send_kv_metadata`` (kvbridge's hook inside) with ``n`` tokens on
    ``dst_pages`` and the state indices ``dst_state``: the receiver and SGLang's decode request
    (its ``metadata_buffer_index`` is the row SGLang allocated for the room)."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.mem_cache.common import kv_to_page_indices

    receiver = get_kv_class(TransferBackend.KVBRIDGE, KVClassType.RECEIVER)(mgr=d.mgr, bootstrap_addr=addr,
                                                                            bootstrap_room=room)
    _until(lambda: d.mgr.try_ensure_parallel_info(addr))
    receiver.init(0)
    dst_tokens = torch.as_tensor(np.repeat(dst_pages, page) * page + np.tile(np.arange(page), dst_pages.size))
    queue = SimpleNamespace(req_to_metadata_buffer_idx_allocator=d.meta_alloc, transfer_queue=SimpleNamespace(
        enable_staging=False), _num_published_destinations=0,
        _transfer_page_indices=lambda dr, kv, ps: kv_to_page_indices(kv, ps).astype(np.int32))
    req = SimpleNamespace(origin_input_ids=list(range(n)), output_ids=[], bootstrap_room=room,
                          kv=SimpleNamespace(req_pool_idx=row),
                          time_stats=SimpleNamespace(set_decode_transfer_queue_entry_time=lambda: None))
    decode_req = SimpleNamespace(req=req, kv_receiver=receiver, is_rebootstrap=False, metadata_buffer_index=-1)
    DecodePreallocQueue._send_kv_metadata(queue, decode_req, dst_tokens[:n], page, dst_state, decode_prefix_len=0)
    return receiver, decode_req


def _mamba_case(p: Rank, d: Rank, specs) -> SimpleNamespace:
    """50 tokens on k/v pages, the request's MambaPool slot (1 on prefill, 3 on decode)."""
    assert {n: s.kind for n, s in specs.items()} == {"k": "paged", "v": "paged", "mamba_0": "state",
                                                     "mamba_1": "state"}
    assert p.mgr.cache.state_of == {"mamba_0": "mamba", "mamba_1": "mamba"}
    n, src_pages, dst_pages, src_slot, dst_slot = 50, np.array([3, 9, 1, 6]), np.array([7, 2, 12, 5]), 1, 3
    src, dst = p.tensors(), d.tensors()
    tok = np.arange(n)
    s_rows, d_rows = src_pages[tok // PAGE] * PAGE + tok % PAGE, dst_pages[tok // PAGE] * PAGE + tok % PAGE
    moves = [(name, i, _rows(s, s_rows), _rows(t, d_rows)) for name in ("k", "v")
             for i, (s, t) in enumerate(zip(src[name], dst[name]))]
    moves += [(name, i, _rows(s, [src_slot]), _rows(t, [dst_slot])) for name in ("conv", "temporal")
              for i, (s, t) in enumerate(zip(src[name], dst[name]))]
    # bytes posted: the k/v rows, both tensors' slot of both layers and the aux row, no more
    slot = sum(specs[m].bytes_per_token for m in ("mamba_0", "mamba_1"))
    return SimpleNamespace(n=n, chunk=32, page=PAGE, src_pages=src_pages, dst_pages=dst_pages,
                           src_state=[[np.asarray(src_slot)]], dst_state=[[np.asarray(dst_slot)]], moves=moves,
                           needed=2 * 2 * n * specs["k"].bytes_per_token + 2 * slot, rows=(0, 0))


def _swa_case(p: Rank, d: Rank, specs) -> SimpleNamespace:
    """gpt-oss class: SWAKVPool, full-attention k/v on layers 1 and 3, SWA k/v on layers 0 and 2 on
    pages of their own pool. The window (the scheduler's sliding_window_size, read off the queue
    that builds the manager) decides what travels: SGLang's _swa_payload hands both sides the SWA
    pages from floor((n - W) / page); kvbridge writes rows [n - W, n) of them, with the last chunk
    (the SWA pages' ids come only then), and nothing of the pages before the window."""
    assert {n: (s.kind, s.window) for n, s in specs.items()} == {
        "k": ("paged", 0), "v": ("paged", 0), "swa_k": ("window", WINDOW), "swa_v": ("window", WINDOW)}
    assert specs["swa_k"].layer_ids == (0, 2)  # the SWA pool's layers_mapping
    n = 100
    src_pages, dst_pages = np.array([3, 9, 1, 6, 11, 2, 8]), np.array([7, 2, 12, 5, 10, 1, 4])
    first = (n - WINDOW) // PAGE  # SGLang's window_start page
    src_swa = np.array([0, 0, 0, 5, 1, 7, 2])  # the SWA pool's pages of the window's logical pages 3..6
    dst_swa = np.array([6, 3, 0, 4])
    src, dst = p.tensors(), d.tensors()
    tok, win = np.arange(n), np.arange(n - WINDOW, n)
    rows = {"k": (src_pages[tok // PAGE] * PAGE + tok % PAGE, dst_pages[tok // PAGE] * PAGE + tok % PAGE),
            "swa_k": (src_swa[win // PAGE] * PAGE + win % PAGE, dst_swa[win // PAGE - first] * PAGE + win % PAGE)}
    rows["v"], rows["swa_v"] = rows["k"], rows["swa_k"]
    moves = [(name, i, _rows(s, rows[name][0]), _rows(t, rows[name][1])) for name in rows
             for i, (s, t) in enumerate(zip(src[name], dst[name]))]
    needed = 2 * 2 * n * specs["k"].bytes_per_token + 2 * 2 * WINDOW * specs["swa_k"].bytes_per_token
    return SimpleNamespace(n=n, chunk=64, page=PAGE, src_pages=src_pages, dst_pages=dst_pages,  # chunk 1: page 3
                           src_state=[src_swa[first:].astype(np.int32)], dst_state=[dst_swa.astype(np.int32)],
                           moves=moves, needed=needed, rows=(0, 0))


def _v4_case(p: Rank, d: Rank, specs, uniform: bool = False) -> SimpleNamespace:
    """DeepSeek-V4, 515 tokens (not a multiple of 4 or 128) on three KV pages of 256, in chunks of
    256 and 259. What decode needs, as SGLang addresses it: the complete compressed entries (C4 KV
    and indexer K: 128 = two whole pages of 64; C128: 4 = two pages of 2) on the KV pages; the
    window's 128 rows on SGLang's SWA pages (the pages from floor((n - W) / page): two); the C4
    compressor rings' rows of the last 8 positions, which straddle the two SWA pages (positions
    507..511 on the first page's ring, 512..514 on the second's); the C128 state's n % 128 = 3 live
    rows of the request's ring. Values and scales of each row, never the padding after a page.
    ``uniform``: SGLang's uniform fp8 pool (trtllm): 512 e4m3 B a row, no scales, no padding."""
    value, scale, dtype = (512, 0, "fp8_e4m3") if uniform else (576, 8, "v4_fp8_nope_bf16_rope")
    assert {n: (s.kind, s.page_stride) for n, s in specs.items()} == {
        "c4": ("compressed", 0 if uniform else 37_440), "c4_index": ("compressed", 0),
        "c128": ("compressed", 0 if uniform else 1_728), "swa": ("window", 0 if uniform else 149_760),
        "c4_state": ("window", 0), "c4_index_state": ("window", 0), "c128_state": ("state", 0)}
    assert {specs[n].dtype for n in ("c4", "c128", "swa")} == {dtype}
    n, first = 515, (515 - V4_WINDOW) // V4_PAGE
    src_pages, dst_pages, src_swa, dst_swa, p_row, d_row = [4, 1, 7], [2, 8, 5], [3, 0], [1, 4], 1, 3
    src_pages, dst_pages, src_swa, dst_swa = map(np.array, (src_pages, dst_pages, src_swa, dst_swa))
    src, dst = p.tensors(), d.tensors()
    moves = []

    def entries(name, ratio, per_page, value, scale):  # values then scales of each complete entry, by page
        e = np.arange(n // ratio)
        for i, (s, t) in enumerate(zip(src[name], dst[name])):
            idx = []
            for pages in (src_pages, dst_pages):
                base = pages[e // per_page] * s[0].nbytes  # the page's stride: its padded size
                idx.append(np.concatenate([_runs(base + e % per_page * value, value),
                                           _runs(base + per_page * value + e % per_page * scale, scale)]))
            moves.append((name, i, *idx))

    entries("c4", 4, 64, value, scale)
    entries("c4_index", 4, 64, 128, 4)
    entries("c128", 128, 2, value, scale)
    win = np.arange(n - V4_WINDOW, n)
    for i, (s, t) in enumerate(zip(src["swa"], dst["swa"])):
        stride, row = s[0].nbytes, win % V4_PAGE
        idx = [np.concatenate([_runs(pages[win // V4_PAGE - first] * stride + row * value, value),
                               _runs(pages[win // V4_PAGE - first] * stride + V4_PAGE * value + row * scale, scale)])
               for pages in (src_swa, dst_swa)]
        moves.append(("swa", i, *idx))
    last8 = np.arange(n - 8, n)
    for name, pools in (("c4_state", (p.pool.compress_state_pools[2], d.pool.compress_state_pools[2])),
                        ("c4_index_state", (p.pool.indexer_compress_state_pools[2],
                                            d.pool.indexer_compress_state_pools[2]))):
        rows = [pool.translate_from_swa_loc_to_state_loc(  # SGLang's own addressing: SWA page x ring + pos % ring
            torch.as_tensor(pages[last8 // V4_PAGE - first] * V4_PAGE + last8 % V4_PAGE)).numpy()
            for pool, pages in zip(pools, (src_swa, dst_swa))]
        moves.append((name, 0, _rows(src[name][0], rows[0]), _rows(dst[name][0], rows[1])))
    for i, (s, t) in enumerate(zip(src["c128_state"], dst["c128_state"])):
        live = np.arange(n - n % 128, n) % 128
        moves.append(("c128_state", i, _rows(s, p_row * 128 + live), _rows(t, d_row * 128 + live)))
    row4 = p.pool.compress_state_pools[2].kv_score_buffer.kv_score[0].nbytes
    row4i = p.pool.indexer_compress_state_pools[2].kv_score_buffer.kv_score[0].nbytes
    row128 = p.pool.compress_state_pools[0].kv_score_buffer.kv_score[0].nbytes
    kv = value + scale
    needed = (n // 4) * (kv + 132) + (n // 128) * kv * 3 + V4_WINDOW * kv * 4 + 8 * (row4 + row4i) \
        + (n % 128) * row128 * 3
    assert p.pool.request_state_transfer_indices(p_row, n).tolist() == [p_row]  # SGLang's C128 index: the row
    return SimpleNamespace(n=n, chunk=256, page=V4_PAGE, src_pages=src_pages, dst_pages=dst_pages,
                           src_state=[src_swa.astype(np.int32), p.pool.request_state_transfer_indices(p_row, n)],
                           dst_state=[dst_swa.astype(np.int32), d.pool.request_state_transfer_indices(d_row, n)],
                           moves=moves, needed=needed, rows=(p_row, d_row))


CASES = {"mamba": _mamba_case, "swa": _swa_case, "v4": _v4_case,
         "v4-fp8": lambda p, d, specs: _v4_case(p, d, specs, uniform=True)}
# staged (KVBRIDGE_STAGING=always on both sides): every page, the window's and the state slot
# included, through decode's staging slots; slots small enough that the room takes several
SLOT = 4096
STAGED = {"KVBRIDGE_STAGING": "always", "KVBRIDGE_STAGING_BYTES": str(8 * SLOT),
          "KVBRIDGE_STAGING_SLOT_BYTES": str(SLOT)}


@pytest.mark.parametrize("model, path", [(m, "direct") for m in CASES] + [("mamba", "staged")])
def test_a_hybrid_model_moves_every_byte_decode_needs_and_nothing_else_through_the_rooms(daemon, model, path):
    from kvbridge.integrations.sglang import install

    install()  # before SGLang's get_kv_class is imported here: it resolves the kvbridge backend
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.mem_cache.common import kv_to_page_indices

    from kvbridge.integrations.sglang.kvargs import pool_specs

    with _pair(daemon, model, STAGED if path == "staged" else {"KVBRIDGE_STAGING": "never"}) as pair:
        p, d = pair.prefill, pair.decode
        case = CASES[model](p, d, pool_specs(p.mgr.cache))
        n, chunk, page = case.n, case.chunk, case.page
        room = 2**62 + 77 + len(model)
        gen = torch.Generator().manual_seed(len(model))
        for ts in p.tensors().values():
            for t in ts:
                b = t.view(torch.uint8)
                b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
        for ts in d.tensors().values():
            for t in ts:
                t.view(torch.uint8).fill_(POISON)
        before = {k: [_bytes(t).copy() for t in ts] for k, ts in d.tensors().items()}

        receiver, decode_req = _open_receiver(d, pair.addr, room, n, case.dst_pages, page, case.dst_state,
                                              row=case.rows[1])
        assert receiver.num_tokens == n

        # prefill: bootstrap, two chunks (the last with the state indices and the metadata row), as SGLang sends
        sender = get_kv_class(TransferBackend.KVBRIDGE, KVClassType.SENDER)(
            mgr=p.mgr, bootstrap_addr=pair.addr, bootstrap_room=room)
        _until(lambda: int(sender.poll()) == KVPoll.WaitingForInput)
        assert sender.pop_decode_prefix_len() == 0
        meta_idx = p.meta_alloc.alloc()
        sender.init(-(-n // page), meta_idx)
        src_tokens = torch.as_tensor(np.repeat(case.src_pages, page) * page + np.tile(np.arange(page),
                                                                                      case.src_pages.size))
        sender.send(kv_to_page_indices(src_tokens[:chunk], page), None, num_kv_tokens=chunk)
        p.meta.set_buf(world.metadata_req(room, meta_idx))
        sender.send(kv_to_page_indices(src_tokens[chunk:n], page), case.src_state, num_kv_tokens=n - chunk)
        _until(lambda: int(sender.poll()) in (KVPoll.Success, KVPoll.Failed))
        _until(lambda: int(receiver.poll()) in (KVPoll.Success, KVPoll.Failed))
        assert int(receiver.poll()) == KVPoll.Success, receiver.failure_exception()
        assert int(sender.poll()) == KVPoll.Success
        stats = sender.room_stats

        # every byte decode needs, and nothing else (padding and every other row keep their poison)
        src, dst = p.tensors(), d.tensors()
        want = {k: [b.copy() for b in bs] for k, bs in before.items()}
        for name, layer, s_idx, d_idx in case.moves:
            assert np.array_equal(_bytes(dst[name][layer])[d_idx], _bytes(src[name][layer])[s_idx]), (name, layer)
            want[name][layer][d_idx] = _bytes(src[name][layer])[s_idx]
        for name, ts in dst.items():
            for layer, t in enumerate(ts):
                assert np.array_equal(_bytes(t), want[name][layer]), f"{name} layer {layer}: a byte outside what " \
                    "decode needs"
        assert not world.metadata_errors(d.meta.get_buf(decode_req.metadata_buffer_index), room)
        aux = sum(int(x) for x in p.kv_args.aux_item_lens)
        assert sum(len(d_idx) for *_, d_idx in case.moves) == case.needed  # the bytes compared are the needed ones
        assert stats["bytes"] == case.needed + aux, stats
        if path == "staged":  # every byte through decode's staging slots, in more than one chunk
            assert stats["bytes_staged"] == stats["bytes"] and stats["chunks"] > 1, stats
        else:
            assert stats["bytes_staged"] == 0, stats
        sender.clear()
        receiver.clear()


def test_mamba_state_moves_from_a_tp1_prefill_into_tp2_decode_slots(daemon):
    """Attention TP 1 -> 2 through the managers: each decode rank's MambaPool slot (SGLang's
    TP-2 MambaPool: half of each conv q/k/v group, half the heads) is its cut of prefill's slot
    (the TP route's state sources, kvb.state_slices), k/v rows replicated (one KV head); every
    other byte keeps its poison."""
    from kvbridge.integrations.sglang import install

    install()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.mem_cache.common import kv_to_page_indices
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    env = {**CHILD_ENV, "KVBRIDGE_BOOTSTRAP_URL": daemon.url, "KVBRIDGE_STAGING": "never"}
    port = free_port()
    n, chunk, room = 50, 32, 2**62 + 991
    src_pages, dst_pages, src_slot, dst_slot = np.array([3, 9, 1, 6]), np.array([7, 2, 12, 5]), 1, 3
    with contextlib.ExitStack() as stack, use_context(create_context(ServerArgs(model_path="dummy", device="cpu"),
                                                                      role="scheduler")):
        p = Rank("prefill", port, env, "mamba", kv_heads=1)
        stack.callback(p.mgr.close)
        ds, decode_port = [], free_port()  # one decode instance (named by its port), TP ranks 0 and 1
        for r in range(2):
            ds.append(Rank("decode", 8998, env, "mamba", tp=(2, r), serve_port=decode_port))
            stack.callback(ds[-1].mgr.close)
        gen = torch.Generator().manual_seed(5)
        for t in (t for ts in p.tensors().values() for t in ts):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                    generator=gen))
        for t in (t for d in ds for ts in d.tensors().values() for t in ts):
            t.view(torch.uint8).fill_(POISON)
        addr = f"127.0.0.1:{port}"
        receivers = []
        for d in ds:
            receivers.append(_open_receiver(d, addr, room, n, dst_pages, PAGE, [[np.asarray(dst_slot)]])[0])
        sender = get_kv_class(TransferBackend.KVBRIDGE, KVClassType.SENDER)(mgr=p.mgr, bootstrap_addr=addr,
                                                                           bootstrap_room=room)
        _until(lambda: int(sender.poll()) == KVPoll.WaitingForInput)
        meta_idx = p.meta_alloc.alloc()
        sender.init(-(-n // PAGE), meta_idx)
        src_tokens = torch.as_tensor(np.repeat(src_pages, PAGE) * PAGE + np.tile(np.arange(PAGE), src_pages.size))
        sender.send(kv_to_page_indices(src_tokens[:chunk], PAGE), None, num_kv_tokens=chunk)
        p.meta.set_buf(world.metadata_req(room, meta_idx))
        sender.send(kv_to_page_indices(src_tokens[chunk:n], PAGE), [[np.asarray(src_slot)]], num_kv_tokens=n - chunk)
        for rcv in receivers:
            _until(lambda: int(rcv.poll()) in (KVPoll.Success, KVPoll.Failed))
            assert int(rcv.poll()) == KVPoll.Success, rcv.failure_exception()
        _until(lambda: int(sender.poll()) in (KVPoll.Success, KVPoll.Failed))
        assert int(sender.poll()) == KVPoll.Success

        src = p.tensors()
        tok = np.arange(n)
        s_rows, d_rows = src_pages[tok // PAGE] * PAGE + tok % PAGE, dst_pages[tok // PAGE] * PAGE + tok % PAGE
        for r, d in enumerate(ds):
            dst = d.tensors()
            want = {k: [torch.full_like(t, 0).view(torch.uint8).fill_(POISON) for t in ts] for k, ts in dst.items()}
            for name in ("k", "v"):
                for i in range(2):
                    want[name][i].view(src[name][i].dtype)[d_rows] = src[name][i][s_rows]
            for i in range(2):
                conv, at = [], 0
                for g in (Q, K_, V_):  # rank r's half of each conv channel group
                    conv.append(src["conv"][i][src_slot, at + r * g // 2: at + (r + 1) * g // 2])
                    at += g
                want["conv"][i].view(src["conv"][i].dtype)[dst_slot] = torch.cat(conv)
                want["temporal"][i].view(src["temporal"][i].dtype)[dst_slot] = \
                    src["temporal"][i][src_slot, r * HEADS // 2: (r + 1) * HEADS // 2]
            for name, ts in dst.items():
                for i, t in enumerate(ts):
                    assert torch.equal(t.view(torch.uint8), want[name][i]), (r, name, i)
        sender.clear()
        for rcv in receivers:
            rcv.clear()


@pytest.mark.parametrize("queue", ["sglang.srt.disaggregation.prefill.PrefillBootstrapQueue",
                                   "sglang.srt.disaggregation.decode.DecodePreallocQueue"])
def test_init_kv_manager_names_its_queue_while_sglangs_method_runs(queue):
    """patches.py wraps both queues' _init_kv_manager: inside SGLang's method (where the manager
    is built) building_queue() is that queue; before and after, nobody's."""
    import importlib

    from kvbridge.integrations.sglang import install
    from kvbridge.integrations.sglang.building import building_queue

    install()
    module, name = queue.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    seen = []

    class Queue:
        @property
        def transfer_backend(self):  # the first thing SGLang's method reads
            seen.append(building_queue())
            raise RuntimeError("stop here")

    q = Queue()
    with pytest.raises(RuntimeError, match="stop here"):
        cls._init_kv_manager(q)
    assert seen == [q] and building_queue() is None


def test_a_two_stage_mamba_prefill_fills_a_pp1_decode(daemon):
    """Pipeline stages of a Mamba hybrid (docs/pipeline.md, "Kind pools"): prefill at --pp-size 2,
    stage pp0 holding layers [0, 2) (Mamba layer 0, attention layer 1) and pp1 [2, 4) (Mamba 2,
    attention 3), each SGLang's own stage pool with its own MambaPool slot; decode at PP 1. Each
    stage builds the model's contract from the model config's layer pattern (the last alone, the
    first checked against it) and sends its own layers: k/v pages and its Mamba layers' slot, over
    real Mooncake. Every byte decode needs comes from the stage holding its layer, every other
    byte keeps its poison, and the stages together post exactly the bytes needed (plus the aux row,
    the last stage's)."""
    from kvbridge.integrations.sglang import install

    install()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.mem_cache.common import kv_to_page_indices
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    from kvbridge import fingerprint

    env = {**CHILD_ENV, "KVBRIDGE_BOOTSTRAP_URL": daemon.url, "KVBRIDGE_STAGING": "never"}
    port, serve = free_port(), free_port()
    n, chunk, room = 50, 32, 2**62 + 1993
    src_pages, dst_pages, src_slot, dst_slot = np.array([3, 9, 1, 6]), np.array([7, 2, 12, 5]), 1, 3
    with contextlib.ExitStack() as stack, use_context(create_context(ServerArgs(model_path="dummy", device="cpu"),
                                                                      role="scheduler")):
        stages = {}
        for pp, layers in ((1, (2, 4)), (0, (0, 2))):  # the last stage registers the model's contract first
            stages[pp] = Rank("prefill", port, env, "mamba", pp=(pp, 2), stage=layers, config=True, serve_port=serve)
            stack.callback(stages[pp].mgr.close)
        d = Rank("decode", 8998, env, "mamba", config=True)
        stack.callback(d.mgr.close)
        assert [stages[s].mgr.stage for s in (0, 1)] == [(0, 2), (2, 4)]
        assert {k: v.layer_ids for k, v in stages[0].mgr.endpoint.specs.items()} == {
            "k": (1,), "v": (1,), "mamba_0": (0,), "mamba_1": (0,)}
        prints = {fingerprint(stages[s].mgr.endpoint.contract) for s in (0, 1)}
        assert prints == {fingerprint(d.mgr.contract("replicated")[2])}
        gen = torch.Generator().manual_seed(9)
        for t in (t for s in stages.values() for ts in s.tensors().values() for t in ts):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                    generator=gen))
        for t in (t for ts in d.tensors().values() for t in ts):
            t.view(torch.uint8).fill_(POISON)

        addr = f"127.0.0.1:{port}"
        receiver, decode_req = _open_receiver(d, addr, room, n, dst_pages, PAGE, [[np.asarray(dst_slot)]])

        # each stage: two chunks of its own layers, the last with its MambaPool slot; the aux row is pp1's
        src_tokens = torch.as_tensor(np.repeat(src_pages, PAGE) * PAGE + np.tile(np.arange(PAGE), src_pages.size))
        senders = {}
        for pp, s in stages.items():
            senders[pp] = get_kv_class(TransferBackend.KVBRIDGE, KVClassType.SENDER)(
                mgr=s.mgr, bootstrap_addr=addr, bootstrap_room=room)
        for pp, s in stages.items():
            sender = senders[pp]
            _until(lambda: int(sender.poll()) == KVPoll.WaitingForInput)
            meta_idx = s.meta_alloc.alloc()
            sender.init(-(-n // PAGE), meta_idx)
            sender.send(kv_to_page_indices(src_tokens[:chunk], PAGE), None, num_kv_tokens=chunk)
            s.meta.set_buf(world.metadata_req(room, meta_idx))
            sender.send(kv_to_page_indices(src_tokens[chunk:n], PAGE), [[np.asarray(src_slot)]],
                        num_kv_tokens=n - chunk)
        _until(lambda: int(receiver.poll()) in (KVPoll.Success, KVPoll.Failed))
        assert int(receiver.poll()) == KVPoll.Success, receiver.failure_exception()
        for sender in senders.values():
            _until(lambda: int(sender.poll()) in (KVPoll.Success, KVPoll.Failed))
            assert int(sender.poll()) == KVPoll.Success

        # decode's layer i of each pool: k/v layers 1, 3 and Mamba layers 0, 2, each from its stage
        dst = d.tensors()
        tok = np.arange(n)
        s_rows, d_rows = src_pages[tok // PAGE] * PAGE + tok % PAGE, dst_pages[tok // PAGE] * PAGE + tok % PAGE
        want = {k: [torch.empty_like(t).view(torch.uint8).fill_(POISON) for t in ts] for k, ts in dst.items()}
        for layer, pp in enumerate((0, 1)):
            src = stages[pp].tensors()
            for name in ("k", "v"):
                want[name][layer].view(src[name][0].dtype)[d_rows] = src[name][0][s_rows]
            for name in ("conv", "temporal"):
                want[name][layer].view(src[name][0].dtype)[dst_slot] = src[name][0][src_slot]
        for name, ts in dst.items():
            for layer, t in enumerate(ts):
                assert torch.equal(t.view(torch.uint8), want[name][layer]), (name, layer)
        assert not world.metadata_errors(d.meta.get_buf(decode_req.metadata_buffer_index), room)
        specs = d.mgr.cache.pools
        row = specs["k"].bytes_per_page // PAGE
        slot = sum(specs[m].bytes_per_page for m in ("mamba_0", "mamba_1"))
        aux = sum(int(x) for x in d.kv_args.aux_item_lens)
        sent = [senders[pp].room_stats["bytes"] for pp in (0, 1)]
        assert sent == [2 * n * row + slot, 2 * n * row + slot + aux], sent  # each stage its layers, pp1 the aux row
        for sender in senders.values():
            sender.clear()
        receiver.clear()

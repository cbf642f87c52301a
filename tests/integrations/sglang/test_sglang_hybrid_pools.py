"""SGLang 0.5.23's state components through its REAL pool classes on the CPU
(``DeepSeekV4TokenToKVPool``, ``SWAKVPool``, ``HybridLinearKVPool`` + ``MambaPool``,
``MHATokenToKVPoolMXFP8``, ``MetadataBuffers``), their ``KVArgs`` filled by SGLang's own
``setup_state_kv_args`` / ``get_contiguous_buf_infos``, mapped by kvbridge
(integrations/sglang/state_kinds.py, kvargs.py), and where a kind maps exactly, moved with
kvbridge's plan (``plan_kind``) between two real pools in this process (``ctypes.memmove`` at
the plan's addresses) and compared with what SGLang's own backend addresses.

Said plainly: V4's unified SWA ring exists only on HIP in SGLang (``is_unified_kv_triton``); the
ring test and the fp8 two-pool test force that gate on to build the real pool on the CPU. The
trtllm uniform fp8 pool is built under SGLang's own ``--dsv4-attn-backend trtllm`` context. The DSA kpool tail and the
DSpark draft's request row are driven with ``KVArgs`` as SGLang's ``append_state_component``
fills them (their pools need CUDA kernels or a DSpark draft worker to construct)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

import kvbridge as kvb  # noqa: E402
from kvbridge import ConfigError  # noqa: E402
from kvbridge.integrations.sglang.kvargs import pool_specs, read_kv_args  # noqa: E402
from kvbridge.integrations.sglang.state_kinds import (  # noqa: E402
    NOT_MAPPED,
    STATE_KINDS,
    HybridGeometry,
    component_pools,
)

ALL_KINDS = frozenset({"paged", "window", "compressed", "state"})


@pytest.fixture(scope="module")
def sgl():
    """SGLang's runtime context (its pools read it), active for the module's tests."""
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    ctx = create_context(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")
    with use_context(ctx):
        yield


@pytest.fixture
def carried(monkeypatch):
    """Set the kinds the room endpoints carry (kvbridge.ROOM_POOL_KINDS)."""
    def set_kinds(kinds):
        monkeypatch.setattr(kvb, "ROOM_POOL_KINDS", frozenset(kinds), raising=False)
    set_kinds({"paged"})
    return set_kinds


def _kv_args(pool, *, draft=None, page_size=None):
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import MetadataBuffers, setup_state_kv_args

    a = KVArgs()
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = (list(x) for x in pool.get_contiguous_buf_infos())
    a.kv_layer_ids, a.num_draft_entries, a.prefill_start_layer = [], 0, 0
    a.prefill_end_layer = getattr(pool, "end_layer", None)
    a.page_size = page_size or pool.page_size
    a.kv_cache_dtype_str = "auto"
    meta = MetadataBuffers(4, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0)
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = meta.get_buf_infos()
    setup_state_kv_args(a, pool, draft, 4)
    a._keep = meta  # the aux buffers live as long as the args
    return a


def _move(plan):
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
        ctypes.memmove(d, s, n)


def _descs(made, device="cpu"):
    return [kvb.describe_buffer(made.spec, lid, kvb.RawBuffer(p, n // i * i, device))
            for lid, p, n, i in zip(made.spec.layer_ids, made.ptrs, made.lens, made.items)]


def test_every_sglang_state_type_maps_to_a_kind_or_is_named():
    from sglang.srt.disaggregation.base.conn import StateType

    values = {t.value for t in StateType}
    assert values == set(STATE_KINDS) | set(NOT_MAPPED), "SGLang added or dropped a StateType"
    assert {t.name: STATE_KINDS[t.value] for t in StateType if t.value in STATE_KINDS} == {
        "MAMBA": "state", "SWA": "window", "SWA_RING": "window", "DSA": "paged", "DSA_TAIL": "state",
        "DSV4_REQUEST_STATE": "state", "REQUEST_ROW": "state", "BLOCK_SCALE": "paged", "BLOCK_SCALE_SWA": "window"}


# -- DeepSeek-V4 ------------------------------------------------------------------------------

V4 = dict(max_num_reqs=4, swa_size=512, c4_size=128, c128_size=4, c4_state_pool_size=64, c128_state_pool_size=8,
          page_size=256, swa_page_size=256, c4_state_dtype=torch.float32, c128_state_dtype=torch.float32,
          qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, layer_num=4, device="cpu",
          enable_memory_saver=False, compression_ratios=[128, 128, 4, 128], sliding_window=128)


def _v4(unified=False):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    if not unified:
        return DeepSeekV4TokenToKVPool(dtype=torch.uint8, **V4)
    import sglang.srt.layers.attention.dsv4.unified_kv_gate as gate

    real = gate.is_unified_kv_triton
    gate.is_unified_kv_triton = lambda: True  # SGLang builds the unified ring on HIP only (see the docstring)
    try:
        return DeepSeekV4TokenToKVPool(dtype=torch.bfloat16, **V4)
    finally:
        gate.is_unified_kv_triton = real


def test_v4_is_refused_by_the_kind_the_rooms_do_not_carry(sgl, carried):
    """V4's KV lists are its compressed caches by ratio, [C4 KV, C4 indexer, C128 KV x 3]; its state
    components SWA (window) and DSV4_REQUEST_STATE (state). Each is refused naming its kind."""
    args = _kv_args(_v4())
    assert [t.value for t in args.state_types] == ["swa", "c128_state"]
    assert args.kv_item_lens == [37_440, 8_448, 1_728, 1_728, 1_728]
    with pytest.raises(ConfigError, match=r"DeepSeek-V4 KV .* is kvbridge 'compressed' pools .*carry only "
                                          r"\['paged'\]") as err:
        read_kv_args(args, is_mla=True)
    assert err.value.field == "mla_compression_ratios"
    carried({"paged", "compressed"})
    with pytest.raises(ConfigError, match=r"SGLang state 'swa' maps to kvbridge 'window' pools") as err:
        read_kv_args(args, is_mla=True)
    assert err.value.field == "state_types"
    carried({"paged", "compressed", "window"})
    with pytest.raises(ConfigError, match="'c128_state' maps to kvbridge 'state' pools"):
        read_kv_args(args, is_mla=True)


def test_v4_pools_map_padded_pages_by_their_stride_and_c4_rings_by_the_swa_page(sgl, carried):
    """Every kind carried, V4's pools map exactly: FlashMLA pages padded to whole 576-byte rows
    take a page stride (C4: 64 entries x 584 B = 37,376 B registered as 37,440; C128: 2 x 584 B in
    1,728; SWA: 256 x 584 B = 149,504 in 149,760), the C4 indexer's pages are unpadded, and the C4
    compressor rings (one of 8 fp32 rows per SWA page) are window pools paged by the ring. Pages
    of another size are refused naming the pool."""
    from kvbridge.integrations.sglang.state_kinds import v4_kv_pools

    carried(ALL_KINDS)
    pool = _v4()
    args = _kv_args(pool)
    cache = read_kv_args(args, is_mla=True, geometry=HybridGeometry(sliding_window=128))
    specs = pool_specs(cache)
    got = {n: (s.kind, s.page_size, s.bytes_per_token, s.page_stride, s.window, s.ratio, s.layer_ids)
           for n, s in specs.items()}
    row = pool.compress_state_pools[2].kv_score_buffer.kv_score[0].nbytes
    index_row = pool.indexer_compress_state_pools[2].kv_score_buffer.kv_score[0].nbytes
    assert got == {"c4": ("compressed", 64, 584, 37_440, 0, 4, (2,)),
                   "c4_index": ("compressed", 64, 132, 0, 0, 4, (2,)),
                   "c128": ("compressed", 2, 584, 1_728, 0, 128, (0, 1, 3)),
                   "swa": ("window", 256, 584, 149_760, 128, 0, (0, 1, 2, 3)),
                   "c4_state": ("window", 8, row, 0, 8, 0, (2,)),
                   "c4_index_state": ("window", 8, index_row, 0, 8, 0, (2,)),
                   "c128_state": ("state", 1, 128 * row // 2, 0, 0, 128, (0, 1, 3))}
    assert [b.ptr for b in cache.pools["c4_state"].buffers] == \
        [pool.compress_state_pools[2].kv_score_buffer.kv_score.data_ptr()]
    contract = kvb.contract_for(specs, model="v4-tiny", aux=kvb.AuxSchema.standard(0, "bfloat16", 0))
    assert contract.page_size == 256 and contract.pool("c4").page_stride == 37_440
    args.kv_item_lens = [64 * 584, 64 * 132] + [2 * 584] * 3  # unpadded: not what FlashMLA reads
    with pytest.raises(ConfigError, match=r"pool 'c4': DeepSeek-V4 pages are \[37376\] B, not 64 rows of 584 B "
                                          r"\(37376 B\) padded to whole 576-byte rows \(37440 B\)") as err:
        v4_kv_pools(args, 256)
    assert err.value.field == "pools.c4.bytes_per_page"
    assert kvb.needed_extent(specs["c128"], 300).num_rows == 2  # entries of complete 128-token windows only


def test_geometry_is_read_off_the_v4_pool_and_the_dsa_kpool(sgl):
    """What KVArgs do not say, from the queue building the manager: V4's window (the scheduler's,
    else the pool's), C4 ring and C128 ring; a DSA pool's kpool size and tail ring."""
    from kvbridge.integrations.sglang.state_kinds import geometry_of

    pool = _v4()
    geo = geometry_of(SimpleNamespace(token_to_kv_pool=pool, scheduler=SimpleNamespace(sliding_window_size=None)))
    assert (geo.sliding_window, geo.c4_ring_size, geo.c128_ring_size, geo.c128_online, geo.swa_ring_stride) == \
        (128, pool.get_ring_size(4), 128, False, 0)
    dsa = SimpleNamespace(kpool_use_compress=True, index_kpool=4, tail_extra_slots=2)
    geo = geometry_of(SimpleNamespace(token_to_kv_pool=SimpleNamespace(use_dsa=True, full_kv_pool=dsa)))
    assert (geo.dsa_tail_ratio, geo.dsa_tail_slots) == (4, 6)
    assert geometry_of(None) == HybridGeometry()


def test_v4_c128_state_is_a_tail_slot_by_request_row_and_moves_exactly_the_live_rows(sgl):
    """DSV4_REQUEST_STATE: one 128-row ring per request row (token p at row p % 128), of which the
    n % 128 rows of the incomplete window live; SGLang addresses it with
    ``request_state_transfer_indices``: the request row."""
    prefill, decode = _v4(), _v4()
    pa, da = _kv_args(prefill), _kv_args(decode)
    c = [t.value for t in pa.state_types].index("c128_state")
    (src,) = component_pools(pa, c, HybridGeometry(), page_size=256, kv_dtype="bfloat16", target_ids=range(4),
                             draft_ids=())
    (dst,) = component_pools(da, c, HybridGeometry(), page_size=256, kv_dtype="bfloat16", target_ids=range(4),
                             draft_ids=())
    spec = src.spec
    state = [p for p in prefill.compress_state_pools if p is not None and p.request_scoped]
    row_bytes = state[0].kv_score_buffer.kv_score[0].nbytes
    assert (spec.kind, spec.ratio, spec.layer_ids, spec.bytes_per_token) == ("state", 128, (0, 1, 3), 128 * row_bytes)
    assert src.ptrs == tuple(p.kv_score_buffer.kv_score.data_ptr() for p in state)
    n, p_row, d_row = 300, 1, 2
    assert prefill.request_state_transfer_indices(p_row, n).tolist() == [p_row]  # SGLang's own index: the row
    for p in state:
        p.kv_score_buffer.kv_score.copy_(torch.randn_like(p.kv_score_buffer.kv_score))
    plan = kvb.plan_kind(spec, _descs(src), _descs(dst), kvb.needed_extent(spec, n),
                         prefill.request_state_transfer_indices(p_row, n), decode.request_state_transfer_indices(d_row, n))
    assert plan.num_bytes == kvb.needed_bytes(spec, n) == (n % 128) * row_bytes * 3
    dst_state = [p for p in decode.compress_state_pools if p is not None and p.request_scoped]
    for d in dst_state:
        d.kv_score_buffer.kv_score.fill_(7.0)  # a sentinel: rows outside the live ones are never written
    _move(plan)
    live = slice(d_row * 128, d_row * 128 + n % 128)
    for s, d in zip(state, dst_state):
        got = d.kv_score_buffer.kv_score
        assert torch.equal(got[live], s.kv_score_buffer.kv_score[p_row * 128: p_row * 128 + n % 128])
        assert (got[:live.start] == 7).all() and (got[live.stop:] == 7).all()


def test_v4_unified_swa_ring_moves_the_rows_sglang_addresses(sgl):
    """SWA_RING: row ``req * stride + pos % stride`` of each layer's unified buffer; SGLang's prefill
    sends the last ``unified_swa_window`` positions (prefill.py ``_swa_ring_payload``)."""
    prefill, decode = _v4(unified=True), _v4(unified=True)
    pa, da = _kv_args(prefill), _kv_args(decode)
    assert [t.value for t in pa.state_types] == ["swa", "swa_ring", "c128_state"]
    c = 1
    geo = HybridGeometry(sliding_window=prefill.unified_swa_window, swa_ring_stride=prefill.unified_swa_ring_size)
    (src,) = component_pools(pa, c, geo, page_size=256, kv_dtype="bfloat16", target_ids=range(4), draft_ids=())
    (dst,) = component_pools(da, c, geo, page_size=256, kv_dtype="bfloat16", target_ids=range(4), draft_ids=())
    spec = src.spec
    assert (spec.kind, spec.window, spec.ring_stride, spec.bytes_per_token, spec.layer_ids) == \
        ("window", 128, prefill.unified_swa_ring_size, 1024, (0, 1, 2, 3))
    assert src.ptrs == tuple(b.data_ptr() for b in prefill.unified_kv_pool.kv_buffer)
    for b in prefill.unified_kv_pool.kv_buffer:
        b.copy_(torch.randn_like(b))
    for b in decode.unified_kv_pool.kv_buffer:
        b.fill_(7.0)
    n, p_row, d_row, stride = 300, 1, 3, prefill.unified_swa_ring_size
    _move(kvb.plan_kind(spec, _descs(src), _descs(dst), kvb.needed_extent(spec, n), [p_row], [d_row]))
    pos = np.arange(n - 128, n)
    p_rows, d_rows = p_row * stride + pos % stride, d_row * stride + pos % stride  # _swa_ring_payload's rows
    for s, d in zip(prefill.unified_kv_pool.kv_buffer, decode.unified_kv_pool.kv_buffer):
        assert torch.equal(d[d_rows], s[p_rows])
        others = np.setdiff1d(np.arange(d.shape[0]), d_rows)
        assert (d[others] == 7).all()  # no other row, compressed region included


def test_v4_c4_compressor_rings_under_the_unified_kv_are_refused_by_name(sgl, carried):
    """Under the unified KV (HIP) the C4 rings are by request row, and SGLang's SWA index list (SWA
    pages, which the unified KV does not have) does not address them: refused naming them."""
    carried(ALL_KINDS)
    args = _kv_args(_v4(unified=True))
    with pytest.raises(ConfigError, match=r"C4 compressor rings under the unified KV") as err:
        component_pools(args, 0, HybridGeometry(sliding_window=128), page_size=256, kv_dtype="bfloat16",
                        target_ids=range(4), draft_ids=())
    assert err.value.field == "pools.c4_state.kind"


# -- DeepSeek-V4's fp8 layouts ---------------------------------------------------------------------


def _v4_uniform_fp8():
    """DeepSeek-V4 under ``--dsv4-attn-backend trtllm``: SGLang's uniform fp8 pool (512 e4m3 B a row,
    no scales, no padding; it constructs on the CPU), with ``KVArgs.kv_layout`` as SGLang's
    ``_init_kv_manager`` sets it (``get_pd_kv_layout``)."""
    from sglang.srt.disaggregation.utils import get_pd_kv_layout
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    with use_context(create_context(ServerArgs(model_path="dummy", device="cpu", dsv4_attn_backend="trtllm"),
                                    role="scheduler")):
        pool = DeepSeekV4TokenToKVPool(dtype=torch.float8_e4m3fn, **V4)
        args = _kv_args(pool)
    args.kv_layout = get_pd_kv_layout(pool)
    return pool, args


def test_v4_uniform_fp8_pools_map_by_their_512_byte_rows_and_differ_from_flashmla_in_dtype(sgl, carried):
    """trtllm's uniform fp8 pool: SWA pages and C4/C128 entries of 512 B e4m3 rows, unpadded
    (``page_stride`` 0: every registered byte is a row), the C4 indexer as under FlashMLA. A
    contract of it against FlashMLA's (the same model, SGLang's default CUDA layout) differs in
    each KV pool's ``dtype`` first, so the handshake names it; page sizes of another layout are
    refused naming the pool, and a V4.1 layout tag naming ``kv_layout``."""
    from kvbridge.integrations.sglang.state_kinds import v4_kv_pools

    carried(ALL_KINDS)
    pool, args = _v4_uniform_fp8()
    assert pool.uniform_fp8 and args.kv_layout == "uniform_fp8"
    assert args.kv_item_lens == [64 * 512, 64 * 132, 2 * 512, 2 * 512, 2 * 512]
    specs = pool_specs(read_kv_args(args, is_mla=True, geometry=HybridGeometry(sliding_window=128)))
    got = {n: (s.kind, s.dtype, s.page_size, s.bytes_per_token, s.layout, s.page_stride, s.bytes_per_page)
           for n, s in specs.items() if n in ("c4", "c4_index", "c128", "swa")}
    assert got == {"c4": ("compressed", "fp8_e4m3", 64, 512, "rows", 0, 32_768),
                   "c4_index": ("compressed", "fp8_e4m3_with_scale", 64, 132, "values_then_scales", 0, 8_448),
                   "c128": ("compressed", "fp8_e4m3", 2, 512, "rows", 0, 1_024),
                   "swa": ("window", "fp8_e4m3", 256, 512, "rows", 0, 131_072)}
    assert pool.swa_kv_pool.kv_buffer[0][0].nbytes == specs["swa"].bytes_per_page  # SGLang's page, every byte a row
    aux = kvb.AuxSchema.standard(0, "bfloat16", 0)
    uniform = kvb.contract_for(specs, model="v4-tiny", aux=aux)
    flash = kvb.contract_for(pool_specs(read_kv_args(_kv_args(_v4()), is_mla=True,
                                                     geometry=HybridGeometry(sliding_window=128))),
                             model="v4-tiny", aux=aux)
    diff = {d.path: (d.prefill, d.decode) for d in kvb.diff_contracts(uniform, flash)}
    for name in ("c4", "c128", "swa"):
        assert diff[f"pools.{name}.dtype"] == ("fp8_e4m3", "v4_fp8_nope_bf16_rope")
        assert diff[f"pools.{name}.bytes_per_token"] == (512, 584)
    assert not any(p.startswith("pools.c4_index") for p in diff)  # the indexer is the same bytes under both
    args.kv_item_lens[0] = 37_440  # FlashMLA's page under the uniform tag
    with pytest.raises(ConfigError, match=r"pool 'c4': DeepSeek-V4 uniform fp8 pages are \[37440\] B, not 64 rows "
                                          r"of 512 B") as err:
        v4_kv_pools(args, 256)
    assert err.value.field == "pools.c4.bytes_per_page"
    args.kv_layout = "v41,c4:v41,c128:v41"
    with pytest.raises(ConfigError, match=r"DeepSeek-V4 KV layout 'v41,c4:v41,c128:v41' .* not pinned") as err:
        v4_kv_pools(args, 256)
    assert err.value.field == "kv_layout"


def test_v4_unified_fp8_two_pool_is_refused_by_name_saying_why(sgl, carried):
    """SGLANG_DSV4_UNIFIED_KV_FP8 (HIP's unified KV; forced on here to build SGLang's real pool on
    the CPU): a bf16 rope group after each nope group of the KV lists, nope and rope buffers a layer
    in the SWA ring. A nope row is 512 B of which 462 are written: refused naming the KV lists and
    the ring, with the reasons (row padding; the C4 rings by request row)."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    import sglang.srt.layers.attention.dsv4.unified_kv_gate as gate

    carried(ALL_KINDS)
    real = gate.is_unified_kv_triton
    gate.is_unified_kv_triton = lambda: True
    try:
        pool = DeepSeekV4TokenToKVPool(dtype=torch.bfloat16, unified_fp8=True, **V4)
    finally:
        gate.is_unified_kv_triton = real
    assert pool.unified_kv_pool.kv_buffer[0].shape[1] == 512 and pool.unified_kv_pool.kv_buffer_rope[0].shape[1] == 64
    args = _kv_args(pool)
    assert len(args.kv_data_ptrs) == 3 * 1 + 2 * 3  # c4 nope, c4 rope, c4 indexer, c128 nope x 3, c128 rope x 3
    with pytest.raises(ConfigError, match=r"9 buffers are SGLang's fp8 two-pool .* 512 B of which 462 carry data "
                                          r".* padding inside every row.* C4 compressor rings are by request row")\
            as err:
        read_kv_args(args, is_mla=True, geometry=HybridGeometry(sliding_window=128))
    assert err.value.field == "kv_data_ptrs"
    ring = [t.value for t in args.state_types].index("swa_ring")
    geo = HybridGeometry(sliding_window=pool.unified_swa_window, swa_ring_stride=pool.unified_swa_ring_size)
    with pytest.raises(ConfigError, match=r"'swa_ring': 8 buffers are the fp8 two-pool's ring .* padding") as err:
        component_pools(args, ring, geo, page_size=256, kv_dtype="bfloat16", target_ids=range(4), draft_ids=())
    assert err.value.field == "state_data_ptrs"


# -- sliding window (gpt-oss class) -------------------------------------------------------------

def _swa_pool(head_num=2):
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=256, size_swa=128, page_size=16, dtype=torch.bfloat16, head_num=head_num, head_dim=8,
                     swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3], device="cpu")


def test_swa_pool_is_window_pages_and_sends_only_the_window(sgl, carried):
    pool, decode = _swa_pool(), _swa_pool()
    args = _kv_args(pool)
    with pytest.raises(ConfigError, match="'swa' maps to kvbridge 'window' pools"):
        read_kv_args(args, is_mla=False)
    carried({"paged", "window"})
    with pytest.raises(ConfigError, match="the SWA layers' ids are not known") as err:
        read_kv_args(args, is_mla=False, geometry=HybridGeometry(sliding_window=40))
    assert err.value.field == "swa_layer_ids"
    geo = HybridGeometry(sliding_window=40, swa_layer_ids=(0, 2))
    cache = read_kv_args(args, is_mla=False, geometry=geo)
    specs = pool_specs(cache)
    k, v = specs["swa_k"], specs["swa_v"]
    assert (k.kind, k.window, k.layer_ids, k.bytes_per_token, k.page_size) == ("window", 40, (0, 2), 32, 16)
    assert [b.ptr for b in cache.pools["swa_k"].buffers] == [t.data_ptr() for t in pool.swa_kv_pool.k_buffer]
    assert [b.ptr for b in cache.pools["swa_v"].buffers] == [t.data_ptr() for t in pool.swa_kv_pool.v_buffer]
    kvb.contract_for(specs, model="gpt-oss-tiny", aux=kvb.AuxSchema.standard(0, "bfloat16", 0))
    # n = 100 tokens on SWA pages 0..6 (prefill) and 1..7 (decode); SGLang's _swa_payload sends pages from
    # floor((n - W) / ps): pages 3..6; kvbridge writes only rows [n - W, n) of them
    n = 100
    src_pages, dst_pages = np.arange(7), np.arange(1, 8)
    ext = kvb.needed_extent(k, n)
    assert (ext.first, ext.stop) == ((n - 40) // 16, -(-n // 16))
    da = _kv_args(decode)
    dcache = read_kv_args(da, is_mla=False, geometry=geo)
    for t in pool.swa_kv_pool.k_buffer:
        t.copy_(torch.randn_like(t))
    for t in decode.swa_kv_pool.k_buffer:
        t.fill_(7.0)
    src = [kvb.describe_buffer(k, lid, b.raw("cpu")) for lid, b in zip(k.layer_ids, cache.pools["swa_k"].buffers)]
    dst = [kvb.describe_buffer(k, lid, b.raw("cpu")) for lid, b in zip(k.layer_ids, dcache.pools["swa_k"].buffers)]
    _move(kvb.plan_kind(k, src, dst, ext, src_pages[ext.first:ext.stop], dst_pages[ext.first:ext.stop]))
    for s, d in zip(pool.swa_kv_pool.k_buffer, decode.swa_kv_pool.k_buffer):
        tok = np.arange(n - 40, n)
        s_loc, d_loc = src_pages[tok // 16] * 16 + tok % 16, dst_pages[tok // 16] * 16 + tok % 16
        assert torch.equal(d[d_loc], s[s_loc])
        assert (d[np.setdiff1d(np.arange(d.shape[0]), d_loc)] == 7).all()  # nothing outside the window


# -- Mamba hybrid (Qwen3-Next class: GDN conv + temporal state) ---------------------------------

Q, K_, V_, HEADS = 32, 32, 64, 4


def _mamba(tp):
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    shape = Mamba2StateShape.create(tp_world_size=tp, intermediate_size=V_, n_groups=2, num_heads=HEADS, head_dim=16,
                                    state_size=16, conv_kernel=4, conv_shard_groups=[Q, K_, V_])
    mp = MambaPool(size=4, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]),
                   mamba_layer_ids=[0, 2], device="cpu")
    return HybridLinearKVPool(size=64, dtype=torch.bfloat16, page_size=16, head_num=1, head_dim=8,
                              full_attention_layer_ids=[1, 3], device="cpu", mamba_pool=mp)


def _conv_part(full, tp, r):
    """Rank r's conv channels of a TP-1 slot (channels cat(q, k, v), each head-sharded)."""
    out, at = [], 0
    for g in (Q, K_, V_):
        out.append(full[at + r * g // tp: at + (r + 1) * g // tp])
        at += g
    return torch.cat(out)


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
def test_mamba_state_moves_across_tp_sizes(sgl, carried, src_tp, dst_tp):
    """MAMBA: state pools cut by SGLang's state_conv_shard_groups (conv) and heads (temporal); a
    prefill at one attention TP fills decode slots at another, slot by slot."""
    full = _mamba(1)
    srcs = [_mamba(src_tp) for _ in range(src_tp)]
    dsts = [_mamba(dst_tp) for _ in range(dst_tp)]
    with pytest.raises(ConfigError, match="'mamba' maps to kvbridge 'state' pools"):
        read_kv_args(_kv_args(srcs[0]), is_mla=False)
    carried({"paged", "state"})
    caches = {id(p): read_kv_args(_kv_args(p), is_mla=False)  # attention TP read off the conv shard groups
              for group in (srcs, dsts) for p in group}
    conv = pool_specs(caches[id(srcs[0])])["mamba_0"]
    assert (conv.kind, conv.shard_units, conv.tp_size, conv.layer_ids) == ("state", (Q, K_, V_), src_tp, (0, 2))
    assert [b.ptr for b in caches[id(srcs[0])].pools["mamba_0"].buffers] == \
        [t.data_ptr() for t in srcs[0].mamba_pool.mamba_cache.conv[0]]
    slot_p, slot_d = 1, 2
    for name, layer_tensors in (("mamba_0", lambda p: p.mamba_pool.mamba_cache.conv[0]),
                                ("mamba_1", lambda p: p.mamba_pool.mamba_cache.temporal)):
        truth = layer_tensors(full)[:, slot_p].clone().normal_()  # [layers, channels or heads, ...]
        split = _conv_part if name == "mamba_0" else (lambda t, tp, r: t[r * HEADS // tp: (r + 1) * HEADS // tp])
        for r, p in enumerate(srcs):
            for layer in range(2):
                layer_tensors(p)[layer, slot_p] = split(truth[layer], src_tp, r)
        for d in dsts:
            layer_tensors(d).fill_(7.0)
        for dr, d in enumerate(dsts):
            dspec = pool_specs(caches[id(d)])[name]
            for sr, p in enumerate(srcs):
                sspec = pool_specs(caches[id(p)])[name]
                src = [kvb.describe_buffer(sspec, lid, b.raw("cpu"))
                       for lid, b in zip(sspec.layer_ids, caches[id(p)].pools[name].buffers)]
                dst = [kvb.describe_buffer(dspec, lid, b.raw("cpu"))
                       for lid, b in zip(dspec.layer_ids, caches[id(d)].pools[name].buffers)]
                _move(kvb.plan_kind(sspec, src, dst, kvb.needed_extent(sspec, 100), [slot_p], [slot_d],
                                    dst_spec=dspec, tp=(src_tp, sr, dst_tp, dr)))
            for layer in range(2):
                assert torch.equal(layer_tensors(d)[layer, slot_d], split(truth[layer], dst_tp, dr)), (name, dr, layer)
                others = torch.cat([layer_tensors(d)[layer, :slot_d].flatten(), layer_tensors(d)[layer, slot_d + 1:].flatten()])
                assert (others == 7).all()


# -- MXFP8 block scales (BLOCK_SCALE: paged, carried today) -------------------------------------

def _mxfp8(page_size=16):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8

    return MHATokenToKVPoolMXFP8(size=4 * page_size, page_size=page_size, dtype=torch.float8_e4m3fn, head_num=2, head_dim=64,
                                 layer_num=2, device="cpu", enable_memory_saver=False)


def test_mxfp8_block_scales_are_paged_pools_on_the_kv_page_mapping(sgl, carried):
    pool = _mxfp8()
    args = _kv_args(pool)
    args.kv_cache_dtype_str = "mxfp8"
    cache = read_kv_args(args, is_mla=False)
    assert sorted(cache.pools) == ["k", "k_scale", "v", "v_scale"]
    specs = pool_specs(cache)
    ks = specs["k_scale"]
    assert (ks.kind, ks.abi, ks.bytes_per_token, ks.page_size, ks.layer_ids) == ("paged", "uint8", 2 * 64 // 32, 16,
                                                                                 (0, 1))
    assert [b.ptr for b in cache.pools["k_scale"].buffers] == [t.data_ptr() for t in pool.k_scale_buffer]
    assert [b.ptr for b in cache.pools["v_scale"].buffers] == [t.data_ptr() for t in pool.v_scale_buffer]
    assert specs["k"].dtype == "fp8_e4m3" and specs["k"].abi == "uint8"
    kvb.contract_for(specs, model="mxfp8", aux=kvb.AuxSchema.standard(0, "bfloat16", 0))
    heads = pool_specs(cache, (4, 2, 4))  # attention TP 2, rank 1: heads [2, 4) of 4, as the k/v pools
    assert (heads["k_scale"].num_heads, heads["k_scale"].head_start, heads["k_scale"].head_stop) == (4, 2, 4)
    assert (heads["k"].num_heads, heads["k"].head_start) == (4, 2)
    assert heads["k_scale"].full_bytes_per_token == 4 * 64 // 32


def test_mxfp8_interleaved_scales_are_refused_by_name(sgl):
    args = _kv_args(_mxfp8(page_size=128))
    args.kv_cache_dtype_str = "mxfp8"
    with pytest.raises(ConfigError, match="swizzled per page") as err:
        read_kv_args(args, is_mla=False)
    assert err.value.field == "pools.k_scale.layout"


# -- DSA tail and the request row: KVArgs as SGLang's append_state_component fills them ---------

def _appended(state_type, ptrs, lens, items):
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType
    from sglang.srt.disaggregation.utils import append_state_component

    a = KVArgs()
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.state_dim_per_tensor, a.state_conv_shard_groups, a.state_slice_outer_counts, a.state_layer_ids = [], [], [], []
    a.mla_compression_ratios = None
    append_state_component(a, StateType(state_type), ptrs, lens, items)
    return a


def test_dsa_tail_is_a_tail_slot_when_the_ring_is_the_kpool():
    """DSA_TAIL (get_compress_tail_buf_infos: key rings then score rings per layer, 0-byte items
    for layers without index K); SGLang's get_dsa_tail_state_indices puts the live n % R rows
    at (n - n % R) % slots: row 0 when the ring has R slots."""
    from sglang.srt.disaggregation.utils import get_dsa_tail_state_indices

    key = torch.zeros(5, 4, 132, dtype=torch.uint8)  # 5 request rows x 4 slots x (128 fp8 + 4 scale bytes)
    score = torch.zeros(5, 4, dtype=torch.float32)
    a = _appended("dsa_tail", [key.data_ptr(), 0, score.data_ptr(), 0], [key.nbytes, 0, score.nbytes, 0],
                  [key[0].nbytes, 0, score[0].nbytes, 0])
    made = component_pools(a, 0, HybridGeometry(dsa_tail_ratio=4), page_size=64, kv_dtype="bfloat16",
                           target_ids=(0, 1), draft_ids=())
    k, s = (m.spec for m in made)
    assert (k.name, k.kind, k.ratio, k.bytes_per_token, k.layer_ids) == ("index_tail_k", "state", 4, 4 * 132, (0,))
    assert (s.name, s.ratio, s.bytes_per_token) == ("index_tail_score", 4, 16)
    pool = type("P", (), {"kpool_use_compress": True, "index_kpool": 4, "tail_extra_slots": 0})()
    assert get_dsa_tail_state_indices(pool, 3, 10) == [3, 0, 2, 0, 0, 4]  # row 3, rows [0, 10 % 4)
    assert kvb.needed_extent(k, 10).num_rows == 2
    with pytest.raises(ConfigError, match="a ring of 6 slots for a kpool of 4") as err:
        component_pools(a, 0, HybridGeometry(dsa_tail_ratio=4, dsa_tail_slots=6), page_size=64, kv_dtype="bfloat16",
                        target_ids=(0, 1), draft_ids=())
    assert err.value.field == "dsa_tail_slots"


def test_request_row_is_one_replicated_slot_numbered_as_the_draft():
    mark = torch.zeros(6, dtype=torch.int64)  # DeepSeekV4TokenToKVPool.swa_valid_from: one int64 per request row
    a = _appended("request_row", [mark.data_ptr()], [mark.nbytes], [mark[0].nbytes])
    (made,) = component_pools(a, 0, HybridGeometry(), page_size=256, kv_dtype="bfloat16", target_ids=range(4),
                              draft_ids=(4,))
    assert (made.spec.kind, made.spec.bytes_per_token, made.spec.layer_ids, made.spec.shard_units) == \
        ("state", 8, (4,), ())
    assert made.ptrs == (mark.data_ptr(),)


# -- the sender and receiver: paged state indices must be the KV's pages; the others become units ---

SWA_SPECS = {n: kvb.window_pool(n, (0, 2), 32, window=40, page_size=16) for n in ("swa_k", "swa_v")}


def _sender(types, pages, prefix=0, state_of=None, specs=None, tokens=0):
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import StateType

    from kvbridge.integrations.sglang.sender import KVBridgeKVSender

    s = object.__new__(KVBridgeKVSender)  # only the check's state: no manager, no room
    s.kv_mgr = SimpleNamespace(kv_args=SimpleNamespace(state_types=[StateType(t) for t in types]), page_size=16,
                               cache=SimpleNamespace(state_of=state_of or {}, kind_specs=specs or {}))
    s._page_ids, s._prefix_pages, s.failures, s._tokens_given, s.request = [np.asarray(pages)], prefix, [], tokens, None
    s.fail = s.failures.append
    return s


def test_sender_checks_paged_state_indices_and_hands_the_others_as_units():
    s = _sender(["block_scale"], [5, 6], prefix=1)
    assert s._kind_units([np.array([9, 5, 6])], True) == {} and not s.failures  # every page; after the prefix
    assert s._kind_units([np.array([9, 5, 7])], True) is None
    assert "'block_scale' state indices (2 pages) are not the request's KV pages" in s.failures[0]
    s = _sender(["dsa"], [5, 6])
    assert s._kind_units([np.array([5, 6])], True) == {} and s._kind_units([np.array([6, 5])], True) is None
    # MAMBA: SGLang's _mamba_payload, [slot as a 0-d array], is each mamba pool's one unit
    s = _sender(["dsa", "mamba"], [5, 6], state_of={"mamba_0": "mamba", "mamba_1": "mamba"}, tokens=20)
    units = s._kind_units([np.array([5, 6]), [np.asarray(3)]], True)
    assert {k: v.tolist() for k, v in units.items()} == {"mamba_0": [3], "mamba_1": [3]} and not s.failures
    assert s._kind_units([np.array([5, 6]), None], True) is None
    assert "'mamba': 0 indices, expected the request's one slot" in s.failures[-1]
    assert s._kind_units([np.array([5, 6]), [np.array([3, 4])]], True) is None
    assert "2 indices, expected the request's one slot" in s.failures[-1]
    # SWA: the window's pages in the SWA pool (_swa_payload), each window pool's
    s = _sender(["swa"], [5, 6], state_of={"swa_k": "swa", "swa_v": "swa"}, specs=SWA_SPECS, tokens=40)
    units = s._kind_units([np.array([4, 1, 3], np.int32)], True)
    assert {k: v.tolist() for k, v in units.items()} == {"swa_k": [4, 1, 3], "swa_v": [4, 1, 3]}
    # V4's ring, tail and request state: the request row; a tail slot at a block boundary: the bound row
    ring = kvb.window_pool("swa_ring", (0, 1), 64, window=8, page_size=1, ring_stride=8)
    tail = kvb.state_pool("index_tail_k", (0,), 8 * 4, tail_ratio=8)
    s = _sender(["swa_ring", "dsa_tail"], [5], state_of={"swa_ring": "swa_ring", "index_tail_k": "dsa_tail"},
                specs={"swa_ring": ring, "index_tail_k": tail}, tokens=13)
    units = s._kind_units([np.arange(5, 13) % 8 + 3 * 8, [3, 5, 3, 0, 2, 8]], True)
    assert {k: v.tolist() for k, v in units.items()} == {"swa_ring": [3], "index_tail_k": [3]}
    s.request = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=2))
    s._tokens_given = 16  # 16 % 8 == 0: SGLang sends no tail index
    assert s._kind_units([np.arange(8, 16) % 8 + 2 * 8, []], True)["index_tail_k"].tolist() == [2]
    assert s._kind_units([np.array([3, 12]), []], True) is None  # rows of two requests
    assert "ring rows [3, 12].. are not one request's" in s.failures[-1]


def _receiver(types, state_of, num_tokens=None, specs=None):
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import StateType

    from kvbridge.integrations.sglang.receiver import KVBridgeKVReceiver

    r = object.__new__(KVBridgeKVReceiver)  # no manager, no room: what send_metadata checks and hands on
    r.kv_mgr = SimpleNamespace(kv_args=SimpleNamespace(state_types=[StateType(t) for t in types]), page_size=16,
                               cache=SimpleNamespace(state_of=state_of, kind_specs=specs or {
                                   p: kvb.state_pool(p, (0,), 64) for p in state_of}))
    r._failure, r.failures, r.inits, r.num_tokens, r.binding, r.request = None, [], [], num_tokens, b"", None
    r.fail = r.failures.append
    r._handle = SimpleNamespace(init=lambda *a, **kw: r.inits.append((a, kw)))
    return r


def test_receiver_hands_mamba_slots_swa_pages_and_rows_with_the_token_count_and_refuses_by_name():
    mamba = {"mamba_0": "mamba", "mamba_1": "mamba"}
    r = _receiver(["mamba"], mamba, num_tokens=50)
    r.send_metadata(np.array([7, 2, 12, 5]), 3, [[np.asarray(2)]])
    (args, kw), = r.inits
    assert args[2] == 50 and {k: v.tolist() for k, v in kw["kind_units"].items()} == {"mamba_0": [2], "mamba_1": [2]}
    r = _receiver(["mamba"], mamba)  # the decode hook (patches.py) did not run
    r.send_metadata(np.array([7]), 3, [[np.asarray(2)]])
    assert not r.inits and "need the request's token count" in r.failures[0]
    r = _receiver(["mamba"], mamba, num_tokens=50)
    r.send_metadata(np.array([7]), 3, [[np.array([2, 3])]])
    assert not r.inits and "2 indices, expected the request's one slot" in r.failures[0]
    swa = {"swa_k": "swa", "swa_v": "swa"}
    r = _receiver(["swa"], swa, num_tokens=100, specs=SWA_SPECS)
    r.send_metadata(np.array([7]), 3, None)
    assert not r.inits and "'swa': no window pages for pools ['swa_k', 'swa_v']" in r.failures[0]
    r = _receiver(["swa"], swa, num_tokens=100, specs=SWA_SPECS)
    r.send_metadata(np.arange(7), 3, [np.array([6, 3, 0, 4], np.int32)])
    assert r.inits[0][1]["kind_units"]["swa_v"].tolist() == [6, 3, 0, 4]
    tail = {"index_tail_k": kvb.state_pool("index_tail_k", (0,), 8 * 4, tail_ratio=8)}
    r = _receiver(["dsa_tail"], {"index_tail_k": "dsa_tail"}, num_tokens=100, specs=tail)
    r.send_metadata(np.array([7]), 3, [[1, 0, 4, 0, 0, 8]])  # get_dsa_tail_state_indices: [row, start, n1, ..]
    assert r.inits[0][1]["kind_units"]["index_tail_k"].tolist() == [1]
    r = _receiver(["dsa_tail"], {"index_tail_k": "dsa_tail"}, num_tokens=96, specs=tail)
    r.send_metadata(np.array([7]), 3, [[]])  # a block boundary, and no request row known: refused by name
    assert not r.inits and "no index at a block boundary and the request row is not known" in r.failures[0]


def test_a_pipeline_stage_with_unpaged_pools_is_refused_by_name(sgl, carried):
    """SGLang builds a Mamba hybrid's stage (here layers [2, 4) of 4: mamba layer 2, attention
    layer 3) with its own layers only: its KVArgs name none of the model's other layers of either
    pool; without the model config's layer pattern (test_sglang_pipeline_kinds.py) no stage can
    build the model's contract; refused by name, naming what it was given."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.disaggregation.utils import build_kv_layer_ids
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    from kvbridge.integrations.sglang.kvargs import model_specs

    carried(ALL_KINDS)
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=V_, n_groups=2, num_heads=HEADS, head_dim=16,
                                    state_size=16, conv_kernel=4, conv_shard_groups=[Q, K_, V_])
    mp = MambaPool(size=4, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[2]),
                   mamba_layer_ids=[2], device="cpu")
    pool = HybridLinearKVPool(size=64, dtype=torch.bfloat16, page_size=16, head_num=1, head_dim=8,
                              full_attention_layer_ids=[3], device="cpu", mamba_pool=mp)
    a = _kv_args(pool)
    a.prefill_start_layer, a.prefill_end_layer = 2, 4
    a.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=pool, draft_token_to_kv_pool=None, num_draft_entries=0,
                                        num_hidden_layers=4)
    own = pool_specs(read_kv_args(a, is_mla=False))
    assert {n: s.layer_ids for n, s in own.items()} == {"k": (3,), "v": (3,), "mamba_0": (2,), "mamba_1": (2,)}
    with pytest.raises(ConfigError, match=r"with window, compressed or state pools \['mamba_0 \(state\)', "
                       r"'mamba_1 \(state\)'\]: SGLang's KVArgs list this stage's own layers of each pool only "
                       r"\(k \[3\], mamba_0 \[2\], mamba_1 \[2\], v \[3\]\)") as err:
        model_specs(own, (2, 4), 4)
    assert err.value.field == "model_config"

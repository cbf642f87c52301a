"""SGLang 0.5.23's state components (``KVArgs.state_*``) in kvbridge's pool kinds.

SGLang's ``setup_state_kv_args`` appends one component per ``StateType``; each is a list of
buffers (pointer, bytes, item bytes) that SGLang addresses with its own index list per request.
kvbridge sees each as pools of one kind (``kvbridge.layout.kinds``):

    StateType (value)          kind        kvbridge pools         what SGLang registers, what it sends
    MAMBA (mamba)              state       mamba_0, mamba_1 ..    MambaPool's conv / temporal tensors x
                                                                  layer; one slot per request row, cut
                                                                  for attention TP (shard groups)
    SWA (swa), an SWA pool     window      swa_k, swa_v           SWAKVPool's SWA k then v pages (gpt-oss,
                                                                  Gemma 3); the pages of the last W tokens
    SWA (swa), DeepSeek-V4     window      swa (+ c4_state,       the SWA pages (V4 FlashMLA layout, pages
                                            c4_index_state)       padded to 576 B: page_stride), then the C4
                                                                  compressor rings, one per SWA page (window
                                                                  pools paged by the ring)
    BLOCK_SCALE_SWA            window      swa_k_scale, ..        MXFP8 scales of the SWA pages
    SWA_RING (swa_ring)        window      swa_ring (+ _rope)     V4's unified ring: row * stride + pos % stride
    DSA (dsa)                  paged       index                  V3.2's index K on the KV page mapping
                                                                  (kvargs.py builds it)
    BLOCK_SCALE (block_scale)  paged       k_scale, v_scale       MXFP8 per-32 UE8M0 scales of the k/v pages
    DSA_TAIL (dsa_tail)        state       index_tail_k, _score   one ring row per request: the index K of
                                                                  the n % kpool tokens not yet compressed
    DSV4_REQUEST_STATE         state       c128_state             V4's C128 compressor: one ring of 128
     (c128_state)                                                 token rows per request, n % 128 live
    REQUEST_ROW (request_row)  state       request_row            one item per request row (the DSpark
                                                                  draft's SWA valid-from)

DeepSeek-V4's KV lists themselves (``kv_data_*`` when ``KVArgs.mla_compression_ratios`` is set)
are its ``compressed`` caches by ratio: ``c4``, ``c4_index`` (ratio 4) and ``c128`` (``v4_kv_pools``),
on the KV's page ids. Their byte layout, and the SWA pages', is one of SGLang's two CUDA fp8
layouts (``KVArgs.kv_layout``, SGLang's ``pd_kv_layout``; read off the page sizes without it):

    layout (kv_layout)        a row (token / entry)                      a page               dtype (contract)
    FlashMLA V4 ("v4,c4:v4,   448 fp8 nope + 64 bf16 rope | 7 UE8M0      rows x 576 | rows x  v4_fp8_nope_bf16_rope
     c128:v4")                scales + 1 pad = 584 B (values_then_scales)  8, padded to whole
                                                                           576-B rows (page_stride)
    uniform fp8 (trtllm,      448 + 64 e4m3 values = 512 B, no scales     rows x 512, unpadded fp8_e4m3
     "uniform_fp8")           (the backend's unit scale)
    C4 indexer K (both)       128 fp8 | one fp32 scale = 132 B           rows x 128 | rows x 4 fp8_e4m3_with_scale

so an fp8-uniform prefill and a FlashMLA decode differ in ``pools.<pool>.dtype`` (and the row
bytes) and are refused at the handshake by name. SGLang's V4.1 layouts (SM100, fp4) are refused
naming ``kv_layout``; the unified KV's fp8 two-pool (HIP, ``SGLANG_DSV4_UNIFIED_KV_FP8``) is refused
naming ``kv_data_ptrs`` / ``state_data_ptrs`` (``v4_kv_pools``, ``_swa_ring``: why).

QSA and MiniMax components are not mapped (``NOT_MAPPED``). A component is built only when its
kind is one the room endpoints carry (``room_pool_kinds()``: ``kvbridge.ROOM_POOL_KINDS``);
``kvargs.read_kv_args`` refuses the others by name, naming the kind. Where the kind is carried but
SGLang's bytes do not fit a ``PoolSpec`` exactly (V4's fp8 two-pool, ratio-1/2 layers, C4 rings
under the unified KV, rings wider than the ratio), the builder here refuses by name, saying what
does not fit. ``kind_units`` turns SGLang's indices (what its payload builders hand the sender and
receiver) into each pool's units in the room. What ``KVArgs`` does not say (the
sliding window, which layers are SWA layers, ring sizes) comes from the model and the pool, in
``HybridGeometry``.

MAMBA: ``MambaPool`` registers its state tensor-major x layer: for each state tensor (conv,
then temporal) one entry per mamba layer, each a ``[slots + 1, ...]`` tensor whose item is one
request slot, with ``state_layer_ids`` (the model layer of each entry), ``state_dim_per_tensor``
(this rank's size of the TP slice axis; 0: replicated), ``state_slice_outer_counts`` (rows before
the slice axis; 1: outermost) and ``state_conv_shard_groups`` (the conv tensor's full sub-block
dims, e.g. GDN's [key_dim, key_dim, value_dim]; None for the temporal tensor): one ``state`` pool
per tensor, shard groups = the sub-block dims (conv) or the whole slice axis (heads). A slice axis
with rows before it (Kimi's transposed conv state) is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvbridge as kvb
from kvbridge import ConfigError, PoolSpec

PAGED, WINDOW, COMPRESSED, STATE = "paged", "window", "compressed", "state"
MAMBA, SWA, SWA_RING, DSA, DSA_TAIL = "mamba", "swa", "swa_ring", "dsa", "dsa_tail"
DSV4_REQUEST_STATE, REQUEST_ROW, BLOCK_SCALE, BLOCK_SCALE_SWA = "c128_state", "request_row", "block_scale", \
    "block_scale_swa"

# StateType value -> the kvbridge pool kind its pools are
STATE_KINDS: dict[str, str] = {
    MAMBA: STATE, SWA: WINDOW, BLOCK_SCALE_SWA: WINDOW, SWA_RING: WINDOW, DSA: PAGED, BLOCK_SCALE: PAGED,
    DSA_TAIL: STATE, DSV4_REQUEST_STATE: STATE, REQUEST_ROW: STATE,
}
# StateType values whose indices the sender and receiver hand to the room as kind_units
# (``kind_units``); DSA and BLOCK_SCALE ride on the KV's own pages (hard rule 3)
HANDED: frozenset[str] = frozenset({MAMBA, SWA, BLOCK_SCALE_SWA, SWA_RING, DSA_TAIL, DSV4_REQUEST_STATE,
                                    REQUEST_ROW})
# StateType values kvbridge has no mapping for, by the model family that registers them
NOT_MAPPED: dict[str, str] = {
    "qsa_pending": "QSA sparse-attention models (pending index-K rings)",
    "qsa_compressed": "QSA sparse-attention models (compressed KV)",
    "minimax_index_k": "MiniMax sparse-attention models (index K)",
    "minimax_dense_kv": "MiniMax sparse-attention models (dense KV)",
}
V4_ROW = (576, 8)  # FlashMLA's V4 layout: 448 fp8 nope + 64 bf16 rope values, then 7 UE8M0 scales + 1 pad
V4_PAGE_ALIGN = 576  # ... and a page padded to whole 576-byte rows (KVLayout.page_bytes)
V4_UNIFORM_FP8_ROW = 512  # trtllm's uniform fp8 pool: 448 nope + 64 rope e4m3 values, no scales, no padding
V4_TWO_POOL_ROW = (512, 462)  # the unified fp8 two-pool's nope row: 512 B, of which 448 latent + 14 scale bytes
FLASHMLA, UNIFORM_FP8 = "flashmla", "uniform_fp8"  # V4 KV byte layouts kvbridge maps (KVArgs.kv_layout)
MXFP8_BLOCK = 32  # values per UE8M0 scale
# pools whose rows are KV heads, head-major, like SGLang's k/v pools: sharded over attention TP
HEAD_SHARDED = frozenset({"swa_k", "swa_v", "k_scale", "v_scale", "swa_k_scale", "swa_v_scale"})
MXFP8_INTERLEAVED_PAGE = 128  # SGLang's MXFP8 pool swizzles its scales per page at this page size

__all__ = ["HANDED", "HEAD_SHARDED", "flat_indices", "geometry_of", "NOT_MAPPED", "STATE_KINDS",
           "HybridGeometry", "StatePool", "component_pools", "kind_units", "mamba_state_specs", "room_pool_kinds",
           "state_kind", "state_type_names", "v4_kv_layout", "v4_kv_pools"]


def flat_indices(idx: Any) -> np.ndarray:
    """SGLang's index payload of a state component (an array, or a list of arrays as
    ``_mamba_payload`` gives it), flat."""
    if isinstance(idx, (list, tuple)):
        if not idx:
            return np.zeros(0, np.int64)
        return np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in idx])
    return np.asarray(idx, dtype=np.int64).reshape(-1)


def geometry_of(queue: Any) -> HybridGeometry:
    """What ``KVArgs`` does not say, from the SGLang queue building the manager
    (``PrefillBootstrapQueue`` / ``DecodePreallocQueue``, ``patches.building_queue``): an
    ``SWAKVPool``'s SWA layers (its ``layers_mapping``) and the scheduler's
    ``sliding_window_size`` (the window SGLang's ``_swa_payload`` sends). Empty without a queue
    or an SWA pool; V4's pools are described by their own fields."""
    pool = getattr(queue, "token_to_kv_pool", None)
    window = getattr(getattr(queue, "scheduler", None), "sliding_window_size", None)
    if pool is not None and hasattr(pool, "compression_ratios"):
        return _v4_geometry(pool, window)
    tail = _dsa_tail_geometry(pool)
    mapping = getattr(pool, "layers_mapping", None)
    if pool is None or not isinstance(mapping, dict) or not hasattr(pool, "swa_kv_pool"):
        return HybridGeometry(**tail)
    swa = tuple(sorted(layer for layer, (_, is_swa) in mapping.items() if is_swa))
    return HybridGeometry(sliding_window=int(window or 0), swa_layer_ids=swa, **tail)


def _v4_geometry(pool: Any, window: Any) -> HybridGeometry:
    """A ``DeepSeekV4TokenToKVPool``'s geometry: the window SGLang's ``_swa_payload`` sends (the
    scheduler's ``sliding_window_size``; the pool's ``sliding_window`` without it), the unified
    ring's rows per request, the C4 compressor ring (``get_ring_size(4)``) and the request-scoped
    C128 state's ring (128 rows; 1: online)."""
    c128 = [p for p in getattr(pool, "compress_state_pools", ()) or () if p is not None and p.request_scoped]
    ring = int(c128[0].ring_size) if c128 else 128
    online = bool(c128 and c128[0].online)
    stride = int(getattr(pool, "unified_swa_ring_size", 0) or 0) if getattr(pool, "_unified_kv", False) else 0
    return HybridGeometry(sliding_window=int(window or getattr(pool, "sliding_window", 0) or 0),
                          swa_ring_stride=stride, c4_ring_size=int(pool.get_ring_size(4)),
                          c128_ring_size=128 if online else ring, c128_online=online)


def _dsa_tail_geometry(pool: Any) -> dict[str, int]:
    """The DSA kpool tail (``get_dsa_tail_state_indices``): the kpool size and its ring's rows."""
    kv = getattr(pool, "full_kv_pool", pool) if getattr(pool, "use_dsa", False) else pool
    if kv is None or not getattr(kv, "kpool_use_compress", False):
        return {}
    ratio = int(getattr(kv, "index_kpool", 0) or 0)
    return {"dsa_tail_ratio": ratio, "dsa_tail_slots": ratio + int(getattr(kv, "tail_extra_slots", 0) or 0)}


def room_pool_kinds() -> frozenset[str]:
    """The pool kinds the room endpoints carry (``kvbridge.ROOM_POOL_KINDS``; only paged pools
    where this kvbridge predates it)."""
    return frozenset(getattr(kvb, "ROOM_POOL_KINDS", frozenset({PAGED})))


def state_type_names(kv_args: Any) -> list[str]:
    """``KVArgs.state_types`` as their values (``StateType`` is a str enum)."""
    return [str(getattr(t, "value", t)) for t in (getattr(kv_args, "state_types", None) or [])]


def state_kind(state_type: str) -> str:
    """The kvbridge pool kind of an SGLang state type; ConfigError naming the family if unmapped."""
    if state_type in STATE_KINDS:
        return STATE_KINDS[state_type]
    family = NOT_MAPPED.get(state_type, f"models with SGLang state {state_type!r}")
    raise ConfigError(f"SGLang state {state_type!r} ({family}) has no kvbridge pool kind: kvbridge maps "
                      f"{sorted(STATE_KINDS)}; serve this model with --disaggregation-transfer-backend mooncake",
                      field="state_types")


@dataclass(frozen=True)
class HybridGeometry:
    """What ``KVArgs`` does not say about a hybrid model's state, from its config and its pool.

    ``sliding_window``: tokens a window layer attends (SWA pools; V4's ``sliding_window``);
    ``swa_layer_ids``: the model layers of an SWA pool (``SWAKVPool``'s ``swa_attention_layer_ids``);
    ``swa_ring_stride``: V4's unified ring rows per request (``unified_swa_ring_size``);
    ``c4_ring_size``: V4's C4 compressor ring rows per SWA page (``get_ring_size(4)``: 8, 16
    with speculative decoding);
    ``dsa_tail_ratio`` / ``dsa_tail_slots``: the DSA kpool size and its ring's rows (``index_kpool``,
    plus ``tail_extra_slots``); ``c128_ring_size`` / ``c128_online``: V4's C128 state ring
    (128 without speculation) or the online single row; ``attn_tp_size``: what Mamba state slots
    are cut for (0: read off ``state_conv_shard_groups``, the conv tensor's whole dims over its
    part). The head range of head-sharded pages is ``kvargs.pool_specs``' ``heads``, as for the
    k/v pools (``HEAD_SHARDED``)."""

    sliding_window: int = 0
    swa_layer_ids: tuple[int, ...] = ()
    swa_ring_stride: int = 0
    c4_ring_size: int = 8
    dsa_tail_ratio: int = 0
    dsa_tail_slots: int = 0
    c128_ring_size: int = 128
    c128_online: bool = False
    attn_tp_size: int = 0  # 0: read off the conv tensor (its full sub-block dims over this rank's part)


@dataclass(frozen=True)
class StatePool:
    """One kvbridge pool built from a state component: its spec and one SGLang buffer per layer
    id (pointer, bytes, item bytes), in the spec's layer order."""

    state_type: str
    spec: PoolSpec
    ptrs: tuple[int, ...]
    lens: tuple[int, ...]
    items: tuple[int, ...]


@dataclass(frozen=True)
class _Entries:
    """One state component's lists."""

    state_type: str
    ptrs: list[int]
    lens: list[int]
    items: list[int]

    def cut(self, lo: int, hi: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return tuple(self.ptrs[lo:hi]), tuple(self.lens[lo:hi]), tuple(self.items[lo:hi])


def component_pools(kv_args: Any, index: int, geometry: HybridGeometry, *, page_size: int, kv_dtype: str,
                    target_ids: Sequence[int], draft_ids: Sequence[int],
                    draft_component: bool = False) -> list[StatePool]:
    """The pools of state component ``index`` of ``kv_args`` (not DSA: ``kvargs`` builds the
    index pool). ``target_ids`` / ``draft_ids``: the KV pools' layer ids; ``draft_component``:
    the component is the draft's second one of its type (V4's NextN SWA). ConfigError naming the
    field where SGLang's bytes do not fit a kvbridge pool."""
    st = state_type_names(kv_args)[index]
    e = _Entries(st, [int(x) for x in kv_args.state_data_ptrs[index]], [int(x) for x in kv_args.state_data_lens[index]],
                 [int(x) for x in kv_args.state_item_lens[index]])
    if not (len(e.ptrs) == len(e.lens) == len(e.items)) or not e.ptrs:
        raise ConfigError(f"SGLang state {st!r}: {len(e.ptrs)}/{len(e.lens)}/{len(e.items)} ptrs/lens/items",
                          field="state_data_ptrs")
    ratios = getattr(kv_args, "mla_compression_ratios", None)
    prefix = "draft_" if draft_component else ""
    if st == MAMBA:
        specs = mamba_state_specs(kv_args, geometry.attn_tp_size)
        n = len(e.ptrs) // len(specs)
        return [StatePool(st, spec, *e.cut(t * n, (t + 1) * n)) for t, spec in enumerate(specs.values())]
    if st in (SWA, BLOCK_SCALE_SWA) and ratios is not None:
        return _v4_swa(e, ratios, kv_args, geometry, page_size)
    if st in (SWA, BLOCK_SCALE_SWA):
        ids = tuple(geometry.swa_layer_ids)
        if not ids:
            raise ConfigError(f"SGLang state {st!r}: the SWA layers' ids are not known (HybridGeometry.swa_layer_ids, "
                              "SWAKVPool's swa_attention_layer_ids)", field="swa_layer_ids")
        names = ("swa_k", "swa_v") if st == SWA else ("swa_k_scale", "swa_v_scale")
        return _k_then_v(e, names, ids, geometry, page_size, kv_dtype, window=_window(st, geometry))
    if st == BLOCK_SCALE:
        if page_size == MXFP8_INTERLEAVED_PAGE:
            raise ConfigError(f"SGLang state {st!r}: at page size {page_size} SGLang stores MXFP8 scales swizzled per "
                              "page (FA4's interleaved atom), so a partial page's rows are not a byte range",
                              field="pools.k_scale.layout")
        return _k_then_v(e, ("k_scale", "v_scale"), tuple(target_ids), geometry, page_size, kv_dtype)
    if st == SWA_RING:
        return _swa_ring(e, ratios, kv_args, geometry, tuple(draft_ids) if draft_component else tuple(target_ids),
                         prefix)
    if st == DSA_TAIL:
        return _dsa_tail(e, geometry, tuple(target_ids) + tuple(draft_ids))
    if st == DSV4_REQUEST_STATE:
        return _c128_state(e, ratios, kv_args, geometry)
    if st == REQUEST_ROW:
        if len(e.ptrs) != 1:
            raise ConfigError(f"SGLang state {st!r}: {len(e.ptrs)} buffers, expected the one request-row buffer",
                              field="state_data_ptrs")
        ids = tuple(draft_ids[:1]) or (max(target_ids) + 1,)  # the draft's mark: numbered as the draft's layer
        spec = _slot("request_row", ids, e.items[0], "int64", "sglang-request-row")
        return [StatePool(st, spec, *e.cut(0, 1))]
    raise ConfigError(f"SGLang state {st!r} has no pool builder here", field="state_types")


def _slot(name: str, ids: Sequence[int], nbytes: int, dtype: str, kernel_abi: str, ratio: int = 0) -> PoolSpec:
    """A replicated state slot of ``nbytes`` raw bytes (``ratio``: a tail slot of that many rows)."""
    return PoolSpec(name=name, dtype=dtype, abi="uint8", bytes_per_token=nbytes, page_size=1, layer_ids=tuple(ids),
                    kind=STATE, ratio=ratio, kernel_abi=kernel_abi)


def v4_kv_pools(kv_args: Any, page_size: int) -> list[StatePool]:
    """DeepSeek-V4's KV lists (``get_contiguous_buf_infos``): not one pool per layer but its
    compressed caches by ratio, ``[C4 KV, C4 indexer K, C128 KV]`` over the stage's layers of each
    ratio: ``compressed`` pools of ``page_size // ratio`` entries per page, in the KV layout
    (``v4_kv_layout``: FlashMLA's pages padded to whole 576-byte rows, or trtllm's uniform fp8).
    ConfigError by name where the bytes do not fit: pages of another size, the unified KV's fp8
    two-pool (a rope group after each nope group; padding inside every nope row), ratio-1/2 layers."""
    ratios = list(kv_args.mla_compression_ratios)
    e = _Entries("kv", [int(x) for x in kv_args.kv_data_ptrs], [int(x) for x in kv_args.kv_data_lens],
                 [int(x) for x in kv_args.kv_item_lens])
    # [C4 KV, C4 indexer, C128 KV] over the layers (C4 KV and C128 KV twice in the fp8 two-pool)
    def fits(a: int, b: int) -> bool:
        c4, c128 = _layers(ratios, a, b, 4), _layers(ratios, a, b, 128)
        return len(e.ptrs) in (2 * c4 + c128, 3 * c4 + 2 * c128)

    start, stop = _stage(kv_args, ratios, fits)
    if any(r in (1, 2) for r in ratios):
        raise ConfigError("DeepSeek-V4 KV with ratio-1/2 layers (V4.1 kv_source caches): no kvbridge pool describes "
                          "them", field="mla_compression_ratios")
    layout = v4_kv_layout(kv_args)
    groups = [(name, r, [i for i in range(start, stop) if ratios[i] == r]) for name, r in
              (("c4", 4), ("c4_index", 4), ("c128", 128))]
    groups = [g for g in groups if g[2]]
    single = sum(len(ids) for _, _, ids in groups)
    two_pool = single + sum(len(ids) for name, _, ids in groups if name != "c4_index")
    if len(e.ptrs) == two_pool != single:
        raise ConfigError(
            f"DeepSeek-V4 KV: {len(e.ptrs)} buffers are SGLang's fp8 two-pool (SGLANG_DSV4_UNIFIED_KV_FP8 on the "
            "unified KV, HIP): a bf16 rope group (128 B rows) after each nope group, whose rows are "
            f"{V4_TWO_POOL_ROW[0]} B of which {V4_TWO_POOL_ROW[1]} carry data (448 fp8 latent + 14 B of E8M0 tile "
            f"scales) and {V4_TWO_POOL_ROW[0] - V4_TWO_POOL_ROW[1]} B no kernel writes: padding inside every row, "
            "which a kvbridge pool (pages padded at their end only, page_stride) cannot leave behind; and under the "
            "unified KV V4's C4 compressor rings are by request row, which SGLang's SWA index list does not "
            "address (pools.c4_state.kind). Serve it with --disaggregation-transfer-backend mooncake",
            field="kv_data_ptrs")
    if single != len(e.ptrs):
        raise ConfigError(f"DeepSeek-V4 KV: {len(e.ptrs)} buffers for C4 layers, their indexer and C128 layers "
                          f"({[len(ids) for _, _, ids in groups]})", field="kv_data_ptrs")
    out, at = [], 0
    for name, r, ids in groups:
        ptrs, lens, items = e.cut(at, at + len(ids))
        at += len(ids)
        entries = page_size // r
        if name == "c4_index":  # SGLang's fp8 indexer K, whatever the KV layout: unpadded pages
            _v4_page_stride(name, items, entries, 132, padded=False)
            spec = PoolSpec(name=name, dtype="fp8_e4m3_with_scale", abi="uint8", bytes_per_token=132,
                            page_size=entries, layer_ids=tuple(ids), layout="values_then_scales",
                            value_bytes_per_token=128, scale_bytes_per_token=4, kernel_abi="v4-indexer-k-fp8",
                            kind=COMPRESSED, ratio=r)
        else:
            spec = _v4_kv_spec(name, ids, items, entries, layout, kind=COMPRESSED, ratio=r)
        out.append(StatePool("kv", spec, ptrs, lens, items))
    return out


def v4_kv_layout(kv_args: Any) -> str:
    """The V4 KV byte layout of ``kv_args``: ``KVArgs.kv_layout`` as SGLang's ``pd_kv_layout`` sets
    it (``"uniform_fp8"``: trtllm's pool; ``"v4,c4:v4,c128:v4"``: FlashMLA's), or ``""`` (not given:
    read off the page sizes). The V4.1 layouts (SM100 FlashMLA, fp4 compressed caches) are
    refused naming ``kv_layout``: their byte layouts are not pinned here."""
    tag = getattr(kv_args, "kv_layout", None)
    if not tag:
        return ""
    if tag == UNIFORM_FP8:
        return UNIFORM_FP8
    parts = [part.split(":")[-1] for part in str(tag).split(",")]
    if any(part != "v4" for part in parts):
        raise ConfigError(f"DeepSeek-V4 KV layout {tag!r} (SGLang's V4.1 FlashMLA / fp4 layouts, "
                          "SGLANG_DSV4_KV_LAYOUT): its byte layout is not pinned in kvbridge; kvbridge maps 'v4' "
                          "(FlashMLA fp8 nope + bf16 rope) and 'uniform_fp8' (trtllm)", field="kv_layout")
    return FLASHMLA


def _v4_kv_spec(name: str, ids: Sequence[int], items: Sequence[int], rows: int, layout: str,
                **kind: Any) -> PoolSpec:
    """A V4 KV pool (SWA pages or compressed entries) of ``rows`` rows a page in ``layout`` (module
    docstring); ``""``: the uniform layout if the pages are ``rows`` x 512 B, else FlashMLA's.
    ConfigError naming the pool where SGLang's pages are another size."""
    uniform_page = rows * V4_UNIFORM_FP8_ROW
    if layout == UNIFORM_FP8 or (not layout and set(items) == {uniform_page}):
        if set(items) != {uniform_page}:
            raise ConfigError(f"pool {name!r}: DeepSeek-V4 uniform fp8 pages are {sorted(set(items))} B, not {rows} "
                              f"rows of {V4_UNIFORM_FP8_ROW} B ({uniform_page} B)",
                              field=f"pools.{name}.bytes_per_page")
        return PoolSpec(name=name, dtype="fp8_e4m3", abi="uint8", bytes_per_token=V4_UNIFORM_FP8_ROW, page_size=rows,
                        layer_ids=tuple(ids), kernel_abi="v4-uniform-fp8", **kind)
    stride = _v4_page_stride(name, items, rows, sum(V4_ROW), padded=True)
    return PoolSpec(name=name, dtype="v4_fp8_nope_bf16_rope", abi="uint8", bytes_per_token=sum(V4_ROW), page_size=rows,
                    layer_ids=tuple(ids), layout="values_then_scales", value_bytes_per_token=V4_ROW[0],
                    scale_bytes_per_token=V4_ROW[1], kernel_abi="flashmla-v4", page_stride=stride, **kind)


def _v4_page_stride(name: str, items: Sequence[int], rows: int, row_bytes: int, *, padded: bool) -> int:
    """The registered page of a V4 FlashMLA pool: ``rows`` rows of ``row_bytes``, padded to whole
    576-byte rows (``bytes_per_page_padded``) where ``padded``; its stride, or ConfigError naming
    the pool when SGLang registers another size."""
    payload = rows * row_bytes
    want = -(-payload // V4_PAGE_ALIGN) * V4_PAGE_ALIGN if padded else payload
    if set(items) != {want}:
        pad = f" padded to whole {V4_PAGE_ALIGN}-byte rows ({want} B)" if padded else ""
        raise ConfigError(f"pool {name!r}: DeepSeek-V4 pages are {sorted(set(items))} B, not {rows} rows of {row_bytes} "
                          f"B ({payload} B){pad}", field=f"pools.{name}.bytes_per_page")
    return want


def _window(state_type: str, geometry: HybridGeometry) -> int:
    if geometry.sliding_window <= 0:
        raise ConfigError(f"SGLang state {state_type!r}: the sliding window is not known (HybridGeometry."
                          "sliding_window, the model config's sliding_window)", field="sliding_window")
    return geometry.sliding_window


def _k_then_v(e: _Entries, names: tuple[str, str], ids: tuple[int, ...], geometry: HybridGeometry, page_size: int,
              kv_dtype: str, *, window: int = 0) -> list[StatePool]:
    """k entries then v entries, one per layer of ``ids``: paged (or window) pools of pages,
    whole KV heads per row like SGLang's k/v pools (``HEAD_SHARDED``: ``kvargs.pool_specs`` cuts
    them for a rank's heads)."""
    if len(e.ptrs) != 2 * len(ids):
        raise ConfigError(f"SGLang state {e.state_type!r}: {len(e.ptrs)} buffers for k and v of {len(ids)} layers "
                          f"{list(ids)}", field="state_data_ptrs")
    scales = e.state_type in (BLOCK_SCALE, BLOCK_SCALE_SWA)
    dtype = "ue8m0" if scales else kv_dtype
    abi = "uint8" if scales or kv_dtype.startswith("fp8") else kv_dtype
    out = []
    for half, name in enumerate(names):
        ptrs, lens, items = e.cut(half * len(ids), (half + 1) * len(ids))
        if len(set(items)) != 1 or items[0] % page_size:
            raise ConfigError(f"pool {name!r}: items {sorted(set(items))} B are not pages of {page_size} token rows",
                              field=f"pools.{name}.bytes_per_page")
        kind = {"kind": WINDOW, "window": window} if window else {}
        spec = PoolSpec(name=name, dtype=dtype, abi=abi, bytes_per_token=items[0] // page_size, page_size=page_size,
                        layer_ids=ids, kernel_abi="mxfp8-ue8m0-per-token" if scales else "", **kind)
        out.append(StatePool(e.state_type, spec, ptrs, lens, items))
    return out


def _v4_swa(e: _Entries, ratios: Sequence[int], kv_args: Any, geometry: HybridGeometry,
            page_size: int) -> list[StatePool]:
    """V4's SWA component: [SWA pages x stage layers, C4 compressor ring x C4 layers, C4 indexer
    ring x C4 layers] (the SWA pages are absent under the unified ring), one SGLang index list
    for all: the window's SWA pages.

        SWA page s          | 256 rows x 584 B (values | scales) | pad |    window pool 'swa'
        C4 ring of page s   | ring rows: position p at p % ring |         window pools 'c4_state',
                                                                           'c4_index_state'

    A C4 ring is one per SWA page (``translate_from_swa_loc_to_state_loc``: state row = SWA page
    x ring + p % ring), so kvbridge pages it by ``ring`` tokens: logical page l of the ring pool
    is tokens [l * ring, (l + 1) * ring), on the ring of the SWA page holding them (``kind_units``
    maps it), a window of the last ``ring`` positions (the overlap compressor's live rows,
    ``c4_state_transfer_indices``: n % 4 + 4 of them, within the last ``ring``)."""
    start, stop = _stage(kv_args, ratios, lambda a, b: len(e.ptrs) - 2 * _layers(ratios, a, b, 4) in (0, b - a))
    c4 = [i for i in range(start, stop) if ratios[i] == 4]
    num_swa = len(e.ptrs) - 2 * len(c4)
    if num_swa not in (0, stop - start):
        raise ConfigError(f"DeepSeek-V4 SWA state: {len(e.ptrs)} buffers for {stop - start} layers and {len(c4)} C4 "
                          "layers", field="state_data_ptrs")
    out = []
    if num_swa:
        spec = _v4_kv_spec("swa", range(start, stop), e.items[:num_swa], page_size, v4_kv_layout(kv_args),
                           kind=WINDOW, window=_window(e.state_type, geometry))
        out.append(StatePool(e.state_type, spec, *e.cut(0, num_swa)))
    if c4 and not num_swa:
        raise ConfigError("DeepSeek-V4 C4 compressor rings under the unified KV (HIP): they are rings by request row "
                          "there, and SGLang's SWA index list (the window's SWA pages, which the unified KV does not "
                          "have) does not address them", field="pools.c4_state.kind")
    ring = geometry.c4_ring_size
    if c4 and (ring <= 0 or page_size % ring or ring > _window(e.state_type, geometry)):
        raise ConfigError(f"DeepSeek-V4 C4 compressor ring of {ring} rows: kvbridge pages it inside the "
                          f"{page_size}-token SWA pages and the window, so it must divide the page and fit the "
                          f"window of {geometry.sliding_window}", field="c4_ring_size")
    for h, name in enumerate(("c4_state", "c4_index_state") if c4 else ()):
        ptrs, lens, items = e.cut(num_swa + h * len(c4), num_swa + (h + 1) * len(c4))
        if len(set(items)) != 1 or items[0] % (ring * 4):
            raise ConfigError(f"pool {name!r}: items of {sorted(set(items))} B are not rings of {ring} fp32 rows",
                              field=f"pools.{name}.bytes_per_token")
        spec = PoolSpec(name=name, dtype="float32", abi="float32", bytes_per_token=items[0] // ring, page_size=ring,
                        layer_ids=tuple(c4), kernel_abi="v4-compressor-c4-ring", kind=WINDOW, window=ring)
        out.append(StatePool(e.state_type, spec, ptrs, lens, items))
    return out


def _layers(ratios: Sequence[int], start: int, end: int, ratio: int) -> int:
    """How many of layers ``[start, end)`` compress at ``ratio``."""
    return sum(1 for r in ratios[start:end] if r == ratio)


def _stage(kv_args: Any, ratios: Sequence[int], fits: Callable[[int, int], bool]) -> tuple[int, int]:
    """The stage's layers ``[start, end)``. SGLang sets ``prefill_end_layer`` from the pool's
    ``end_layer``, which is inclusive (``layer_num - 1``) for a pool of the whole model and the
    exclusive end for a pipeline stage's. So ``[0, L - 1)`` is either the whole model or a first
    stage of all but the last layer: ``fits(start, end)`` (the component's buffers in the KVArgs
    are those of these layers) tells them apart; the whole model when both fit."""
    start = int(getattr(kv_args, "prefill_start_layer", 0) or 0)
    end = getattr(kv_args, "prefill_end_layer", None)
    last = len(ratios)
    if end is None or (start == 0 and int(end) == last):
        return start, last
    if start == 0 and int(end) == last - 1:
        return (0, last - 1) if fits(0, last - 1) and not fits(0, last) else (0, last)
    return start, int(end)


def _swa_ring(e: _Entries, ratios: Sequence[int] | None, kv_args: Any, geometry: HybridGeometry,
              ids: tuple[int, ...], prefix: str) -> list[StatePool]:
    """V4's unified SWA ring: one buffer per layer of token rows, row ``req * stride + pos %
    stride`` (bf16 rows). The fp8 two-pool's ring (nope rows, then rope rows: two buffers a
    layer) is refused naming ``state_data_ptrs``: padding inside every nope row."""
    if not geometry.swa_ring_stride:
        raise ConfigError("SGLang state 'swa_ring': the ring's rows per request are not known (HybridGeometry."
                          "swa_ring_stride, the pool's unified_swa_ring_size)", field="swa_ring_stride")
    if not prefix and ratios is not None:
        start, stop = _stage(kv_args, ratios, lambda a, b: len(e.ptrs) in (b - a, 2 * (b - a)))
        ids = tuple(range(start, stop))
    parts = len(e.ptrs) // max(len(ids), 1)
    if parts not in (1, 2) or parts * len(ids) != len(e.ptrs):
        raise ConfigError(f"SGLang state 'swa_ring': {len(e.ptrs)} buffers for layers {list(ids)}",
                          field="state_data_ptrs")
    if parts == 2:
        raise ConfigError(
            f"SGLang state 'swa_ring': {len(e.ptrs)} buffers are the fp8 two-pool's ring (SGLANG_DSV4_UNIFIED_KV_FP8): "
            f"nope rows of {V4_TWO_POOL_ROW[0]} B of which {V4_TWO_POOL_ROW[1]} carry data, then the bf16 rope rows; "
            "the 50 unwritten bytes of every nope row are padding a ring slot cannot leave behind (kvbridge pads "
            "pages at their end only), so the ring is not carried", field="state_data_ptrs")
    out = []
    for p, part in enumerate(("", "_rope")[:parts]):
        name = f"{prefix}swa_ring{part}"
        ptrs, lens, items = e.cut(p * len(ids), (p + 1) * len(ids))
        spec = kvb.window_pool(name, ids, items[0], window=_window(e.state_type, geometry), page_size=1,
                               dtype="bfloat16", ring_stride=geometry.swa_ring_stride, kernel_abi="v4-unified-swa-ring")
        if len(set(items)) != 1:
            raise ConfigError(f"pool {name!r}: rows of {sorted(set(items))} B", field=f"pools.{name}.bytes_per_token")
        out.append(StatePool(e.state_type, spec, ptrs, lens, items))
    return out


def _dsa_tail(e: _Entries, geometry: HybridGeometry, ids: tuple[int, ...]) -> list[StatePool]:
    """The DSA kpool tail: key rows then score rows, one buffer per layer (0-byte items: layers
    without index K), one ring row of ``dsa_tail_slots`` token slots per request; token p at slot
    p % slots. A kvbridge tail slot (rows [0, n % R)) when the ring is the kpool size R."""
    r, slots = geometry.dsa_tail_ratio, geometry.dsa_tail_slots or geometry.dsa_tail_ratio
    if r <= 1:
        raise ConfigError("SGLang state 'dsa_tail': the DSA kpool size is not known (HybridGeometry.dsa_tail_ratio, "
                          "the pool's index_kpool)", field="dsa_tail_ratio")
    if slots != r:
        raise ConfigError(f"SGLang state 'dsa_tail': a ring of {slots} slots for a kpool of {r} (tail_extra_slots, "
                          "speculative decoding) puts the live rows at (n - n % R) % slots; kvbridge's tail slot "
                          "holds them from row 0", field="dsa_tail_slots")
    half = len(e.ptrs) // 2
    if 2 * half != len(e.ptrs) or half > len(ids):
        raise ConfigError(f"SGLang state 'dsa_tail': {len(e.ptrs)} buffers, not key and score halves of the "
                          f"{len(ids)} layers", field="state_data_ptrs")
    out = []
    for h, name in enumerate(("index_tail_k", "index_tail_score")):
        ptrs, lens, items = e.cut(h * half, (h + 1) * half)
        keep = [i for i, item in enumerate(items) if item > 0]
        if not keep:
            continue
        sizes = {items[i] for i in keep}
        if len(sizes) != 1 or sizes.pop() % r:
            raise ConfigError(f"pool {name!r}: ring rows of {sorted({items[i] for i in keep})} B are not {r} slots",
                              field=f"pools.{name}.bytes_per_token")
        spec = _slot(name, [ids[i] for i in keep], items[keep[0]], "fp8_e4m3_with_scale" if h == 0 else "float32",
                     "sglang-dsa-kpool-tail", ratio=r)
        out.append(StatePool(e.state_type, spec, tuple(ptrs[i] for i in keep), tuple(lens[i] for i in keep),
                             tuple(items[i] for i in keep)))
    return out


def _c128_state(e: _Entries, ratios: Sequence[int] | None, kv_args: Any,
                geometry: HybridGeometry) -> list[StatePool]:
    """V4's request-scoped C128 compressor state: one buffer per C128 layer of the stage; an
    item is 128 token rows (offline: token p at row p % 128, the n % 128 live ones from row 0) or
    one online row. A kvbridge tail slot of ratio 128 by request row when the ring is 128 rows."""
    if ratios is None:
        raise ConfigError("SGLang state 'c128_state' without KVArgs.mla_compression_ratios",
                          field="mla_compression_ratios")
    if any(r in (1, 2) for r in ratios):
        raise ConfigError("SGLang state 'c128_state' with ratio-1/2 layers: their pending-pair rings share the "
                          "component with the C128 state and no kvbridge kind describes them",
                          field="mla_compression_ratios")
    start, stop = _stage(kv_args, ratios, lambda a, b: len(e.ptrs) == _layers(ratios, a, b, 128))
    ids = [i for i in range(start, stop) if ratios[i] == 128]
    if len(ids) != len(e.ptrs):
        raise ConfigError(f"SGLang state 'c128_state': {len(e.ptrs)} buffers for C128 layers {ids}",
                          field="state_data_ptrs")
    if geometry.c128_ring_size != 128 and not geometry.c128_online:
        raise ConfigError(f"SGLang state 'c128_state': a ring of {geometry.c128_ring_size} rows (speculative decoding) "
                          "holds two 128-token pages per request, sent by (n - 1) % ring; kvbridge's tail slot is one "
                          "page per request row", field="c128_ring_size")
    if len(set(e.items)) != 1:
        raise ConfigError(f"pool 'c128_state': items of {sorted(set(e.items))} B",
                          field="pools.c128_state.bytes_per_token")
    tail = {} if geometry.c128_online else {"tail_ratio": 128}
    spec = kvb.state_pool("c128_state", ids, e.items[0], dtype="float32", kernel_abi="v4-compressor-c128", **tail)
    return [StatePool(e.state_type, spec, *e.cut(0, len(ids)))]


def mamba_state_specs(kv_args: Any, attn_tp_size: int) -> dict[str, kvb.PoolSpec]:
    """The MAMBA component of ``kv_args`` as state pools of this rank (cut for ``attn_tp_size``; 0:
    read off the conv tensor's ``state_conv_shard_groups``)."""
    types = state_type_names(kv_args)
    if MAMBA not in types:
        raise ConfigError(f"no mamba state component among {types}", field="state_types")
    c = types.index(MAMBA)
    lists = {}
    for name in ("state_item_lens", "state_layer_ids", "state_dim_per_tensor", "state_slice_outer_counts",
                 "state_conv_shard_groups"):
        given = getattr(kv_args, name, None)
        if given is None or len(given) <= c or given[c] is None:
            raise ConfigError(f"SGLang state 'mamba': KVArgs.{name} does not describe the mamba component (SGLang's "
                              "setup_state_kv_args fills it): its state pools cannot be described", field=name)
        lists[name] = list(given[c])
    items, layers, dims = lists["state_item_lens"], lists["state_layer_ids"], lists["state_dim_per_tensor"]
    outer, groups = lists["state_slice_outer_counts"], lists["state_conv_shard_groups"]
    if not (len(items) == len(layers) == len(dims) == len(outer) == len(groups)) or not items:
        raise ConfigError(f"mamba state lists differ in length: items {len(items)}, layer ids {len(layers)}, dims "
                          f"{len(dims)}, outer counts {len(outer)}, conv groups {len(groups)}", field="state_item_lens")
    if not attn_tp_size:  # the conv tensor's whole sub-block dims over this rank's part of them
        tps = {sum(g) // d for g, d in zip(groups, dims) if g and d and sum(g) % d == 0}
        if len(tps) != 1:
            raise ConfigError("the attention TP size that cuts the mamba state is not given and no conv tensor's "
                              "state_conv_shard_groups tells it", field="attn_tp_size")
        attn_tp_size = tps.pop()
    num_layers = len(dict.fromkeys(layers))
    if len(items) % num_layers:
        raise ConfigError(f"{len(items)} mamba entries are not whole tensors of {num_layers} layers",
                          field="state_layer_ids")
    specs: dict[str, kvb.PoolSpec] = {}
    for t in range(len(items) // num_layers):
        at = slice(t * num_layers, (t + 1) * num_layers)
        name = f"mamba_{t}"
        ids, item = layers[at], set(items[at])
        dim, out, grp = set(dims[at]), set(outer[at]), {tuple(g) if g else None for g in groups[at]}
        if len(item) != 1 or len(dim) != 1 or len(out) != 1 or len(grp) != 1:
            raise ConfigError(f"{name}: the layers of one state tensor differ in item size, slice dim, outer count "
                              "or conv groups", field=f"pools.{name}")
        item_bytes, local, rows, sub = item.pop(), dim.pop(), out.pop(), grp.pop()
        if not local:
            specs[name] = kvb.state_pool(name, ids, item_bytes, dtype="bfloat16" if item_bytes % 4 else "float32")
            continue
        if rows != 1:
            raise ConfigError(f"{name}: the TP slice axis has {rows} rows before it in a slot (a transposed conv "
                              "state): its TP part is not one range per group; kvbridge cuts outermost axes only",
                              field=f"pools.{name}.state_slice_outer_counts")
        if item_bytes % local:
            raise ConfigError(f"{name}: {item_bytes} B per slot is not {local} indices of the slice axis",
                              field=f"pools.{name}.state_item_lens")
        unit = item_bytes // local
        units = tuple(sub) if sub else (local * attn_tp_size,)
        if sum(units) != local * attn_tp_size:
            raise ConfigError(f"{name}: conv groups {units} do not add up to {local} x attn TP {attn_tp_size}",
                              field=f"pools.{name}.state_conv_shard_groups")
        specs[name] = kvb.state_pool(name, ids, dtype="bfloat16" if unit % 4 else "float32", shard_units=units,
                                     unit_bytes=unit, tp_size=attn_tp_size)
    return specs


def kind_units(specs: Mapping[str, PoolSpec], state_of: Mapping[str, str], types: Sequence[str],
               state_indices: Any, *, num_tokens: int | None, kv_pages: np.ndarray, page_size: int,
               request_row: int | None = None, last: bool = True) -> dict[str, np.ndarray]:
    """The room's ``kind_units`` from what SGLang hands a sender (per chunk; state indices with the
    last) or a receiver (``send_metadata``), for a request of ``num_tokens`` tokens:

        pools                              SGLang's index (per component)      kvbridge unit
        c4, c4_index, c128 (V4's KV)       the request's KV pages (kv_pages)   the page of each entry page
        mamba_*                            the MambaPool slot                  the slot
        swa_k/v(+_scale), swa (V4)         the window's SWA pages              the page of each window page
        c4_state, c4_index_state (V4)      (the same SWA pages)                the SWA page of each ring page
        swa_ring (+_rope)                  ring rows req * stride + p % stride the request row
        index_tail_*                       [req, start, n1, 0, n2, slots]      the request row
        c128_state, request_row            [req's ring page] / [req]           the request row

    A component without pools here is skipped; ``last`` False: the KV's only (state comes with the
    last chunk), every page given so far (``num_tokens`` None: not cut to what decode needs). At a block boundary SGLang sends no tail index (nothing of it is live): the unit
    is ``request_row`` (0 rows travel from it). ConfigError naming the component where its
    indices do not fit."""
    units: dict[str, np.ndarray] = {}
    pages = np.asarray(kv_pages, dtype=np.int64).reshape(-1)
    for pool, spec in specs.items():  # V4's compressed KV: entry page l is KV page l's
        if spec.kind == COMPRESSED and pool not in state_of:
            units[pool] = pages if num_tokens is None else pages[:kvb.needed_extent(spec, num_tokens).count]
    if not last:
        return units
    if num_tokens is None:
        raise ConfigError("the last chunk's state units need the request's token count", field="num_tokens")
    given = list(state_indices or [])
    for at, st in enumerate(types):
        pools = [p for p, t in state_of.items() if t == st]
        if not pools or st not in HANDED:
            continue
        idx = given[at] if at < len(given) else None
        got = flat_indices(idx) if idx is not None else np.zeros(0, np.int64)
        if st == MAMBA:
            units.update({p: _one(st, got) for p in pools})
        elif st in (SWA, BLOCK_SCALE_SWA):
            units.update(_window_units(st, pools, specs, got, num_tokens, page_size))
        elif st == SWA_RING:
            stride = specs[pools[0]].ring_stride
            rows = np.unique(got // stride)
            if rows.size != 1:
                raise ConfigError(f"SGLang state 'swa_ring': ring rows {got[:4].tolist()}.. are not one request's "
                                  f"(row x {stride} + pos % {stride})", field="state_indices")
            units.update({p: rows for p in pools})
        elif got.size or st == REQUEST_ROW or not all(specs[p].ratio for p in pools):
            # DSA tail: [row, start, n1, 0, n2, slots]; C128: [the row's ring page]; request row: [row]
            units.update({p: _one(st, got[:1] if st == DSA_TAIL else got) for p in pools})
        elif request_row is None:
            raise ConfigError(f"SGLang state {st!r}: no index at a block boundary and the request row is not known",
                              field="state_indices")
        else:  # a tail slot at a block boundary: none of its rows live, none travel
            units.update({p: np.array([request_row], np.int64) for p in pools})
    return units


def _one(st: str, got: np.ndarray) -> np.ndarray:
    if got.size != 1:
        raise ConfigError(f"SGLang state {st!r}: {got.size} indices, expected the request's one slot",
                          field="state_indices")
    return got


def _window_units(st: str, pools: Sequence[str], specs: Mapping[str, PoolSpec], got: np.ndarray, num_tokens: int,
                  page_size: int) -> dict[str, np.ndarray]:
    """An SWA component's units: its pages are the window's (SGLang's ``_swa_payload``: the pages
    from ``floor((n - W) / page)``), each window pool's own; a pool paging finer (V4's C4 rings,
    one per SWA page) takes, per logical page, the SWA page holding it."""
    on_pages = [p for p in pools if specs[p].page_size == page_size]
    if not got.size:
        raise ConfigError(f"SGLang state {st!r}: no window pages for pools {sorted(pools)}", field="state_indices")
    window = specs[on_pages[0]].window if on_pages else 0
    first = max(0, num_tokens - window) // page_size
    out = {p: got for p in on_pages}
    for p in pools:
        if p in out:
            continue
        ext = kvb.needed_extent(specs[p], num_tokens)
        at = np.arange(ext.first, ext.stop, dtype=np.int64) * specs[p].page_size // page_size - first
        if not on_pages or at.size and (at.min() < 0 or at.max() >= got.size):
            raise ConfigError(f"pool {p!r}: its window's SWA pages are not among the {got.size} SGLang sent",
                              field="state_indices")
        out[p] = got[at]
    return out

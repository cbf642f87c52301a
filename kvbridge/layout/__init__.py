"""Pure geometry and planning: pools, pages, owner lanes, row domains and
transfer plans, head slices for heterogeneous TP, staged (gather / wire / scatter) plans, pool kinds
(window, compressed, request state) and the pools of hybrid models. No I/O, no threads, no device
calls."""

from kvbridge.layout.aux import AuxRegion, AuxRow, AuxSchema, aux_dtype, float32_to_bf16_bits, owner_of_last_token
from kvbridge.layout.buffers import RawBuffer
from kvbridge.layout.heads import (
    HeadGeometry,
    HeadSlice,
    head_slices,
    pair_head_buffers,
    plan_head_transfer,
    rank_heads,
    slices_to_send,
    tp_spec,
)
from kvbridge.layout.hybrid import (
    KIND_PRESETS,
    compressed_pool,
    deepseek_v4_layer_types,
    deepseek_v4_pools,
    mamba_pools,
    state_pool,
    window_pool,
)
from kvbridge.layout.kinds import (
    KINDS,
    Extent,
    check_kind_topology,
    chunk_extent,
    lane_units,
    needed_bytes,
    needed_extent,
    plan_kind,
    row_bytes,
    state_slices,
    state_tp_spec,
    tail_tokens,
)
from kvbridge.layout.lanes import LANE_RULES, OwnerLanes, has_repeats
from kvbridge.layout.pairing import BufferDesc, describe_buffer
from kvbridge.layout.plan import TransferPlan, plan_transfer
from kvbridge.layout.pools import LAYOUTS, PRESETS, PoolSpec, deepseek_pools, preset_pools
from kvbridge.layout.rows import (
    LocalRows,
    RowDomain,
    build_rank_rows,
    local_row_order,
    request_bases,
    strip_padding,
    valid_row_index,
)
from kvbridge.layout.stages import check_stage_layers, layer_range_specs, stage_conflict, stage_layer_ids, stage_specs
from kvbridge.layout.staging import PathThresholds, StagedPlan, choose_path, stage_plan
from kvbridge.layout.tp_routes import TPRoute, num_drawing, tp_route

__all__ = [
    "aux_dtype",
    "AuxRegion",
    "AuxRow",
    "AuxSchema",
    "BufferDesc",
    "build_rank_rows",
    "check_kind_topology",
    "check_stage_layers",
    "choose_path",
    "chunk_extent",
    "compressed_pool",
    "deepseek_pools",
    "deepseek_v4_layer_types",
    "deepseek_v4_pools",
    "describe_buffer",
    "Extent",
    "float32_to_bf16_bits",
    "has_repeats",
    "head_slices",
    "HeadGeometry",
    "HeadSlice",
    "KIND_PRESETS",
    "KINDS",
    "LANE_RULES",
    "lane_units",
    "layer_range_specs",
    "LAYOUTS",
    "local_row_order",
    "LocalRows",
    "mamba_pools",
    "needed_bytes",
    "needed_extent",
    "num_drawing",
    "owner_of_last_token",
    "OwnerLanes",
    "pair_head_buffers",
    "PathThresholds",
    "plan_head_transfer",
    "plan_kind",
    "plan_transfer",
    "PoolSpec",
    "preset_pools",
    "PRESETS",
    "rank_heads",
    "RawBuffer",
    "request_bases",
    "row_bytes",
    "RowDomain",
    "slices_to_send",
    "stage_conflict",
    "stage_layer_ids",
    "stage_plan",
    "stage_specs",
    "StagedPlan",
    "state_pool",
    "state_slices",
    "state_tp_spec",
    "strip_padding",
    "tail_tokens",
    "tp_route",
    "tp_spec",
    "TPRoute",
    "TransferPlan",
    "valid_row_index",
    "window_pool",
]

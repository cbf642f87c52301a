"""Pure geometry and planning: pools, pages, owner lanes, row domains and
transfer plans, head slices for heterogeneous TP, staged (gather / wire / scatter) plans. No I/O, no threads, no device
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
from kvbridge.layout.lanes import LANE_RULES, OwnerLanes
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
    "AuxRegion",
    "AuxRow",
    "AuxSchema",
    "BufferDesc",
    "HeadGeometry",
    "HeadSlice",
    "LANE_RULES",
    "LAYOUTS",
    "LocalRows",
    "OwnerLanes",
    "PathThresholds",
    "PRESETS",
    "PoolSpec",
    "RawBuffer",
    "RowDomain",
    "StagedPlan",
    "TPRoute",
    "TransferPlan",
    "aux_dtype",
    "build_rank_rows",
    "check_stage_layers",
    "layer_range_specs",
    "choose_path",
    "deepseek_pools",
    "describe_buffer",
    "float32_to_bf16_bits",
    "head_slices",
    "local_row_order",
    "num_drawing",
    "owner_of_last_token",
    "pair_head_buffers",
    "plan_head_transfer",
    "plan_transfer",
    "preset_pools",
    "rank_heads",
    "request_bases",
    "slices_to_send",
    "stage_conflict",
    "stage_layer_ids",
    "stage_plan",
    "stage_specs",
    "strip_padding",
    "tp_route",
    "tp_spec",
    "valid_row_index",
]

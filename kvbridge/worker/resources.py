"""What a worker owns, built from its config: pool specs, buffers, contract, aux schema.

Shared by the worker processes and the in-process bench, so both move the same
geometry. Buffers are one contiguous tensor per (pool, layer id), shaped
``[capacity_pages, bytes_per_page / itemsize]`` in the pool's storage type
(fp8 payloads as ``uint8``), paired by name and layer id (hard rule 8).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvbridge.bootstrap.contract import RuntimeContract, contract_from_preset
from kvbridge.layout.aux import AuxSchema
from kvbridge.layout.pools import ABI_ITEMSIZE, PoolSpec, preset_pools

TORCH_DTYPES = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

BufferMap = dict[tuple[str, int], torch.Tensor]


def build_specs(preset: str, layers: int, page_size: int, draft_layers: int) -> dict[str, PoolSpec]:
    return preset_pools(preset, num_layers=layers, page_size=page_size, draft_layers=draft_layers)


def allocate_buffers(specs: Mapping[str, PoolSpec], capacity_pages: int, device: str = "cpu") -> BufferMap:
    """One zeroed buffer per (pool, layer id)."""
    buffers: BufferMap = {}
    for spec in specs.values():
        width = spec.bytes_per_page // ABI_ITEMSIZE[spec.abi]
        for layer_id in spec.layer_ids:
            buffers[(spec.name, layer_id)] = torch.zeros(
                (capacity_pages, width), dtype=TORCH_DTYPES[spec.abi], device=device
            )
    return buffers


def buffers_nbytes(buffers: Mapping[tuple[str, int], torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in buffers.values())


def build_contract(preset: str, layers: int, page_size: int, draft_layers: int, lane_rule: str) -> RuntimeContract:
    return contract_from_preset(preset, layers, page_size, draft_layers, cp_rule=lane_rule)


def aux_schema_of(contract: RuntimeContract) -> AuxSchema:
    """The aux row schema the contract carries."""
    return contract.aux.to_schema()

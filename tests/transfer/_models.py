"""A non-DeepSeek model's cache, described with kvbridge's public names only: an MHA/GQA
model with a ``k`` and a ``v`` pool per layer (float32, token-major buffers) and aux
rows kept like SGLang's MetadataBuffers (one tensor per region)."""

from __future__ import annotations

import torch

import kvbridge as kvb

KV_HEADS, HEAD_DIM = 2, 8


def kv_fp32(layers: int, page_size: int, lane_rule: str = "interleaved"):
    """``(specs, contract, aux schema)`` of the k/v float32 model."""
    row_bytes = KV_HEADS * HEAD_DIM * 4
    pools = [kvb.PoolSpec(name, "float32", "float32", row_bytes, page_size, tuple(range(layers))) for name in ("k", "v")]
    aux = kvb.AuxSchema((kvb.AuxRegion("output_ids", "int32", (16,)), kvb.AuxRegion("room", "uint64", (8,)),
                         kvb.AuxRegion("hidden", "bfloat16", (32,))))
    contract = kvb.contract_for(pools, model="test/qwen2-like", aux=aux, lane_rule=lane_rule,
                                kernel={"attention_backend": "sdpa", "abi": "kv-token-major"})
    return {p.name: p for p in pools}, contract, aux


def token_major_buffers(specs, num_pages: int) -> dict[tuple[str, int], torch.Tensor]:
    """``[pages * page_size, heads, head_dim]`` per (pool, layer): byte-identical to page-major."""
    return {(s.name, layer): torch.zeros((num_pages * s.page_size, KV_HEADS, HEAD_DIM), dtype=torch.float32)
            for s in specs.values() for layer in s.layer_ids}


def region_tensors(schema, rows: int) -> dict[str, torch.Tensor]:
    """One tensor per aux region, ``[rows, *shape]`` of its dtype (as SGLang keeps them)."""
    return {r.name: torch.zeros((rows, *r.shape), dtype=getattr(torch, r.dtype)) for r in schema.regions}


def write_region_row(tensors: dict[str, torch.Tensor], schema, slot: int, packed) -> None:
    """Store a packed row (``schema.pack(...)``) into per-region tensors, as an engine would."""
    for name, value in schema.unpack_regions(packed).items():
        dst = tensors[name][slot]
        dst.view(torch.uint8).reshape(-1).copy_(torch.from_numpy(value.reshape(-1).view("uint8").copy()))


HEADS, HEAD_BYTES_DIM = 4, 4  # the head-sharded model: 4 KV heads of 4 float32


def kv_heads(layers: int, page_size: int, tp_size: int = 1, tp_rank: int = 0, lane_rule: str = "interleaved"):
    """``(specs, contract, aux schema)`` of TP rank ``tp_rank`` of a k/v float32 model whose pools
    are head-sharded (4 KV heads): the contract holds the whole row, the specs this rank's heads."""
    geom = kvb.layout.HeadGeometry(HEADS, HEAD_BYTES_DIM, "float32")
    pools = [geom.spec(name, page_size, tuple(range(layers)), tp_size, tp_rank) for name in ("k", "v")]
    aux = kvb.AuxSchema((kvb.AuxRegion("room", "uint64", (8,)), kvb.AuxRegion("first_token", "int32", (1,))))
    contract = kvb.contract_for(pools, model="test/gqa-heads", aux=aux, lane_rule=lane_rule,
                                kernel={"attention_backend": "sdpa", "abi": "kv-head-major"})
    return {p.name: p for p in pools}, contract, aux

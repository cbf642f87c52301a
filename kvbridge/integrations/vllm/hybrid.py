"""vLLM's KV cache groups under its hybrid manager (``SupportsHMA``) as kvbridge pool kinds.

    KVCacheGroupSpec.kv_cache_spec       pool (one per group)   kind
    FullAttentionSpec / MLAAttentionSpec group<i>               paged: a block of block_size tokens
    FullAttentionSpec with sliding_window group<i>              paged: a sliding window vLLM promoted to
     or attention_chunk_size (HMA off)                           full allocation (every block is kept)
    SlidingWindowSpec                    group<i>               window: the last sliding_window - 1 tokens
    MambaSpec                            group<i>               state: one slot (a block) per request,
                                                                its state tensors (shapes x dtypes) whole

Layer ids are read off the group's layer names (``model.layers.N.…``). A block's bytes are
``page_size_bytes`` (vLLM pads groups to one page size): a token row is a block's bytes over
``block_size``. ``settings.refuse_hybrid`` accepts a group whose kind the room endpoints carry
(``kvbridge.ROOM_POOL_KINDS``) and refuses the others naming the group and the kind; the worker
registers one paged pool (``cache.py``), so more than one group, or one that is not paged, is
still refused by name after that (docs/vllm.md). vLLM's CPU platform turns the hybrid manager off
for served models, so the groups are tested on vLLM's own spec classes and grouping, not a server.
"""

from __future__ import annotations

import re
from typing import Any

import kvbridge as kvb
from kvbridge import ConfigError

__all__ = ["group_specs", "room_pool_kinds"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _layer_ids(names: list[str], group: int) -> tuple[int, ...]:
    ids = []
    for name in names:
        m = _LAYER.search(name)
        if m is None:
            raise ConfigError(f"KV cache group {group}: no layer number in layer name {name!r}",
                              field=f"kv_cache_config.kv_cache_groups[{group}].layer_names")
        ids.append(int(m.group(1)))
    return tuple(ids)


def room_pool_kinds() -> frozenset[str]:
    """The pool kinds the room endpoints carry (``kvbridge.ROOM_POOL_KINDS``; paged only where
    this kvbridge predates it)."""
    return frozenset(getattr(kvb, "ROOM_POOL_KINDS", frozenset({"paged"})))


def _dtype(spec: Any) -> str:
    name = str(getattr(spec, "dtype", "")).removeprefix("torch.")
    return name if name in ("bfloat16", "float16", "float32") else "uint8"


def group_specs(kv_cache_config: Any) -> dict[str, kvb.PoolSpec]:
    """One kvbridge pool per KV cache group (module docstring); ConfigError naming the group
    for a spec kvbridge has no kind for."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    out: dict[str, kvb.PoolSpec] = {}
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec, name = group.kv_cache_spec, f"group{i}"
        ids = _layer_ids(list(group.layer_names), i)
        block, page = int(spec.block_size), int(spec.page_size_bytes)
        if isinstance(spec, MambaSpec):
            out[name] = kvb.state_pool(name, ids, page, dtype="float32" if page % 4 == 0 else "bfloat16",
                                       kernel_abi=f"vllm-mamba-{getattr(spec.mamba_type, 'value', spec.mamba_type)}")
            continue
        if page % block:
            raise ConfigError(f"KV cache group {i}: {page} B per block is not {block} token rows",
                              field=f"kv_cache_config.kv_cache_groups[{i}].kv_cache_spec")
        dtype = _dtype(spec)
        if isinstance(spec, SlidingWindowSpec):
            out[name] = kvb.window_pool(name, ids, page // block, window=int(spec.sliding_window) - 1,
                                        page_size=block, dtype=dtype if dtype != "uint8" else "bfloat16",
                                        kernel_abi="vllm-sliding-window")
        elif isinstance(spec, FullAttentionSpec):  # promoted windows and chunks too: every block is allocated
            out[name] = kvb.PoolSpec(name=name, dtype=dtype, abi=dtype, bytes_per_token=page // block,
                                     page_size=block, layer_ids=ids, kernel_abi="vllm-paged")
        else:
            raise ConfigError(f"KV cache group {i}: {type(spec).__name__} has no kvbridge pool kind",
                              field=f"kv_cache_config.kv_cache_groups[{i}].kv_cache_spec")
    return out

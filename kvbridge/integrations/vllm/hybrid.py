"""vLLM's KV cache groups under its hybrid manager (``SupportsHMA``) as kvbridge pool kinds, and
which of a request's blocks of each group a room moves.

    KVCacheGroupSpec.kv_cache_spec       pool (one per group)   kind
    FullAttentionSpec / MLAAttentionSpec group<i>               paged: a block of block_size tokens
    FullAttentionSpec with sliding_window group<i>              paged: a sliding window vLLM promoted to
     or attention_chunk_size (HMA off)                           full allocation (every block is kept)
    SlidingWindowSpec (window W)         group<i>               window: the last W tokens (below)
    MambaSpec                            group<i>               state: one slot (a block) per request,
                                                                its state tensors (shapes x dtypes) whole

Layer ids are read off the group's layer names (``model.layers.N.…``). A block's bytes are
``page_size_bytes`` (vLLM pads groups to one page size): a token row is a block's bytes over
``block_size``.

Why W tokens, not the W - 1 a query attends besides itself. Decode loads the n prompt tokens and
vLLM recomputes the last one (``_update_waiting_for_remote_kv``: n computed tokens of n become
n - 1), so decode's first forward is token n - 1 again, and it attends positions n - W .. n - 1:

    positions     ... n-W-1 | n-W | n-W+1 ... n-2 | n-1
    token n-1 recomputed      [=====================]   reads n-W .. n-2 from the cache
    token n (first new)             [=====================]   reads n-W+1 .. n-1

So the window pool moves rows [n - W, n): every block that holds one of them, the first one from
row (n - W) % block_size (``kvbridge.needed_extent``). vLLM's decode, having allocated for n
computed tokens, holds blocks from token n - W + 1 on (``get_num_skipped_tokens``): when
n - W + 1 is a multiple of the block size it holds no block for token n - W at all. That room is
not moved (``window_gap``): decode computes the prompt itself, counted (``local_compute_window``),
never with a stale key in its first step's window.

The room's page mapping is the one paged group's blocks; each window group's blocks travel as
the room's ``kind_units`` for its pool (prefill: with the last chunk; decode: at init). A Mamba
group is refused by kind (docs/models.md: vLLM hands its layers the raw state tensors, whose
conv/SSM split and TP sharding the connector does not read yet), as is more than one paged group
(the room has one page mapping) and groups of different block sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import kvbridge as kvb
from kvbridge import ConfigError

__all__ = ["GroupLayout", "group_layout", "group_specs", "room_pool_kinds", "window_gap", "window_pages"]

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
            out[name] = kvb.window_pool(name, ids, page // block, window=int(spec.sliding_window),
                                        page_size=block, dtype=dtype if dtype != "uint8" else "bfloat16",
                                        kernel_abi="vllm-sliding-window")
        elif isinstance(spec, FullAttentionSpec):  # promoted windows and chunks too: every block is allocated
            out[name] = kvb.PoolSpec(name=name, dtype=dtype, abi=dtype, bytes_per_token=page // block,
                                     page_size=block, layer_ids=ids, kernel_abi="vllm-paged")
        else:
            raise ConfigError(f"KV cache group {i}: {type(spec).__name__} has no kvbridge pool kind",
                              field=f"kv_cache_config.kv_cache_groups[{i}].kv_cache_spec")
    return out


@dataclass(frozen=True)
class GroupLayout:
    """How a hybrid request's groups map onto a room: ``paged`` is the group whose blocks are the
    room's page mapping; ``windows`` the window groups as ``(group index, pool name, W)``."""

    paged: int
    windows: tuple[tuple[int, str, int], ...]
    block_size: int
    names: tuple[str, ...]  # pool name of each group (group<i>)

    def window_blocks(self, group_block_ids: Any, num_tokens: int, null_block: int | None
                      ) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], str]:
        """Per window pool, the blocks of ``group_block_ids[group]`` that hold tokens
        ``[n - W, n)`` (``window_pages``); with the reason when one of them is vLLM's null block
        (the engine holds none there: ``window_gap``), else ""."""
        out = []
        for g, name, w in self.windows:
            first, stop = window_pages(num_tokens, w, self.block_size)
            ids = tuple(int(b) for b in list(group_block_ids[g])[first:stop])
            if len(ids) != stop - first or (null_block is not None and null_block in ids):
                return (), (f"KV cache group {g} ({name}, window {w}) holds no block for a token of positions "
                            f"[{max(0, num_tokens - w)}, {num_tokens}) (pages {first}..{stop - 1}, blocks {list(ids)})")
            out.append((name, ids))
        return tuple(out), ""


def group_layout(kv_cache_config: Any) -> GroupLayout | None:
    """The room layout of a config with more than one KV cache group (None: one group, moved as
    a paged pool). ConfigError naming the groups for what the connector does not move (module
    docstring)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return None
    specs = group_specs(kv_cache_config)
    names = tuple(specs)
    paged = [i for i, s in enumerate(specs.values()) if s.kind == "paged"]
    windows = tuple((i, n, int(s.window)) for i, (n, s) in enumerate(specs.items()) if s.kind == "window")
    other = [(i, s.kind) for i, s in enumerate(specs.values()) if s.kind not in ("paged", "window")]
    if other:
        i, kind = other[0]
        raise ConfigError(f"KV cache group {i} ({type(groups[i].kv_cache_spec).__name__}, layers "
                          f"{list(specs[names[i]].layer_ids)}) is a kvbridge {kind!r} pool: kvbridge's vLLM connector "
                          "moves full-attention and sliding-window groups, not Mamba state (vLLM hands its layers raw "
                          "conv/SSM state tensors whose split and TP sharding it does not read yet; docs/models.md); "
                          "serve this hybrid model with vLLM's NixlConnector",
                          field=f"kv_cache_config.kv_cache_groups[{i}]")
    if len(paged) != 1:
        raise ConfigError(f"KV cache groups {[type(g.kv_cache_spec).__name__ for g in groups]}: {len(paged)} "
                          "full-attention groups; a room has one page mapping, so kvbridge's vLLM connector moves "
                          "exactly one full-attention group beside its sliding-window groups",
                          field="kv_cache_config.kv_cache_groups")
    sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    if len(sizes) != 1:
        raise ConfigError(f"KV cache groups of block sizes {sorted(sizes)}: kvbridge's vLLM connector moves "
                          "groups of one block size", field="kv_cache_config.kv_cache_groups")
    return GroupLayout(paged[0], windows, sizes.pop(), names)


def window_pages(num_tokens: int, window: int, block_size: int) -> tuple[int, int]:
    """Pages ``[first, stop)`` holding tokens ``[n - W, n)`` (clipped at 0)."""
    first = max(0, num_tokens - window) // block_size
    return first, -(-num_tokens // block_size)


def window_gap(num_tokens: int, window: int, block_size: int, skipped: int | None = None) -> bool:
    """Whether vLLM's decode, having allocated a sliding-window group for ``num_tokens`` computed
    tokens, holds no block for token ``n - W``, which the recomputed last token attends. vLLM
    gives the group's null block to the pages below ``skipped // block_size``, ``skipped`` its
    manager's ``get_num_skipped_tokens(n)`` (default ``n - W + 1``): so a gap exactly when
    ``n - W + 1`` is a positive multiple of the block size (module docstring)."""
    skipped = num_tokens - window + 1 if skipped is None else skipped
    return num_tokens >= window and (num_tokens - window) // block_size < skipped // block_size

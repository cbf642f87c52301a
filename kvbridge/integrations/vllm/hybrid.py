"""vLLM's KV cache groups under its hybrid manager (``SupportsHMA``) as kvbridge pool kinds, and
which of a request's blocks of each group a room moves.

    KVCacheGroupSpec.kv_cache_spec       pool (one per group)   kind
    FullAttentionSpec / MLAAttentionSpec group<i>               paged: a block of block_size tokens
    FullAttentionSpec with sliding_window group<i>              paged: a sliding window vLLM promoted to
     or attention_chunk_size (HMA off)                           full allocation (every block is kept)
    SlidingWindowSpec (window W)         group<i>               window: the last W tokens (below)
    MambaSpec (states 0..k-1)            group<i>_state<j>      state: one slot (the request's block of
                                                                the group) per request, per state j its
                                                                shapes[j] x dtypes[j] bytes (below)

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
the room's ``kind_units`` for its pool (prefill: with the last chunk; decode: at init). More
than one paged group is refused (the room has one page mapping), as are attention groups of
different block sizes.

A Mamba group (``mamba_state_specs``). vLLM hands each Mamba layer a raw int8 view
``[blocks, 1, 1, C]`` of the tensor it shares with one layer of every other group; block ``b``
starts ``b * block_stride`` bytes in (the attention page: vLLM pads ``page_size_padded`` to
it), and ``MambaBase.bind_kv_cache`` cuts its first ``C`` bytes into the layer's states in order,
conv then SSM for Mamba1/Mamba2/GDN:

    block b   | conv: shapes[0] x dtypes[0] | ssm: shapes[1] x dtypes[1] | padding to the page |
              |<- state 0 ----------------->|<- state 1 --------------->|
              |<- block_stride (page_size_padded) ---------------------------------------------->|

Each state is a kvbridge state pool of its own (``group<i>_state<j>``): a slot is the state's
bytes, padded pages (``page_stride`` = the block stride) so the padding never travels; its
buffer starts at the state's offset in the layer's view and ends with the last block's state
(``mamba_state_buffers``). The request's slot is its one block of the group: vLLM's MambaManager
with ``mamba_cache_mode`` "none" allocates one state block per request (the group's
``block_size`` covers the model's length); "align"/"all" (prefix caching of Mamba state: a
block per aligned chunk, states nulled or copied as the prompt advances) and speculative state
blocks (``num_speculative_blocks``) are refused by name, as are states cut per token
(``tokens_per_state``) or per head (``num_heads``).

TP: vLLM shards a Mamba layer's states over TP ranks (conv channels x, B, C each split; SSM
heads split), so a rank's state shapes depend on the TP size. kvbridge does not cut them across
TP sizes (vLLM's NIXL does, ``ssm_conv_transfer_utils.py``): the TP size and the rank's shapes
are in each state pool's ``kernel_abi``, so a prefill and a decode of different TP are refused at
the handshake naming ``pools.group<i>_state<j>.kernel_abi`` (and ``bytes_per_token``).

One token short. vLLM's decode recomputes the prompt's last token when a room loads all n (n
computed become n - 1), which a cumulative state must not see twice: the state decode needs is
h(n - 1). So with a Mamba group prefill stops one token short (``GroupLayout.backoff``, as
vLLM's NIXL connector does, ``_prefill_backoff``): its scheduler side drops the prompt's last
token when the request arrives (``on_new_request``; the room stays bound to the whole prompt and
claims its n tokens), its room carries n - 1 tokens, the full-attention group's blocks of those
and each state pool's slot with the last chunk; decode asks for n - 1 tokens and computes token
n - 1 itself. Mamba groups beside sliding-window groups are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvbridge as kvb
from kvbridge import ConfigError

__all__ = ["GroupLayout", "group_layout", "group_specs", "mamba_state_specs", "room_pool_kinds", "state_slot",
           "window_gap", "window_pages"]

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


def group_specs(kv_cache_config: Any, tp_size: int = 1) -> dict[str, kvb.PoolSpec]:
    """One kvbridge pool per attention group, one per state of a Mamba group (module
    docstring); ConfigError naming the group for a spec kvbridge has no kind for."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    out: dict[str, kvb.PoolSpec] = {}
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec, name = group.kv_cache_spec, f"group{i}"
        ids = _layer_ids(list(group.layer_names), i)
        block, page = int(spec.block_size), int(spec.page_size_bytes)
        if isinstance(spec, MambaSpec):
            out.update(mamba_state_specs(spec, i, ids, tp_size=tp_size))
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
    room's page mapping; ``windows`` the window groups as ``(group index, pool name, W)``;
    ``states`` the Mamba groups with their state pools."""

    paged: int
    windows: tuple[tuple[int, str, int], ...]
    block_size: int
    names: tuple[str, ...]  # pool name of each attention group (group<i>)
    states: tuple[tuple[int, tuple[str, ...]], ...] = ()  # Mamba groups: (group index, its state pools)

    @property
    def backoff(self) -> int:
        """Prompt tokens prefill leaves to decode: 1 with Mamba state (decode needs h(n - 1))."""
        return 1 if self.states else 0

    def state_blocks(self, group_block_ids: Any, null_block: int | None
                     ) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], str]:
        """Per state pool, the request's slot (``state_slot``); with the reason when a Mamba group
        does not hold exactly one block for it, else ""."""
        out = []
        for g, pools in self.states:
            slot, why = state_slot(group_block_ids, g, null_block)
            if slot is None:
                return (), why
            out.extend((name, (slot,)) for name in pools)
        return tuple(out), ""

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


def group_layout(kv_cache_config: Any, tp_size: int = 1) -> GroupLayout | None:
    """The room layout of a config with more than one KV cache group (None: one group, moved as
    a paged pool): one full-attention group with its sliding-window groups or its Mamba groups.
    ConfigError naming the groups (or the Mamba spec's field) for what the connector does not move
    (module docstring)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return None
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = group_specs(kv_cache_config, tp_size)  # a Mamba group's own refusals by field come first
    mamba = {i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)}
    states = tuple((i, tuple(n for n in specs if n.startswith(f"group{i}_"))) for i in sorted(mamba))
    names = tuple(f"group{i}" for i in range(len(groups)))  # a Mamba group's pools: states
    kinds = {n: specs[n].kind for n in names if n in specs}
    paged = [i for i, n in enumerate(names) if kinds.get(n) == "paged"]
    windows = tuple((i, n, int(specs[n].window)) for i, n in enumerate(names) if kinds.get(n) == "window")
    if states and windows:
        raise ConfigError(f"KV cache groups {[type(g.kv_cache_spec).__name__ for g in groups]}: Mamba state beside "
                          "sliding-window groups; kvbridge's vLLM connector moves Mamba groups beside full-attention "
                          "groups only (prefill stops one token short for the state, which the window's extent "
                          "does not follow yet)", field="kv_cache_config.kv_cache_groups")
    if len(paged) != 1:
        raise ConfigError(f"KV cache groups {[type(g.kv_cache_spec).__name__ for g in groups]}: {len(paged)} "
                          "full-attention groups; a room has one page mapping, so kvbridge's vLLM connector moves "
                          "exactly one full-attention group beside its sliding-window groups",
                          field="kv_cache_config.kv_cache_groups")
    sizes = {int(g.kv_cache_spec.block_size) for i, g in enumerate(groups) if i not in mamba}
    if len(sizes) != 1:
        raise ConfigError(f"KV cache groups of block sizes {sorted(sizes)}: kvbridge's vLLM connector moves "
                          "attention groups of one block size", field="kv_cache_config.kv_cache_groups")
    return GroupLayout(paged[0], windows, sizes.pop(), names, states)


def mamba_state_specs(spec: Any, group: int, layer_ids: Sequence[int], *, tp_size: int = 1,
                      block_stride: int | None = None) -> dict[str, kvb.PoolSpec]:
    """A Mamba group's state pools, ``group<i>_state<j>`` per state of ``spec.shapes`` (module
    docstring): a slot of ``prod(shapes[j]) * itemsize(dtypes[j])`` bytes, pages ``block_stride``
    apart (default the spec's padded page), the state's offset, shape, dtype and ``tp_size`` in
    ``kernel_abi``. ConfigError naming the spec's field for what one slot per request does not carry."""
    where = f"kv_cache_config.kv_cache_groups[{group}].kv_cache_spec"
    mode = str(getattr(spec, "mamba_cache_mode", "none"))
    if mode != "none":
        raise ConfigError(f"KV cache group {group}: mamba_cache_mode {mode!r} (Mamba prefix caching: a state block "
                          "per aligned chunk, earlier ones nulled or copied) is not moved by kvbridge's vLLM "
                          "connector, which carries one state slot per request (mamba_cache_mode 'none')",
                          field=f"{where}.mamba_cache_mode")
    extra = int(getattr(spec, "num_speculative_blocks", 0) or 0)
    if extra:
        raise ConfigError(f"KV cache group {group}: {extra} speculative state blocks per request (MTP/EAGLE with "
                          "Mamba layers) are not moved by kvbridge's vLLM connector: one state slot per request",
                          field=f"{where}.num_speculative_blocks")
    if int(getattr(spec, "num_heads", 1)) != 1 or int(getattr(spec, "tokens_per_state", -1)) > 0:
        raise ConfigError(f"KV cache group {group}: state cut per head ({spec.num_heads}) or per "
                          f"{spec.tokens_per_state} tokens; kvbridge moves one state per block",
                          field=f"{where}.tokens_per_state")
    if not spec.shapes or len(spec.shapes) != len(spec.dtypes):
        raise ConfigError(f"KV cache group {group}: {len(spec.shapes)} state shapes and {len(spec.dtypes)} dtypes",
                          field=f"{where}.shapes")
    stride = int(block_stride or spec.page_size_bytes)
    kind = getattr(spec.mamba_type, "value", spec.mamba_type)
    out, offset = {}, 0
    for j, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes)):
        dname = str(dtype).removeprefix("torch.")
        nbytes = int(np.prod(shape, dtype=np.int64)) * int(dtype.itemsize)
        abi = dname if dname in ("bfloat16", "float16", "float32") else "uint8"
        name = f"group{group}_state{j}"
        out[name] = kvb.PoolSpec(
            name=name, dtype=dname, abi=abi, bytes_per_token=nbytes, page_size=1, layer_ids=tuple(layer_ids),
            kind="state", page_stride=stride if stride != nbytes else 0,
            kernel_abi=f"vllm-mamba-{kind},state{j}={'x'.join(map(str, shape))}:{dname}@{offset},tp={tp_size}")
        offset += nbytes
    if offset > stride:
        raise ConfigError(f"KV cache group {group}: states of {offset} B in blocks {stride} B apart",
                          field=f"{where}.page_size_padded")
    return out


def state_slot(group_block_ids: Any, group: int, null_block: int | None) -> tuple[int | None, str]:
    """A request's state slot in Mamba group ``group``: its one block there that is not vLLM's
    null block (``mamba_cache_mode`` "none" allocates one), with "" ; else None and why."""
    ids = [int(b) for b in list(group_block_ids[group]) if null_block is None or int(b) != null_block]
    if len(ids) != 1:
        return None, (f"KV cache group {group} (Mamba) holds {len(ids)} state blocks {ids} for the request; "
                      "kvbridge moves one state slot per request")
    return ids[0], ""


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

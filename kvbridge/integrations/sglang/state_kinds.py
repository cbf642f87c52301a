"""SGLang's MAMBA state component (``KVArgs.state_*``) as kvbridge state pools.

SGLang 0.5.23's ``MambaPool`` registers its state tensor-major x layer: for each state tensor
(conv, then temporal; GDN has one conv tensor) one entry per mamba layer, each a
``[slots + 1, ...]`` tensor whose item is one request slot (``state_item_lens``), with:

    state_layer_ids            the model layer of each entry
    state_dim_per_tensor       this rank's size of the TP slice axis (0: replicated across attn TP)
    state_slice_outer_counts   rows before the slice axis in a slot (1: the axis is outermost)
    state_conv_shard_groups    the conv tensor's full (unsharded) sub-block dims, e.g. GDN's
                               [key_dim, key_dim, value_dim]; None for the temporal tensor

and kvbridge sees one ``state`` pool per tensor (``mamba_0``, ``mamba_1``, ...): slot bytes =
the item, shard groups = the sub-block dims (the conv tensor) or the whole slice axis (heads),
unit = the bytes of one index of the slice axis. A slice axis with rows before it (Kimi's
transposed conv state) is refused by name: its TP part is not one contiguous range per group.
The room endpoints do not carry state pools yet (docs/models.md): this is the mapping they
will use, and what the contract of such a model is built from.
"""

from __future__ import annotations

from typing import Any

import kvbridge as kvb
from kvbridge import ConfigError

MAMBA = "mamba"

__all__ = ["MAMBA", "mamba_state_specs"]


def mamba_state_specs(kv_args: Any, attn_tp_size: int) -> dict[str, kvb.PoolSpec]:
    """The MAMBA component of ``kv_args`` as state pools of this rank (cut for ``attn_tp_size``)."""
    types = [str(getattr(t, "value", t)) for t in (getattr(kv_args, "state_types", None) or [])]
    if MAMBA not in types:
        raise ConfigError(f"no mamba state component among {types}", field="state_types")
    c = types.index(MAMBA)
    items = list(kv_args.state_item_lens[c])
    layers = list(kv_args.state_layer_ids[c])
    dims = list(kv_args.state_dim_per_tensor[c])
    outer = list(kv_args.state_slice_outer_counts[c])
    groups = list(kv_args.state_conv_shard_groups[c])
    if not (len(items) == len(layers) == len(dims) == len(outer) == len(groups)) or not items:
        raise ConfigError(f"mamba state lists differ in length: items {len(items)}, layer ids {len(layers)}, dims "
                          f"{len(dims)}, outer counts {len(outer)}, conv groups {len(groups)}", field="state_item_lens")
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

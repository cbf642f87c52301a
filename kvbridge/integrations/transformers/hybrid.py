"""Model mode for hybrid models whose transformers cache mixes full-attention layers,
sliding-window layers (gpt-oss) and linear-attention state (Mamba / Gated DeltaNet:
Qwen3-Next, Jamba, Nemotron-H), as kvbridge pools of each kind.

    cache layer (transformers)        pool     kind       row / slot
    DynamicLayer                      kv       paged      k heads | v heads of one token
    DynamicSlidingWindowLayer         swa      window     the same, the last W-1 tokens
    LinearAttentionLayer conv_states  conv     state      channels x kernel, channel groups sharded
    LinearAttentionLayer recurrent    ssm      state      heads x (k dim x v dim), sharded by heads

The pools are read off a prefilled cache (``hybrid_specs``: its tensors' shapes; an engine
gives the same from its config) and ``conv_groups`` (the conv channels' TP groups, SGLang's
``state_conv_shard_groups``: Qwen3-Next's q, k, v). Only kvbridge's public API is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import kvbridge as kvb
from kvbridge.integrations.transformers.kind_rooms import KindRooms
from kvbridge.integrations.transformers.kinds import KindPools, send_chunk

__all__ = ["HybridPools", "HybridRooms", "hybrid_specs", "send_chunk"]


def _kind(layer: Any) -> str:
    if hasattr(layer, "conv_states"):
        return "linear"
    return "swa" if hasattr(layer, "sliding_window") else "kv"


def hybrid_specs(cache: Any, page_size: int = 4, conv_groups: Sequence[int] | None = None) -> dict[str, kvb.PoolSpec]:
    """The pools of a prefilled hybrid cache (float32 rows)."""
    ids: dict[str, list[int]] = {"kv": [], "swa": [], "linear": []}
    for lid, layer in enumerate(cache.layers):
        ids[_kind(layer)].append(lid)
    specs: dict[str, kvb.PoolSpec] = {}
    for kind in ("kv", "swa"):
        if ids[kind]:
            layer = cache.layers[ids[kind][0]]
            heads, dim = layer.keys.shape[1], layer.keys.shape[3]
            row = 2 * heads * dim * 4
            if kind == "kv":
                specs["kv"] = kvb.PoolSpec(name="kv", dtype="float32", abi="float32", bytes_per_token=row,
                                           page_size=page_size, layer_ids=tuple(ids["kv"]))
            else:
                specs["swa"] = kvb.window_pool("swa", ids["swa"], row, window=layer.sliding_window - 1,
                                               page_size=page_size, dtype="float32")
    if ids["linear"]:
        layer = cache.layers[ids["linear"][0]]
        conv, ssm = layer.conv_states[0], layer.recurrent_states[0]
        channels, kernel = conv.shape[1], conv.shape[2]
        groups = tuple(conv_groups) if conv_groups else (channels,)
        if sum(groups) != channels:
            raise kvb.LayoutError(f"conv groups {groups} do not add up to {channels} channels", field="conv_groups")
        specs["conv"] = kvb.state_pool("conv", ids["linear"], dtype="float32", shard_units=groups, unit_bytes=kernel * 4)
        heads = ssm.shape[1]
        specs["ssm"] = kvb.state_pool("ssm", ids["linear"], dtype="float32", shard_units=(heads,),
                                      unit_bytes=ssm[0, 0].numel() * 4)
    return specs


class HybridPools(KindPools):
    """A rank's hybrid pools: ``write_cache`` after each prefill chunk, ``read_cache`` on decode."""

    def write_cache(self, cache: Any, num_tokens: int, last: bool) -> None:
        for lid, layer in enumerate(cache.layers):
            kind = _kind(layer)
            if kind == "linear":
                if last:
                    self.slot("conv", lid).view(torch.float32)[:] = layer.conv_states[0].reshape(-1)
                    self.slot("ssm", lid).view(torch.float32)[:] = layer.recurrent_states[0].reshape(-1)
                continue
            rows = torch.cat([layer.keys[0].transpose(0, 1).flatten(1), layer.values[0].transpose(0, 1).flatten(1)], 1)
            self.put(kind, lid, num_tokens - len(rows), rows)

    def read_cache(self, config: Any, num_tokens: int, template: Any) -> Any:
        """A decode cache rebuilt from the pools; ``template``: a cache of the same model, for the
        state tensors' shapes (an engine knows them from its config)."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=config)
        for lid, (layer, like) in enumerate(zip(cache.layers, template.layers)):
            kind = _kind(layer)
            if kind == "linear":
                conv = self.slot("conv", lid).view(torch.float32).view_as(like.conv_states[0]).clone()
                ssm = self.slot("ssm", lid).view(torch.float32).view_as(like.recurrent_states[0]).clone()
                layer.lazy_initialization(conv_states=conv, recurrent_states=ssm)
                layer.conv_states[0].copy_(conv)
                layer.recurrent_states[0].copy_(ssm)
                layer.has_previous_state[0] = True
                continue
            heads, dim = like.keys.shape[1], like.keys.shape[3]
            start = max(0, num_tokens - layer.sliding_window + 1) if kind == "swa" else 0
            rows = self.get(kind, lid, start, num_tokens - start, torch.float32).view(-1, 2, heads, dim)
            keys = rows[:, 0].transpose(0, 1).unsqueeze(0).contiguous()
            values = rows[:, 1].transpose(0, 1).unsqueeze(0).contiguous()
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            if kind == "swa":
                layer.cumulative_length = num_tokens
        return cache


class HybridRooms(KindRooms):
    """A hybrid model through the rooms (``kind_rooms.py``): ``template`` is a prefilled cache of the
    model (its pools' shapes, ``hybrid_specs``); paged and window pools share the room's page
    mapping, the state slots travel as kind units from the owner of the last token. Under
    ``cp_size`` 2 (interleaved lanes, CP attention simulated) each CP rank sends the token pages
    it owns."""

    def __init__(self, model: Any, template: Any, bootstrap_url: str, *, conv_groups: Sequence[int] | None = None,
                 page_size: int = 4, **kw: Any) -> None:
        self.template = template
        super().__init__(model, hybrid_specs(template, page_size, conv_groups), HybridPools, bootstrap_url, **kw)

    def read_cache(self, pools: KindPools, num_tokens: int) -> Any:
        return pools.read_cache(self.model.config, num_tokens, self.template)  # type: ignore[attr-defined]

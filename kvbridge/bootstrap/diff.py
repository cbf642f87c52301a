"""Field-level differences between two runtime contracts, each with what it
would break (the body of a 409 and of the diagnostics page, hard rule 7).

Paths are dotted: ``model.revision``, ``pools.index.layout``,
``aux.regions.hidden.shape``, ``source.files.kvbridge/layout/pools.py``. Pools
and aux regions are matched by name, never by position (hard rule 8); a name
present on one side only is reported at ``pools.<name>`` with ``None`` on the
other side.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from kvbridge.bootstrap.contract import RuntimeContract

__all__ = ["FieldDiff", "diff_contracts", "diff_plain", "breaks_for"]


class FieldDiff(BaseModel):
    """One differing field. ``prefill`` holds the first contract's value and
    ``decode`` the second's (for a refusal inside one instance: the registered
    rank's and the incoming rank's); ``None`` where the field is absent."""

    model_config = ConfigDict(frozen=True)

    path: str
    prefill: Any = None
    decode: Any = None
    breaks: str

    def render(self) -> str:
        return f"{self.path}: prefill={_short(self.prefill)} decode={_short(self.decode)} -- {self.breaks}"


def _short(v: Any, limit: int = 120) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_POOL_NAMES = {"target": "target KV", "index": "index-K", "draft": "draft KV"}

# What a difference in each field breaks. "{pool}" is the pool's display name.
_POOL_BREAKS = {
    "": "the {pool} pool exists on one side only: its pages would have no source or no destination",
    "dtype": "{pool} pages would be reinterpreted as another element type",
    "abi": "{pool} bytes would be handed to kernels that expect another storage type",
    "bytes_per_token": "{pool} pages would be read with the wrong token stride: every row after the first is garbage",
    "page_size": "{pool} logical pages would cover different token ranges on the two sides",
    "layout": "{pool} pages would be read with the wrong in-page layout",
    "value_bytes_per_token": "{pool} values and scales would be split at the wrong byte offset",
    "scale_bytes_per_token": "{pool} values and scales would be split at the wrong byte offset",
    "kernel_abi": "{pool} pages would follow another kernel's byte layout",
    "layer_ids": "{pool} buffers would pair with different layer ids: pages would land in the wrong layer or nowhere",
    "tp_sharding": "{pool} rows would be taken whole by one side and as head slices by the other",
    "num_heads": "{pool} head slices would be cut at the wrong heads: decode ranks would attend over other ranks' heads",
    "head_dim": "{pool} head slices would be cut at the wrong byte offsets",
    "kind": "{pool} would be read as another pool kind: which tokens' rows it holds and how they are addressed differ",
    "window": "{pool} holds another sliding window: decode would attend over tokens prefill never sent, or miss some",
    "ring_stride": "{pool} ring slots (row * stride + pos % stride) would hold other positions on the two sides",
    "ratio": "{pool} entries would summarise another number of tokens: every compressed entry means something else",
    "shard_units": "{pool} state slots would be cut into TP parts at other offsets: decode ranks would hold other "
                   "ranks' channels or heads",
    "unit_bytes": "{pool} state slots would be cut into TP parts at other byte offsets",
    "page_stride": "{pool} pages are padded to another stride on the two sides: every page after the first would "
                   "be read at the wrong offset",
    "heads": "{pool} rows would hold other heads than this TP rank's: peers would cut the wrong head slices",
}
_SECTION_BREAKS = {
    "wire_version": "control messages would be encoded and decoded by different wire protocol versions",
    "model.name": "the pages hold another model's KV: decode would attend over foreign activations",
    "model.revision": "the KV was computed by other weights: decode would attend over activations its weights never produced",
    "model.weights": "another checkpoint under this name (its weights digest differs): decode would attend over KV its "
                     "own weights never produced, and answer garbage with success",
    "model.target_layers": "target layers would not pair one to one: some layers' pages would have no destination",
    "model.draft_layers": "draft layers would not pair one to one: the draft model would decode from missing KV",
    "model": "the two sides serve different models",
    "cp_rule": "decode would expect each logical page from a different CP owner rank than the one that holds it",
    "kernel": "the pages would be read by an attention backend that expects another page layout",
    "speculative.algorithm": "the draft state would be interpreted by another speculative-decoding algorithm",
    "speculative.hidden_size": "the carried hidden state would be read with the wrong width",
    "speculative.hidden_dtype": "the carried hidden state would be read as the wrong dtype",
    "speculative.topk": "the aux row's top-k draft candidates would be truncated or over-read",
    "speculative": "speculative decoding would start from a state the other side did not produce",
    "aux": "the aux row (first token, cached-token count, speculative state) would be decoded with the wrong field layout",
    "source": "the code that defines the byte meaning differs between the sides",
    "transport": "the two sides run different transfer engines: prefill's writes could never reach decode's "
                 "memory (one engine's sessions and memory keys mean nothing to the other); run both on one engine",
    "topology.role": "an instance has one role: a prefill rank and a decode rank cannot share it",
    "topology.dp_size": "rooms would be routed to different DP groups (room % dp_size) by different ranks",
    "topology.cp_size": "owner lanes (logical page -> CP rank) would be computed over a different number of CP ranks",
    "topology.tp_size": "ranks would disagree on which TP ranks send which heads (see kvbridge.layout.tp_routes)",
    "topology.pp_size": "layers would be split across a different number of pipeline stages",
    "rank.pp_layers": "pipeline stages would leave layers unsent or send a layer twice: decode would attend over "
                      "pages no stage wrote, or count a layer range twice",
}


def breaks_for(path: str) -> str:
    """The sentence for a differing ``path`` (most specific rule wins)."""
    parts = path.split(".")
    if parts[0] == "pools" and len(parts) >= 2:
        pool = _POOL_NAMES.get(parts[1], f"{parts[1]!r}")
        return _POOL_BREAKS.get(".".join(parts[2:3]), _POOL_BREAKS[""]).format(pool=pool)
    if parts[0] == "source" and len(parts) >= 3 and parts[1] == "files":
        return f"{_SECTION_BREAKS['source']} (file {'.'.join(parts[2:])})"
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in _SECTION_BREAKS:
            return _SECTION_BREAKS[key]
    return "the two sides would give these bytes different meanings"


def _keyed(items: list[Any]) -> dict[str, Any] | None:
    """A list of objects with distinct ``name`` keys as a dict, else None."""
    if not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    keyed = {i["name"]: i for i in items}
    return keyed if len(keyed) == len(items) else None


def _walk(a: Any, b: Any, path: str, out: list[FieldDiff]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                out.append(FieldDiff(path=sub, prefill=a.get(key), decode=b.get(key), breaks=breaks_for(sub)))
            else:
                _walk(a[key], b[key], sub, out)
        return
    if isinstance(a, list) and isinstance(b, list):
        ka, kb = _keyed(a), _keyed(b)
        if ka is not None and kb is not None and (a or b):
            # Named items (pools, aux fields): match by name, never by position.
            _walk(ka, kb, path, out)
            order_a = [n for n in ka if n in kb]
            order_b = [n for n in kb if n in ka]
            if order_a != order_b and path != "pools":
                sub = f"{path}.(order)"
                out.append(FieldDiff(path=sub, prefill=order_a, decode=order_b, breaks=breaks_for(path)))
            return
    if a != b or type(a) is not type(b):
        out.append(FieldDiff(path=path, prefill=a, decode=b, breaks=breaks_for(path)))


def diff_plain(prefill: dict[str, Any], decode: dict[str, Any], prefix: str = "") -> list[FieldDiff]:
    """Differences between two plain (JSON-like) dicts."""
    out: list[FieldDiff] = []
    _walk(prefill, decode, prefix, out)
    return out


def diff_contracts(prefill: RuntimeContract | dict[str, Any], decode: RuntimeContract | dict[str, Any]) -> list[FieldDiff]:
    """Every field where the two contracts differ; empty when they are equal.
    ``source.digest`` is left out when the per-file hashes already show the change."""
    a = prefill.model_dump(mode="json") if isinstance(prefill, RuntimeContract) else prefill
    b = decode.model_dump(mode="json") if isinstance(decode, RuntimeContract) else decode
    out = diff_plain(a, b)
    if any(d.path.startswith("source.files.") for d in out):
        out = [d for d in out if d.path != "source.digest"]
    return out

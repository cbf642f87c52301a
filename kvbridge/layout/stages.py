"""Pipeline-parallel prefill: which layers of which pool a pipeline stage holds (pure).

A prefill instance with ``pp_size > 1`` splits the model's target layers into
contiguous ranges, one per stage, in stage order, that tile ``[0, num_target_layers)``:

    target layer ids   0 1 2 3 | 4 5 6 | 7 8 9       num_target_layers 10, pp 3
    stage                pp0      pp1     pp2
    index-K layer ids  0 1 2 3 | 4 5 6 | 7 8 9       (the same ids: follow the target split)
    draft layer ids                       10         (past the target layers: the last stage)
    aux row                               pp2

The rule for any pool: layer id ``L`` belongs to the stage whose range holds it; an id at
or past ``num_target_layers`` (EAGLE / NextN draft layers, ``num_layers + i``) belongs to
the stage whose range ends at ``num_target_layers``, the last one, which also holds the
last hidden state and so writes the aux row. A stage registers, and sends, exactly its
layers; a pool it holds no layer of is not among its pools at all.

A layer-range send (``KVSender.send(..., layers=(start, end))``, layer by layer as the
forward pass computes them) cuts the rank's pools by the same rule (``layer_range_specs``):
the range ``[start, end)`` of target layers carries those ids of every pool that has them
(index K follows the target ids), and the range that ends at ``num_target_layers`` carries
the draft layers too.

``stage_conflict`` is the tiling rule the bootstrap daemon applies to the stages an
instance has registered so far (refusing the first one that breaks it, by name) and a
decode rank applies again to a look-up answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from kvbridge.errors import LayoutError
from kvbridge.layout.pools import PoolSpec

__all__ = ["check_stage_layers", "layer_range_specs", "stage_conflict", "stage_layer_ids", "stage_specs"]

Layers = tuple[int, int]  # [start, end) of the target layers


def check_stage_layers(layers: Layers, num_target_layers: int, *, rank: str | None = None) -> None:
    """``0 <= start < end <= num_target_layers`` (LayoutError naming the field otherwise)."""
    start, end = layers
    if not 0 <= start < end <= num_target_layers:
        raise LayoutError(f"pipeline stage layers [{start}, {end}) must satisfy 0 <= start < end <= "
                          f"{num_target_layers} (the model's target layers)", rank=rank, field="pp_layers")


def stage_layer_ids(spec: PoolSpec, layers: Layers, num_target_layers: int) -> tuple[int, ...]:
    """The layer ids of ``spec`` that the stage holding target layers ``layers`` holds."""
    start, end = layers
    last = end >= num_target_layers
    return tuple(lid for lid in spec.layer_ids if start <= lid < end or (last and lid >= num_target_layers))


def stage_specs(specs: Mapping[str, PoolSpec], layers: Layers, num_target_layers: int) -> dict[str, PoolSpec]:
    """The specs a stage registers and sends: each pool cut to the stage's layer ids; a pool
    the stage holds no layer of (the draft pool before the last stage) left out."""
    check_stage_layers(layers, num_target_layers)
    return layer_range_specs(specs, layers, num_target_layers)


def layer_range_specs(specs: Mapping[str, PoolSpec], layers: Layers, num_target_layers: int) -> dict[str, PoolSpec]:
    """Each pool cut to the layer ids that target layers ``layers`` carry (the stage rule above);
    a pool with none of them left out. The caller checked the range."""
    out = {}
    for name, spec in specs.items():
        ids = stage_layer_ids(spec, layers, num_target_layers)
        if ids:
            out[name] = spec if ids == tuple(spec.layer_ids) else replace(spec, layer_ids=ids)
    return out


def _span(layers: Layers) -> str:
    return f"[{layers[0]}, {layers[1]})"


def stage_conflict(stages: Mapping[int, Layers], pp_size: int, num_target_layers: int) -> str | None:
    """The first way the stages known so far (``pp_rank -> [start, end)``) cannot tile
    ``[0, num_target_layers)`` in stage order, as a sentence naming the stages; None when
    they still can. With every stage known, None means they tile it exactly."""
    known = sorted(stages.items())
    for s, layers in known:
        if not 0 <= layers[0] < layers[1] <= num_target_layers:
            return (f"stage pp{s} declares layers {_span(layers)}, outside the model's {num_target_layers} target "
                    "layers (0 <= start < end)")
    if known and known[0][0] == 0 and known[0][1][0] != 0:
        return f"layers [0, {known[0][1][0]}) are held by no stage: the first stage pp0 declares {_span(known[0][1])}"
    if known and known[-1][0] == pp_size - 1 and known[-1][1][1] != num_target_layers:
        s, layers = known[-1]
        return (f"layers [{layers[1]}, {num_target_layers}) are held by no stage: the last stage pp{s} declares "
                f"{_span(layers)}")
    for i, (s, a) in enumerate(known):
        for q, b in known[i + 1:]:
            if a[0] < b[1] and b[0] < a[1]:
                return (f"stages pp{s} {_span(a)} and pp{q} {_span(b)} overlap at layers "
                        f"[{max(a[0], b[0])}, {min(a[1], b[1])})")
            if b[0] < a[0]:
                return (f"stage pp{q} declares layers {_span(b)}, before stage pp{s}'s {_span(a)}: stages hold the "
                        "layers in stage order")
            if q == s + 1 and a[1] != b[0]:
                return (f"layers [{a[1]}, {b[0]}) are held by no stage: pp{s} declares {_span(a)} and pp{q} "
                        f"{_span(b)}")
    return None

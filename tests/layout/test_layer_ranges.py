"""A layer range's cut of a rank's pools (``layer_range_specs``, the pipeline-stage rule) and of
its paired buffers (``PairedBuffers.cut``): index K follows the target ids, the draft layers go
with the range that ends at the last target layer, pairs keep their (pool, layer id)."""

from __future__ import annotations

import numpy as np

from kvbridge.layout import BufferDesc, layer_range_specs, preset_pools
from kvbridge.layout.pairing import pair_buffers

SPECS = preset_pools("deepseek-v3.2-fp8", num_layers=4, page_size=4)  # target/index 0-3, draft 4


def _bufs(shift: int) -> list[BufferDesc]:
    return [BufferDesc(p, lid, shift + 1000 * (10 * i + lid), 8, s.bytes_per_page)
            for i, (p, s) in enumerate(SPECS.items()) for lid in s.layer_ids]


def test_ranges_cut_every_pool_by_the_stage_rule():
    first = layer_range_specs(SPECS, (0, 2), 4)
    assert {n: s.layer_ids for n, s in first.items()} == {"target": (0, 1), "index": (0, 1)}
    last = layer_range_specs(SPECS, (3, 4), 4)
    assert {n: s.layer_ids for n, s in last.items()} == {"target": (3,), "index": (3,), "draft": (4,)}
    every = [lid for r in [(0, 1), (1, 3), (3, 4)] for s in layer_range_specs(SPECS, r, 4).values()
             for lid in s.layer_ids]
    assert sorted(every) == sorted(lid for s in SPECS.values() for lid in s.layer_ids)  # each layer once


def test_paired_buffers_cut_keep_pool_and_layer():
    paired = pair_buffers(SPECS, _bufs(0), _bufs(1 << 30), tuple(SPECS))
    cut = paired.cut(layer_range_specs(SPECS, (3, 4), 4))
    assert cut.pools == ("target", "index", "draft")
    for spec, src, dst, _, _ in cut.pairs:
        i = list(SPECS).index(spec.name)
        assert src.tolist() == [1000 * (10 * i + lid) for lid in spec.layer_ids]
        assert (dst - src == np.uint64(1 << 30)).all()
    whole = paired.cut(layer_range_specs(SPECS, (0, 4), 4))  # every layer: the pairs as they are
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(whole.pairs, paired.pairs, strict=True))

"""Pipeline stages (kvbridge.layout.stages): which layers a stage holds, and the tiling rule."""

from __future__ import annotations

import itertools

import pytest

from kvbridge.errors import LayoutError
from kvbridge.layout import deepseek_pools, stage_conflict, stage_layer_ids, stage_specs


def test_target_and_index_follow_the_split_draft_goes_to_the_last_stage() -> None:
    specs = deepseek_pools(num_layers=10, page_size=4, kv_dtype="fp8", index=True, draft_layers=1)
    split = [(0, 4), (4, 7), (7, 10)]
    stages = [stage_specs(specs, layers, 10) for layers in split]
    assert [s["target"].layer_ids for s in stages] == [(0, 1, 2, 3), (4, 5, 6), (7, 8, 9)]
    assert [s["index"].layer_ids for s in stages] == [(0, 1, 2, 3), (4, 5, 6), (7, 8, 9)]
    assert ["draft" in s for s in stages] == [False, False, True] and stages[2]["draft"].layer_ids == (10,)
    # every (pool, layer) exactly once over the stages
    held = sorted((p, lid) for s in stages for p, spec in s.items() for lid in spec.layer_ids)
    assert held == sorted((p, lid) for p, spec in specs.items() for lid in spec.layer_ids)
    whole = stage_specs(specs, (0, 10), 10)
    assert whole == specs  # one stage: the specs as they are


def test_a_range_outside_the_target_layers_is_refused() -> None:
    specs = deepseek_pools(num_layers=4, page_size=4)
    for bad in [(0, 5), (2, 2), (-1, 2)]:
        with pytest.raises(LayoutError, match="pp_layers|must satisfy"):
            stage_specs(specs, bad, 4)
    assert stage_layer_ids(specs["target"], (1, 3), 4) == (1, 2)


@pytest.mark.parametrize("stages, words", [
    ({0: (0, 3), 1: (2, 6)}, "pp0 [0, 3) and pp1 [2, 6) overlap at layers [2, 3)"),
    ({0: (0, 2), 1: (3, 6)}, "layers [2, 3) are held by no stage: pp0 declares [0, 2) and pp1 [3, 6)"),
    ({0: (1, 3)}, "layers [0, 1) are held by no stage: the first stage pp0"),
    ({1: (3, 5)}, "layers [5, 6) are held by no stage: the last stage pp1"),
    ({0: (0, 7)}, "outside the model's 6 target layers"),
])
def test_conflicts_name_the_stages_and_layers(stages: dict, words: str) -> None:
    assert words in (stage_conflict(stages, 2, 6) or "")


def test_every_exact_tiling_passes_and_every_known_subset_of_it_too() -> None:
    n, pp = 6, 3
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        stages = {s: (bounds[s], bounds[s + 1]) for s in range(pp)}
        for k in range(1, pp + 1):
            for subset in itertools.combinations(stages, k):
                assert stage_conflict({s: stages[s] for s in subset}, pp, n) is None


def test_every_full_assignment_that_does_not_tile_is_refused() -> None:
    """Exhaustive over 3 stages of 4 layers: a full set passes exactly when it tiles."""
    n, pp = 4, 3
    ranges = [(a, b) for a in range(n) for b in range(a + 1, n + 1)]
    for choice in itertools.product(ranges, repeat=pp):
        tiles = choice[0][0] == 0 and choice[-1][1] == n and all(choice[i][1] == choice[i + 1][0] for i in range(pp - 1))
        assert (stage_conflict(dict(enumerate(choice)), pp, n) is None) == tiles, choice

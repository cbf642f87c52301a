"""TP routes and head-sharded pool specs: which prefill TP ranks a decode TP rank
draws each pool from, and what of a head-sharded pool is contract (the whole row)
and what is topology (each rank's heads)."""

from __future__ import annotations

import pytest

import kvbridge as kvb
from kvbridge.errors import ConfigError, LayoutError, TopologyError
from kvbridge.layout import HeadGeometry, num_drawing, tp_route, tp_spec
from kvbridge.transfer.checks import check_against_contract


def kv_specs(num_heads: int = 4, tp: int = 1, rank: int = 0, head_dim: int = 8) -> dict[str, kvb.PoolSpec]:
    geom = HeadGeometry(num_heads, head_dim, "bfloat16")
    return {n: geom.spec(n, 16, (0, 1), tp, rank) for n in ("k", "v")}


def mla_spec() -> kvb.PoolSpec:
    return kvb.PoolSpec("target", "bfloat16", "bfloat16", 1152, 16, (0, 1))


def test_a_rank_spec_holds_its_heads_and_knows_the_whole_row():
    s = kv_specs(4, tp=2, rank=1)["k"]
    assert (s.head_start, s.head_stop, s.bytes_per_token, s.full_bytes_per_token) == (2, 4, 32, 64)
    assert s.head_dim == 8 and s.full() == kv_specs(4)["k"] and tp_spec(s.full(), 2, 1) == s
    assert tp_spec(mla_spec(), 4, 3) == mla_spec()  # replicated: every rank holds the whole row
    with pytest.raises(LayoutError, match="rows layout"):
        kvb.PoolSpec("k", "uint8", "uint8", 132, 16, (0,), layout="values_then_scales", value_bytes_per_token=128,
                     scale_bytes_per_token=4, num_heads=4)
    with pytest.raises(LayoutError, match="not 3 whole heads"):
        kvb.PoolSpec("k", "float32", "float32", 20, 16, (0,), num_heads=4, head_start=0, head_stop=3)
    with pytest.raises(LayoutError, match="needs num_heads"):
        kvb.PoolSpec("k", "float32", "float32", 16, 16, (0,), head_stop=2)


@pytest.mark.parametrize("p, d, expect", [
    (2, 4, [(0,), (0,), (1,), (1,)]),  # decode rank j: head j from tp j // 2
    (2, 1, [(0, 1)]),  # both halves
    (1, 2, [(0,), (0,)]),
    (4, 2, [(0, 1), (2, 3)]),
    (2, 2, [(0,), (1,)]),  # same split: whole rows
])
def test_sources_per_decode_rank(p, d, expect):
    routes = [tp_route(kv_specs(), p, d, j) for j in range(d)]
    assert [r.sources for r in routes] == expect
    assert [r.first_source for r in routes] == [e[0] for e in expect]
    for r in routes:
        for src in r.sources:
            assert r.pools_from(src) == ("k", "v")
    whole = [r.slice_from("k", r.sources[0]) is None for r in routes]
    assert all(whole) == (p == d)
    # how many decode ranks ask each prefill TP rank (what a prefill room waits for)
    assert [num_drawing(kv_specs(), p, d, t) for t in range(p)] == [sum(t in e for e in expect) for t in range(p)]


def test_head_slices_carry_offsets_into_both_rows():
    r = tp_route(kv_specs(4), 2, 4, 3)  # head 3: the second head of tp 1's row
    hs = r.slice_from("v", 1)
    assert (hs.head_start, hs.head_stop, hs.src_offset, hs.dst_offset, hs.nbytes) == (3, 4, 16, 0, 16)
    assert (hs.src_row_bytes, hs.dst_row_bytes) == (32, 16)


def test_replicated_pools_and_the_aux_row_come_from_the_first_source():
    specs = [*kv_specs().values(), mla_spec()]
    r = tp_route(specs, 2, 4, 2)  # heads from tp 1 only: the replicated pool too
    assert r.sources == (1,) and r.pools_from(1) == ("k", "target", "v") and r.slice_from("target", 1) is None
    only_mla = tp_route([mla_spec()], 4, 2, 1)
    assert only_mla.sources == (0,) and [num_drawing([mla_spec()], 4, 2, t) for t in range(4)] == [2, 0, 0, 0]


def test_more_prefill_ranks_than_heads_spread_decode_ranks_over_replicas():
    specs = kv_specs(num_heads=2)
    assert [tp_route(specs, 4, 2, j).sources for j in range(2)] == [(0,), (3,)]  # replica j % 2 of head j
    assert [tp_route(specs, 4, 1, 0).sources] == [(0, 2)]


def test_tp_sizes_that_do_not_split_the_heads_are_refused():
    with pytest.raises(TopologyError, match="neither divides the 4 KV heads"):
        tp_route(kv_specs(4), 3, 1, 0)
    with pytest.raises(TopologyError, match="decode tp rank 2 outside tp size 2"):
        tp_route(kv_specs(4), 1, 2, 2)


def test_the_contract_is_the_whole_row_whatever_the_tp():
    aux = kvb.AuxSchema((kvb.AuxRegion("room", "uint64", (8,)),))
    fps = {kvb.fingerprint(kvb.contract_for(kv_specs(4, tp, r), model="m", aux=aux))
           for tp in (1, 2, 4) for r in range(tp)}
    assert len(fps) == 1  # tp sizes are topology
    pool = kvb.contract_for(kv_specs(4, 2, 1), model="m", aux=aux).pool("k")
    assert (pool.tp_sharding, pool.num_heads, pool.head_dim, pool.bytes_per_token) == ("heads", 4, 8, 64)
    other = kvb.contract_for(kv_specs(2, head_dim=16), model="m", aux=aux)  # same row bytes, other heads
    assert kvb.fingerprint(other) not in fps
    assert {d.path for d in kvb.diff_contracts(kvb.contract_for(kv_specs(4), model="m", aux=aux), other)} >= {
        "pools.k.num_heads", "pools.k.head_dim"}


def test_an_endpoint_holding_other_heads_than_its_tp_rank_is_refused():
    aux = kvb.AuxSchema((kvb.AuxRegion("room", "uint64", (8,)),))
    contract = kvb.contract_for(kv_specs(4), model="m", aux=aux)
    check_against_contract(kv_specs(4, 2, 1), aux, contract, rank="d/tp1", tp_size=2, tp_rank=1)
    with pytest.raises(ConfigError, match=r"tp rank 0 of 2 holds heads \[0, 2\) of 4, its spec holds \[2, 4\)") as err:
        check_against_contract(kv_specs(4, 2, 1), aux, contract, rank="d/tp0", tp_size=2, tp_rank=0)
    assert err.value.field == "pools.k.heads" and err.value.rank == "d/tp0"


@pytest.mark.parametrize("src_tp, dst_tp", [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1)])
def test_a_sharded_state_slot_is_drawn_from_every_rank_whose_part_overlaps(src_tp, dst_tp):
    """Mamba conv (channel groups) and SSM (heads) state: a decode rank draws the slot from exactly
    the prefill TP ranks that ``state_slices`` gives it bytes from, replicated pools (the window,
    a replicated slot) and the aux row from the first of them; so equal TP sizes pair rank d with d."""
    from kvbridge.layout import state_slices

    specs = {**kvb.mamba_pools([1], conv_groups=(8, 4, 4), conv_kernel=4, num_heads=4, head_dim=4, state_size=8),
             "swa": kvb.window_pool("swa", [0], 32, window=6, page_size=4)}
    for d in range(dst_tp):
        route = tp_route(specs, src_tp, dst_tp, d)
        for pool in ("mamba_conv", "mamba_ssm"):
            full = specs[pool].full()
            want = tuple(p for p in range(src_tp) if state_slices(full, src_tp, p, dst_tp, d)[2].size)
            assert route.sources_of(pool) == want
        assert route.sources_of("swa") == (route.first_source,) == (min(want),)
        if src_tp == dst_tp:
            assert route.sources == (d,)
    assert sum(num_drawing(specs, src_tp, dst_tp, p) for p in range(src_tp)) == sum(
        len(tp_route(specs, src_tp, dst_tp, d).sources) for d in range(dst_tp))

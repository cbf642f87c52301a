"""The daemon and heterogeneous TP: a head-sharded pool's ranks register their heads'
bytes (checked per TP rank), and a look-up returns the senders the asking decode
rank needs: every (cp, tp) prefill rank whose heads overlap its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

import kvbridge as kvb
from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.bootstrap.schemas import RankIdentity
from kvbridge.bootstrap.topology import PoolDescriptor
from kvbridge.errors import InstanceIncomplete, TopologyError
from kvbridge.layout import HeadGeometry, tp_spec

PAGE, LAYERS = 4, (0, 1)


def contract() -> kvb.RuntimeContract:
    geom = HeadGeometry(4, 8, "float32")
    aux = kvb.AuxSchema((kvb.AuxRegion("room", "uint64", (8,)),))
    return kvb.contract_for([geom.spec(n, PAGE, LAYERS) for n in ("k", "v")], model="m", aux=aux)


def register(client: BootstrapClient, kvb_helpers: Any, name: str, sizes: tuple, coords: tuple, *,
             width_tp: tuple[int, int] | None = None) -> None:
    c = contract()
    req = kvb_helpers.register_request(c, name, sizes=sizes, coords=coords)
    tp = width_tp or (sizes[2], coords[2])
    pools = [PoolDescriptor(pool=d.pool, layer_id=d.layer_id, base=d.base, capacity_pages=d.capacity_pages,
                            bytes_per_page=tp_spec(c.pool(d.pool).to_spec(), *tp).bytes_per_page) for d in req.pools]
    client.register(req.model_copy(update={"pools": pools}))


def decode(tp_size: int, tp_rank: int) -> RankIdentity:
    return RankIdentity(instance="d", role="decode", tp_size=tp_size, tp_rank=tp_rank)


def test_a_lookup_returns_the_prefill_tp_ranks_that_hold_the_decode_ranks_heads(
        daemon: Any, kvb: Any, instance_name: Callable[[str], str]) -> None:
    name = instance_name("heads")
    sizes = (1, 2, 2, 1)  # cp 2 x tp 2
    with BootstrapClient(daemon.url) as client:
        register(client, kvb, name, sizes, (0, 0, 0, 0))
        with pytest.raises(InstanceIncomplete, match="cp1/tp0"):  # only what decode rank 1 of 4 needs is named
            client.lookup(name, 1, contract(), decode(4, 1))
        for cp, tp in ((0, 1), (1, 0), (1, 1)):
            register(client, kvb, name, sizes, (0, cp, tp, 0))
        senders = {j: [(r.cp_rank, r.tp_rank) for r in client.lookup(name, 1, contract(), decode(4, j)).ranks]
                   for j in range(4)}
        # rank 0 is also told the ranks its siblings draw from: it hands the room's ticket on to them
        assert senders == {0: [(0, 0), (0, 1), (1, 0), (1, 1)], 1: [(0, 0), (1, 0)], 2: [(0, 1), (1, 1)],
                           3: [(0, 1), (1, 1)]}
        both = client.lookup(name, 1, contract(), decode(1, 0)).ranks
        assert sorted((r.cp_rank, r.tp_rank) for r in both) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        with pytest.raises(TopologyError, match="neither divides"):
            client.lookup(name, 1, contract(), decode(3, 0))


def test_a_rank_registering_the_whole_row_under_tp_2_is_refused(daemon: Any, kvb: Any,
                                                                 instance_name: Callable[[str], str]) -> None:
    req = kvb.register_request(contract(), instance_name("heads"), sizes=(1, 1, 2, 1), coords=(0, 0, 1, 0))
    answer = httpx.post(f"{daemon.url}/v1/ranks", json=kvb.body(req), trust_env=False)  # full-row descriptors
    assert answer.status_code in (409, 422) and answer.json()["field"] == "pools[0].bytes_per_page"
    assert "tp rank 1 of 2 holds its heads of the row" in answer.json()["message"]

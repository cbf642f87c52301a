"""``GET /v1/ranks/{rank_id}``: one registered rank and the memory a peer may write
into, what a prefill rank checks a decode rank's requests against (hard rule 5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.bootstrap.contract import RuntimeContract, fingerprint
from kvbridge.bootstrap.topology import AuxRegionDescriptor
from kvbridge.errors import UnknownInstance


def test_a_rank_is_read_back_with_its_buffers_and_aux_regions(daemon: Any, kvb: Any, small_contract: RuntimeContract,
                                                              instance_name: Callable[[str], str]) -> None:
    schema = small_contract.aux.to_schema()
    regions = [AuxRegionDescriptor(name=r.name, base=(1 << 44) + schema.offsets[r.name], capacity_rows=64,
                                   row_bytes=schema.row_bytes) for r in schema.regions]
    req = kvb.register_request(small_contract, instance_name("decode"), "decode").model_copy(
        update={"aux_regions": regions})
    with BootstrapClient(daemon.url) as client:
        reg = client.register(req)
        detail = client.rank(reg.rank_id)
        assert detail.rank_id == reg.rank_id and detail.rank == req.rank
        assert detail.pools == req.pools and detail.aux_regions == regions and detail.session_id == req.session_id
        assert detail.fingerprint == fingerprint(small_contract) and detail.lease_remaining_s > 0
        client.deregister(reg)
        with pytest.raises(UnknownInstance, match=f"no rank '{reg.rank_id}'") as err:
            client.rank(reg.rank_id)
        assert err.value.field == "rank_id"
    answer = httpx.get(f"{daemon.url}/v1/ranks/nope", trust_env=False)
    assert answer.status_code == 404 and answer.json()["error"] == "unknown_rank"


def test_aux_regions_are_checked_against_the_contract(daemon: Any, kvb: Any, small_contract: RuntimeContract,
                                                      instance_name: Callable[[str], str]) -> None:
    bad = [AuxRegionDescriptor(name="hidden", base=1 << 44, capacity_rows=4, row_bytes=8)]  # a row is 14,336 B
    req = kvb.register_request(small_contract, instance_name("decode"), "decode").model_copy(update={"aux_regions": bad})
    answer = httpx.post(f"{daemon.url}/v1/ranks", json=kvb.body(req), trust_env=False)
    assert answer.status_code == 409 and answer.json()["field"] == "aux_regions[0]"  # schema-valid, breaks a rule
    assert "'hidden'" in answer.json()["message"]

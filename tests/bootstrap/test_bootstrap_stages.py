"""Pipeline-parallel prefill at the daemon: each stage declares its target layers
(``rank.pp_layers``) and registers exactly those; the stages of an instance must tile the
model's target layers in stage order. A registration that breaks it is refused (409
``topology_mismatch``, field ``rank.pp_layers``) naming the stages, and the refusal is
kept for diagnostics. Real daemon (the ``http`` fixture)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvbridge.bootstrap.contract import RuntimeContract, contract_from_preset

SIX = (1, 1, 1, 3)  # dp, cp, tp, pp


@pytest.fixture
def six() -> RuntimeContract:
    """Six target layers, one NextN layer: room for three stages."""
    return contract_from_preset("deepseek-v3.2-fp8", num_layers=6, page_size=16, draft_layers=1)


def register(http: httpx.Client, kvb: Any, contract: RuntimeContract, name: str, pp: int, layers: tuple[int, int] | None,
             *, sizes: tuple[int, int, int, int] = SIX, cp: int = 0, **kw: Any) -> httpx.Response:
    req = kvb.register_request(contract, name, sizes=sizes, coords=(0, cp, 0, pp), pp_layers=layers)
    body = kvb.body(req)
    body.update(kw)
    return http.post("/v1/ranks", json=body)


def refused(r: httpx.Response) -> str:
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["error"] == "topology_mismatch" and body["field"] == "rank.pp_layers", body
    return body["message"]


def test_three_stages_that_tile_register_and_the_lookup_names_each_range(http: httpx.Client, kvb: Any,
                                                                          six: RuntimeContract,
                                                                          instance_name: Callable[[str], str]) -> None:
    name = instance_name("pp")
    for pp, layers in enumerate([(0, 2), (2, 5), (5, 6)]):
        r = register(http, kvb, six, name, pp, layers)
        assert r.status_code == 201, r.text
    ans = http.post("/v1/lookup", json=kvb.lookup_body(six, name, room=3)).json()
    ranks = {s["pp_rank"]: s for s in ans["ranks"]}
    assert {pp: (s["pp_layers"]["start"], s["pp_layers"]["end"]) for pp, s in ranks.items()} == \
        {0: (0, 2), 1: (2, 5), 2: (5, 6)}
    # each stage registered its own layers: the draft (NextN, id 6) with the last stage only
    layers = {pp: sorted({(d["pool"], d["layer_id"]) for d in s["pools"]}) for pp, s in ranks.items()}
    assert layers[0] == [("index", 0), ("index", 1), ("target", 0), ("target", 1)]
    assert ("draft", 6) in layers[2] and not any(p == "draft" for p, _ in layers[0] + layers[1])
    view = http.get(f"/v1/instances/{name}").json()
    assert view["complete"] and [r["pp_layers"]["start"] for r in view["ranks"]] == [0, 2, 5]


def test_overlapping_stages_are_refused_naming_both(http: httpx.Client, kvb: Any, six: RuntimeContract,
                                                     instance_name: Callable[[str], str]) -> None:
    name = instance_name("pp")
    assert register(http, kvb, six, name, 0, (0, 3)).status_code == 201
    msg = refused(register(http, kvb, six, name, 1, (2, 5)))
    assert "pp0 [0, 3) and pp1 [2, 5) overlap at layers [2, 3)" in msg, msg
    kept = [m for m in http.get("/v1/diagnostics/mismatches").json() if m["left"]["instance"] == name]
    assert kept and kept[0]["reason"] == "topology" and kept[0]["diff"][0]["path"] == "rank.pp_layers"
    assert kept[0]["diff"][0]["prefill"] == {"pp0": [0, 3]} and kept[0]["diff"][0]["decode"] == {"pp1": [2, 5]}


def test_a_gap_between_stages_is_refused_naming_the_layers_and_stages(http: httpx.Client, kvb: Any,
                                                                       six: RuntimeContract,
                                                                       instance_name: Callable[[str], str]) -> None:
    name = instance_name("pp")
    assert register(http, kvb, six, name, 2, (5, 6)).status_code == 201
    assert register(http, kvb, six, name, 0, (0, 2)).status_code == 201  # pp1 not yet here: no gap known
    msg = refused(register(http, kvb, six, name, 1, (3, 5)))
    assert "layers [2, 3) are held by no stage: pp0 declares [0, 2) and pp1 [3, 5)" in msg, msg


@pytest.mark.parametrize("pp, layers, words", [
    (0, (1, 2), "layers [0, 1) are held by no stage: the first stage pp0 declares [1, 2)"),
    (2, (4, 5), "layers [5, 6) are held by no stage: the last stage pp2 declares [4, 5)"),
])
def test_ends_that_leave_layers_out_are_refused_alone(http: httpx.Client, kvb: Any, six: RuntimeContract,
                                                       instance_name: Callable[[str], str], pp: int,
                                                       layers: tuple[int, int], words: str) -> None:
    assert words in refused(register(http, kvb, six, instance_name("pp"), pp, layers))


def test_stages_out_of_order_are_refused(http: httpx.Client, kvb: Any, six: RuntimeContract,
                                         instance_name: Callable[[str], str]) -> None:
    name = instance_name("pp")
    sizes = (1, 1, 1, 4)
    assert register(http, kvb, six, name, 2, (2, 4), sizes=sizes).status_code == 201
    msg = refused(register(http, kvb, six, name, 1, (4, 5), sizes=sizes))
    assert "stage pp2 declares layers [2, 4), before stage pp1's [4, 5): stages hold the layers in stage order" in msg
    msg = refused(register(http, kvb, six, name, 0, (5, 6), sizes=sizes))
    assert "layers [0, 5) are held by no stage: the first stage pp0 declares [5, 6)" in msg


def test_one_stage_with_two_ranges_across_cp_ranks_is_refused(http: httpx.Client, kvb: Any, six: RuntimeContract,
                                                               instance_name: Callable[[str], str]) -> None:
    name = instance_name("pp")
    sizes = (1, 2, 1, 2)
    assert register(http, kvb, six, name, 0, (0, 3), sizes=sizes, cp=0).status_code == 201
    msg = refused(register(http, kvb, six, name, 0, (0, 4), sizes=sizes, cp=1))
    assert "stage pp0 declares layers [0, 4) here but [0, 3) on" in msg and "/cp0/" in msg, msg


def test_a_stage_without_a_layer_range_is_refused(http: httpx.Client, kvb: Any, six: RuntimeContract,
                                                  instance_name: Callable[[str], str]) -> None:
    req = kvb.register_request(six, instance_name("pp"), sizes=SIX, coords=(0, 0, 0, 1), pp_layers=(2, 5))
    body = kvb.body(req)
    del body["rank"]["pp_layers"]
    msg = refused(http.post("/v1/ranks", json=body))
    assert "pipeline stage pp1 of 3 but declares no layer range" in msg


def test_a_stage_registering_layers_outside_its_range_is_refused(http: httpx.Client, kvb: Any,
                                                                 six: RuntimeContract,
                                                                 instance_name: Callable[[str], str]) -> None:
    req = kvb.register_request(six, instance_name("pp"), sizes=SIX, coords=(0, 0, 0, 0), pp_layers=(0, 2))
    body = kvb.body(req)
    body["pools"] = [d.model_dump() for d in kvb.descriptors(six, pp_layers=(0, 3))]
    r = http.post("/v1/ranks", json=body)
    assert r.status_code == 409 and r.json()["error"] == "inconsistent_request"
    assert "layer 2 lies outside pipeline stage pp0's layers [0, 2)" in r.json()["message"]
    body["pools"] = [d.model_dump() for d in kvb.descriptors(six, pp_layers=(1, 2))]
    r = http.post("/v1/ranks", json=body)
    assert r.status_code == 409 and "holds pool 'index' layer 0" in r.json()["message"]


def test_a_range_past_the_model_or_an_empty_one_is_refused(http: httpx.Client, kvb: Any, six: RuntimeContract,
                                                           instance_name: Callable[[str], str]) -> None:
    req = kvb.register_request(six, instance_name("pp"), sizes=SIX, coords=(0, 0, 0, 2), pp_layers=(5, 6))
    body = kvb.body(req)
    body["rank"]["pp_layers"] = {"start": 5, "end": 7}
    assert "the contract's model has 6 target layers" in refused(http.post("/v1/ranks", json=body))
    body["rank"]["pp_layers"] = {"start": 5, "end": 5}
    r = http.post("/v1/ranks", json=body)
    # schema-valid, but a cross-field rule: 409 inconsistent_request, the daemon's answer to those
    assert r.status_code == 409 and r.json()["error"] == "inconsistent_request" and "start must be below end" in r.text

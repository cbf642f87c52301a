"""Every error answer is the documented ErrorBody, and what the OpenAPI schema accepts
is never answered 422 (issue 10, bug 7): JSON nested past the parser's limit, unknown
routes and methods, and bodies that match the schema but break a rule the schema cannot
express (those are 409 ``inconsistent_request``, naming the rule and the field)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvbridge.bootstrap.contract import RuntimeContract


def assert_error_body(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) <= {"error", "message", "field", "diff", "missing", "fields"} and body["error"] == code, body
    assert isinstance(body["message"], str) and body["message"]
    return body


@pytest.mark.parametrize("depth", [1000, 5000, 100_000])
@pytest.mark.parametrize("path", ["/v1/ranks", "/v1/lookup"])
def test_deeply_nested_json_gets_the_documented_error(http: httpx.Client, path: str, depth: int) -> None:
    for body in ("[" * depth + "]" * depth, '{"rank":' + "[" * depth + "]" * depth + "}"):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert assert_error_body(r, 400, "json_too_deep")["field"] == "body"
    assert http.get("/healthz").status_code == 200  # and the daemon is fine


def test_unknown_routes_and_methods_get_the_documented_error(http: httpx.Client) -> None:
    assert_error_body(http.get("/v2/nothing"), 404, "not_found")
    assert_error_body(http.put("/v1/ranks"), 405, "method_not_allowed")


def _register_body(kvb: Any, contract: RuntimeContract, name: str) -> dict[str, Any]:
    return kvb.body(kvb.register_request(contract, name))


def _rank_outside_its_size(b: dict[str, Any]) -> None:
    b["rank"].update(cp_size=2, cp_rank=2)  # each in range for the schema; together impossible


def _source_digest(b: dict[str, Any]) -> None:
    b["contract"]["source"]["digest"] = "0" * 64  # a hex digest, but not of these files


def _duplicate_pool(b: dict[str, Any]) -> None:
    b["contract"]["pools"].append(copy.deepcopy(b["contract"]["pools"][0]))


def _descriptor(b: dict[str, Any]) -> None:
    b["pools"][0]["bytes_per_page"] += 1  # a fine integer, but not what the body's contract says


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (_rank_outside_its_size, "rank.cp_rank", "outside cp_size"),
        (_source_digest, "contract.source", "digest does not match"),
        (_duplicate_pool, "contract.pools", "distinct"),
        (_descriptor, "pools[0].bytes_per_page", "bytes per page"),
    ],
    ids=["rank-outside-size", "source-digest", "duplicate-pool", "descriptor-vs-contract"],
)
def test_schema_valid_bodies_that_break_a_rule_are_409_not_422(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                                instance_name: Callable[[str], str], mutate: Callable[[dict], None],
                                                                field: str, words: str) -> None:
    body = _register_body(kvb, small_contract, instance_name("p"))
    mutate(body)
    err = assert_error_body(http.post("/v1/ranks", json=body), 409, "inconsistent_request")
    assert err["field"] == field and words in err["message"], err


def test_lookup_from_a_prefill_rank_is_a_rule_not_a_type(http: httpx.Client, kvb: Any, small_contract: RuntimeContract) -> None:
    body = kvb.lookup_body(small_contract, "anyone", room=1)
    body["rank"]["role"] = "prefill"
    err = assert_error_body(http.post("/v1/lookup", json=body), 409, "inconsistent_request")
    assert err["field"] == "rank" and "decode ranks" in err["message"]


def test_a_body_the_schema_refuses_is_still_422(http: httpx.Client, kvb: Any, small_contract: RuntimeContract) -> None:
    body = _register_body(kvb, small_contract, "x")
    body["rank"]["cp_rank"] = -1  # the schema says minimum 0
    _source_digest(body)  # a rule broken too: the schema error wins
    err = assert_error_body(http.post("/v1/ranks", json=body), 422, "invalid_request")
    assert err["field"] == "rank.cp_rank"
    schema = http.get("/openapi.json").json()["components"]["schemas"]["RankIdentity"]["properties"]["cp_rank"]
    assert schema["minimum"] == 0
    room = http.get("/openapi.json").json()["components"]["schemas"]["LookupRequest"]["properties"]["room"]
    assert room["exclusiveMaximum"] == 2**63  # a bound an f64 JSON-schema validator holds exactly

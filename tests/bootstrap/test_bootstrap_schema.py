"""The daemon agrees with its own OpenAPI schema (issue 20, finding 8): what the schema allows is
never refused for its form, a query parameter is one value, and a 405's ``Allow`` lists every
method of the path. One targeted test per mismatch schemathesis found, then a bounded
schemathesis run (when it is installed) that would find the next one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbridge.bootstrap.contract import RuntimeContract


def _whole_floats(node: Any, keys: set[str]) -> Any:
    """``node`` with the ints under ``keys`` (at any depth) written as floats: 32 -> 32.0."""
    if isinstance(node, dict):
        return {k: (float(v) if k in keys and isinstance(v, int) and not isinstance(v, bool) else _whole_floats(v, keys))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_whole_floats(v, keys) for v in node]
    return node


def test_register_takes_whole_numbers_written_as_floats(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                        instance_name: Any) -> None:
    """Strict-mode refusal 1: JSON Schema's ``integer`` includes 992.0; the strict models refused it
    (422 int_type) in POST /v1/ranks."""
    body = kvb.body(kvb.register_request(small_contract, instance_name("p")))
    floated = _whole_floats(body, {"capacity_pages", "bytes_per_page", "layer_id", "dp_size", "draft_layers",
                                   "wire_version", "row_bytes", "lease_ttl_s"})
    assert floated["pools"][0]["capacity_pages"] == 32.0 and isinstance(floated["pools"][0]["capacity_pages"], float)
    r = http.post("/v1/ranks", content=httpx.Request("POST", "/", json=floated).content,
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 201, r.text
    # still strict about what the schema refuses: a string, a boolean, a fraction
    for bad in ("32", True, 32.5):
        wrong = {**body, "pools": [{**body["pools"][0], "capacity_pages": bad}, *body["pools"][1:]]}
        refused = http.post("/v1/ranks", json=wrong)
        assert refused.status_code == 422 and refused.json()["field"] == "pools[0].capacity_pages", (bad, refused.text)


def test_lookup_takes_whole_numbers_written_as_floats(http: httpx.Client, kvb: Any,
                                                      small_contract: RuntimeContract) -> None:
    """Strict-mode refusal 2: the same in POST /v1/lookup (``room``, ``dp_rank``, the contract's ints);
    and a room of 2**63 + 190 (above the bound, written exactly) is still refused."""
    body = _whole_floats(kvb.lookup_body(small_contract, "no-such-prefill", 7, dp_rank=0),
                         {"room", "dp_rank", "wire_version", "target_layers"})
    r = http.post("/v1/lookup", json=body)
    assert r.status_code == 404 and r.json()["error"] == "unknown_instance", r.text
    big = http.post("/v1/lookup", content=httpx.Request("POST", "/", json=body).content.replace(
        b'"room": 7.0', b'"room": 9223372036854775998.0').replace(b'"room":7.0', b'"room":9223372036854775998.0'),
        headers={"Content-Type": "application/json"})
    assert big.status_code == 422 and big.json()["field"] == "room", big.text


def test_openapi_bounds_are_exact_integers(http: httpx.Client) -> None:
    """FastAPI wrote ``lt=2**63`` as 9.223372036854776e+18; clients computed edge cases in floats."""
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["LookupRequest"]["properties"]["room"]["exclusiveMaximum"] == 2**63
    assert isinstance(schemas["PoolDescriptor"]["properties"]["base"]["exclusiveMaximum"], int)
    assert http.get("/openapi.json").text.count("e+") == 0


def test_a_repeated_query_parameter_is_refused(http: httpx.Client) -> None:
    """``?limit=1&limit=2`` answered 200 (FastAPI took the last value); the schema has one value."""
    r = http.get("/v1/diagnostics/mismatches", params=[("limit", "1"), ("limit", "2")])
    assert r.status_code == 422 and r.json()["field"] == "query.limit" and "more than once" in r.json()["message"], r.text
    assert http.get("/v1/diagnostics/mismatches", params={"limit": "1"}).status_code == 200


def test_405_allow_lists_every_method_of_the_path(http: httpx.Client) -> None:
    """``OPTIONS /v1/ranks/{id}`` answered ``Allow: DELETE``: Starlette named only the first route
    that matched the path (GET and DELETE are two routes)."""
    r = http.request("OPTIONS", "/v1/ranks/abc")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers
    assert r.json()["error"] == "method_not_allowed"
    assert http.put("/v1/ranks").headers["allow"] == "POST"
    assert http.delete("/v1/lookup").headers["allow"] == "POST"


def test_schemathesis_finds_no_mismatch(daemon: Any, tmp_path: Path) -> None:
    """A bounded schemathesis run (coverage and fuzzing phases, 25 examples per operation, every
    check) against the module's daemon."""
    pytest.importorskip("schemathesis")
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if cli is None:
        pytest.skip("schemathesis is importable but its command is not beside this Python")
    argv = [cli, "run", f"{daemon.url}/openapi.json", "--checks", "all", "--max-examples", "25",
            "--phases", "coverage,fuzzing", "--seed", "20", "--no-color", "--report-dir", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]

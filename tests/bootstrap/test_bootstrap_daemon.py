"""The daemon over real HTTP on loopback: registration, leases, the lookup
handshake (200 / 409 per contract section / 503 / 404), validation errors,
diagnostics JSON and metrics."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.bootstrap.contract import RuntimeContract, fingerprint

Sizes = tuple[int, int, int, int]


def register_all(http: httpx.Client, kvb: Any, contract: RuntimeContract, name: str, sizes: Sizes,
                 skip: tuple[tuple[int, int, int, int], ...] = ()) -> dict[tuple[int, int, int, int], str]:
    ids = {}
    for coords in kvb.all_coords(sizes):
        if coords in skip:
            continue
        r = http.post("/v1/ranks", json=kvb.body(kvb.register_request(contract, name, sizes=sizes, coords=coords)))
        assert r.status_code == 201, r.text
        ids[coords] = r.json()["rank_id"]
    return ids


def test_health_docs_and_openapi(http: httpx.Client) -> None:
    assert http.get("/healthz").json()["status"] == "ok"
    assert http.get("/docs").status_code == 200
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/ranks", "/v1/ranks/{rank_id}/heartbeat", "/v1/ranks/{rank_id}", "/v1/lookup",
            "/v1/instances", "/v1/diagnostics/fingerprints", "/v1/diagnostics/mismatches"} <= set(paths)


def test_register_heartbeat_deregister(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                       instance_name: Callable[[str], str]) -> None:
    name = instance_name("p")
    r = http.post("/v1/ranks", json=kvb.body(kvb.register_request(small_contract, name, lease_ttl_s=5.0)))
    assert r.status_code == 201
    body = r.json()
    assert body["fingerprint"] == fingerprint(small_contract) and body["lease_ttl_s"] == 5.0
    rank_id, lease = body["rank_id"], {"X-KVBridge-Lease": body["lease_secret"]}
    assert len(body["lease_secret"]) >= 32
    view = http.get(f"/v1/instances/{name}").json()
    assert view["role"] == "prefill" and view["num_ranks"] == 1 and view["complete"] is True
    assert view["ranks"][0]["control_endpoint"] == "tcp://127.0.0.1:20000"
    assert name in [i["name"] for i in http.get("/v1/instances").json()]

    hb = http.post(f"/v1/ranks/{rank_id}/heartbeat", headers=lease)
    assert hb.status_code == 200 and hb.json()["rank_id"] == rank_id
    assert http.delete(f"/v1/ranks/{rank_id}", headers=lease).status_code == 204
    gone = http.post(f"/v1/ranks/{rank_id}/heartbeat", headers=lease)
    assert gone.status_code == 404 and gone.json()["error"] == "unknown_rank"
    assert http.get(f"/v1/instances/{name}").status_code == 404


def test_same_coordinates_register_again_replace_the_old_record(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                               instance_name: Callable[[str], str]) -> None:
    name = instance_name("p")
    answer = http.post("/v1/ranks", json=kvb.body(kvb.register_request(small_contract, name))).json()
    first, lease = answer["rank_id"], {"X-KVBridge-Lease": answer["lease_secret"]}
    second = http.post("/v1/ranks", json=kvb.body(kvb.register_request(small_contract, name)), headers=lease).json()
    assert second["replaced"] == first and second["rank_id"] != first and second["lease_secret"] != answer["lease_secret"]
    assert http.post(f"/v1/ranks/{first}/heartbeat", headers=lease).status_code == 404
    assert http.get(f"/v1/instances/{name}").json()["num_ranks"] == 1


def test_lease_expires_without_heartbeat(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                         instance_name: Callable[[str], str]) -> None:
    name = instance_name("p")
    short_ans = http.post("/v1/ranks", json=kvb.body(kvb.register_request(small_contract, name, lease_ttl_s=0.4))).json()
    short = short_ans["rank_id"]
    kept = http.post("/v1/ranks", json=kvb.body(kvb.register_request(
        small_contract, name, sizes=(1, 2, 1, 1), coords=(0, 1, 0, 0), lease_ttl_s=0.4)))
    assert kept.status_code == 409  # sizes disagree with the first rank; see the topology test
    kept = http.post("/v1/ranks", json=kvb.body(kvb.register_request(
        small_contract, instance_name("q"), lease_ttl_s=0.4))).json()
    kept_id = kept["rank_id"]
    for _ in range(4):  # keep one alive across the other's expiry
        time.sleep(0.2)
        assert http.post(f"/v1/ranks/{kept_id}/heartbeat", headers={"X-KVBridge-Lease": kept["lease_secret"]}).status_code == 200
    assert http.post(f"/v1/ranks/{short}/heartbeat", headers={"X-KVBridge-Lease": short_ans["lease_secret"]}).status_code == 404
    assert http.get(f"/v1/instances/{name}").status_code == 404
    assert "kvbridge_bootstrap_leases_expired_total" in http.get("/metrics").text


def test_lookup_returns_the_cp_senders_of_the_chosen_dp_group(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                             instance_name: Callable[[str], str]) -> None:
    name = instance_name("prefill")
    sizes = (2, 2, 2, 1)  # dp x cp x tp x pp
    ids = register_all(http, kvb, small_contract, name, sizes)
    r = http.post("/v1/lookup", json=kvb.lookup_body(small_contract, name, room=7))
    assert r.status_code == 200, r.text
    ans = r.json()
    assert ans["dp_rank"] == 1  # room % dp_size
    assert ans["plan"] == {"cp_size": 2, "rule": "interleaved"}
    assert ans["fingerprint"] == fingerprint(small_contract)
    assert ans["topology"] == {"role": "prefill", "dp_size": 2, "cp_size": 2, "tp_size": 2, "pp_size": 1}
    assert [(s["dp_rank"], s["cp_rank"], s["tp_rank"]) for s in ans["ranks"]] == [(1, 0, 0), (1, 1, 0)]
    assert [s["rank_id"] for s in ans["ranks"]] == [ids[(1, 0, 0, 0)], ids[(1, 1, 0, 0)]]
    sender = ans["ranks"][1]
    assert sender["control_endpoint"] == "tcp://127.0.0.1:21100" and sender["session_id"].startswith("127.0.0.1:")
    assert {(p["pool"], p["layer_id"]) for p in sender["pools"]} == {("target", 0), ("target", 1), ("index", 0), ("index", 1), ("draft", 2)}
    assert sender["aux"]["row_bytes"] == small_contract.aux.row_bytes

    explicit = http.post("/v1/lookup", json=kvb.lookup_body(small_contract, name, room=7, dp_rank=0)).json()
    assert [s["dp_rank"] for s in explicit["ranks"]] == [0, 0]
    outside = http.post("/v1/lookup", json=kvb.lookup_body(small_contract, name, room=7, dp_rank=5))
    assert outside.status_code == 409 and outside.json()["error"] == "topology_mismatch"


def test_lookup_returns_every_pipeline_stage(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                             instance_name: Callable[[str], str]) -> None:
    name = instance_name("prefill")
    register_all(http, kvb, small_contract, name, (1, 2, 1, 2))
    ans = http.post("/v1/lookup", json=kvb.lookup_body(small_contract, name, room=3)).json()
    assert [(s["cp_rank"], s["pp_rank"]) for s in ans["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_lookup_503_names_the_missing_ranks(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                            instance_name: Callable[[str], str]) -> None:
    name = instance_name("prefill")
    register_all(http, kvb, small_contract, name, (1, 4, 2, 1), skip=((0, 2, 0, 0), (0, 3, 1, 0)))
    r = http.post("/v1/lookup", json=kvb.lookup_body(small_contract, name, room=0))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    body = r.json()
    assert body["error"] == "instance_incomplete"
    assert body["missing"] == [f"{name}/dp0/cp2/tp0/pp0"]  # tp1 of cp3 is not a sender
    assert f"{name}/dp0/cp2/tp0/pp0" in body["message"]


def test_lookup_404_for_unknown_or_decode_instance(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                   instance_name: Callable[[str], str]) -> None:
    r = http.post("/v1/lookup", json=kvb.lookup_body(small_contract, instance_name("nobody"), room=1))
    assert r.status_code == 404 and r.json()["error"] == "unknown_instance" and r.json()["field"] == "prefill_instance"
    decode = instance_name("decode")
    http.post("/v1/ranks", json=kvb.body(kvb.register_request(small_contract, decode, role="decode")))
    r = http.post("/v1/lookup", json=kvb.lookup_body(small_contract, decode, room=1))
    assert r.status_code == 404 and "decode instance" in r.json()["message"]


def test_lookup_409_with_diff_for_each_contract_change(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                       instance_name: Callable[[str], str], mutation: Any) -> None:
    """Parametrized over every contract field (conftest.MUTATIONS)."""
    path = mutation.path
    name = instance_name("prefill")
    register_all(http, kvb, small_contract, name, (1, 1, 1, 1))
    decode_contract = mutation.apply(small_contract)
    decode = instance_name("decode")
    r = http.post("/v1/lookup", json=kvb.lookup_body(decode_contract, name, room=11, decode=decode))
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["error"] == "contract_mismatch"
    assert path in [d["path"] for d in body["diff"]]
    assert all(d["breaks"] for d in body["diff"])
    recorded = [m for m in http.get("/v1/diagnostics/mismatches").json() if m["right"]["instance"] == decode]
    assert len(recorded) == 1
    m = recorded[0]
    assert (m["kind"], m["reason"]) == ("lookup", "contract")
    assert m["left"]["fingerprint"] == fingerprint(small_contract) and m["right"]["fingerprint"] == fingerprint(decode_contract)
    assert m["diff"] == body["diff"]


def test_registration_refused_when_ranks_of_one_instance_disagree(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                                  instance_name: Callable[[str], str], all_mutations: list[Any]) -> None:
    name = instance_name("prefill")
    sizes = (1, 2, 1, 1)
    http.post("/v1/ranks", json=kvb.body(kvb.register_request(small_contract, name, sizes=sizes, coords=(0, 0, 0, 0))))
    other = next(m for m in all_mutations if m.path == "model.revision").apply(small_contract)
    r = http.post("/v1/ranks", json=kvb.body(kvb.register_request(other, name, sizes=sizes, coords=(0, 1, 0, 0))))
    assert r.status_code == 409 and r.json()["error"] == "contract_mismatch"
    assert [d["path"] for d in r.json()["diff"]] == ["model.revision"]

    r = http.post("/v1/ranks", json=kvb.body(kvb.register_request(small_contract, name, sizes=(1, 4, 1, 1), coords=(0, 1, 0, 0))))
    assert r.status_code == 409 and r.json()["error"] == "topology_mismatch"
    assert r.json()["diff"][0] | {"breaks": ""} == {"path": "topology.cp_size", "prefill": 2, "decode": 4, "breaks": ""}
    r = http.post("/v1/ranks", json=kvb.body(kvb.register_request(small_contract, name, role="decode", sizes=sizes, coords=(0, 1, 0, 0))))
    assert r.status_code == 409 and r.json()["diff"][0]["path"] == "topology.role"

    kinds = [(m["kind"], m["reason"]) for m in http.get("/v1/diagnostics/mismatches").json() if m["left"]["instance"] == name]
    assert kinds == [("register", "topology"), ("register", "topology"), ("register", "contract")]  # newest first
    assert http.get(f"/v1/instances/{name}").json()["num_ranks"] == 1


def test_descriptors_must_fit_their_own_contract(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                 instance_name: Callable[[str], str]) -> None:
    body = kvb.body(kvb.register_request(small_contract, instance_name("p")))
    bad = copy.deepcopy(body)
    bad["pools"][0]["bytes_per_page"] += 1
    r = http.post("/v1/ranks", json=bad)  # schema-valid, but contradicts the body's own contract
    assert r.status_code == 409 and r.json()["error"] == "inconsistent_request" and r.json()["field"] == "pools[0].bytes_per_page"
    bad = copy.deepcopy(body)
    bad["pools"][1]["pool"] = "mystery"
    assert http.post("/v1/ranks", json=bad).json()["field"] == "pools[1].pool"
    bad = copy.deepcopy(body)
    bad["pools"][1] = dict(bad["pools"][0])
    assert http.post("/v1/ranks", json=bad).json()["field"] == "pools[1].layer_id"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b["rank"].update(dp_rank="0"), "rank.dp_rank"),
        (lambda b: b["rank"].update(role="router"), "rank.role"),
        (lambda b: b["pools"][0].update(capacity_pages=1.5), "pools[0].capacity_pages"),
        (lambda b: b.pop("contract"), "contract"),
        (lambda b: b["contract"]["pools"][0].update(page_size="64"), "contract.pools[0].page_size"),
        (lambda b: b.update(lease_ttl_s=-1), "lease_ttl_s"),
        (lambda b: b.update(surprise=1), "surprise"),
        (lambda b: b.update(control_endpoint="not an endpoint"), "control_endpoint"),
        (lambda b: b["rank"].update(instance="<script>"), "rank.instance"),
    ],
    ids=["string-rank", "role", "float-capacity", "missing-contract", "string-page-size",
         "negative-ttl", "unknown-key", "endpoint", "instance-name"],
)
def test_wrong_field_types_name_the_field(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                          mutate: Callable[[dict], Any], field: str) -> None:
    body = kvb.body(kvb.register_request(small_contract, "valid-name"))
    mutate(body)
    r = http.post("/v1/ranks", json=body)
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["error"] == "invalid_request" and err["field"] == field and field in err["message"]


def test_lookup_must_come_from_a_decode_rank(http: httpx.Client, kvb: Any, small_contract: RuntimeContract) -> None:
    body = kvb.lookup_body(small_contract, "anyone", room=1)
    body["rank"]["role"] = "prefill"
    r = http.post("/v1/lookup", json=body)  # schema-valid (role is prefill or decode): a rule, not a type
    assert r.status_code == 409 and r.json()["error"] == "inconsistent_request"
    assert r.json()["field"] == "rank" and "decode ranks" in r.json()["message"]
    body = kvb.lookup_body(small_contract, "anyone", room=2**63)
    assert http.post("/v1/lookup", json=body).json()["field"] == "room"


def test_malformed_json_and_wrong_media_type(http: httpx.Client) -> None:
    r = http.post("/v1/lookup", content=b'{"room": 1,', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == "malformed_json"
    r = http.post("/v1/ranks", content=b"room=1", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415


def test_diagnostics_fingerprints_and_metrics(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                              instance_name: Callable[[str], str]) -> None:
    name = instance_name("prefill")
    register_all(http, kvb, small_contract, name, (1, 2, 1, 1))
    fps = {f["instance"]: f for f in http.get("/v1/diagnostics/fingerprints").json()}
    assert fps[name]["fingerprint"] == fingerprint(small_contract)
    assert RuntimeContract.model_validate(fps[name]["contract"]) == small_contract
    assert fps[name]["ranks"] == [f"{name}/dp0/cp0/tp0/pp0", f"{name}/dp0/cp1/tp0/pp0"]
    assert http.post("/v1/lookup", json=kvb.lookup_body(small_contract, name, room=1)).status_code == 200
    assert len(http.get("/v1/diagnostics/mismatches", params={"limit": 1}).json()) <= 1

    text = http.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain; version=")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text.text) for s in f.samples}
    assert all(name.startswith("kvbridge_") for name, _ in samples)
    assert samples[("kvbridge_bootstrap_registered_ranks", (("role", "prefill"),))] >= 2
    assert samples[("kvbridge_bootstrap_lookups_total", (("outcome", "ok"),))] >= 1
    assert samples[("kvbridge_bootstrap_registrations_total", (("outcome", "ok"),))] >= 2
    bucket = ("kvbridge_bootstrap_request_duration_seconds_bucket", (("le", "+Inf"), ("method", "POST"), ("route", "/v1/lookup")))
    assert samples[bucket] >= 1


def test_small_requests_are_not_held_back_by_nagle(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                   instance_name: Callable[[str], str]) -> None:
    """The daemon's listener must give accepted connections TCP_NODELAY: without it a
    response written in two parts waits for a delayed ACK, ~40 ms per request. asyncio (and so
    uvicorn) sets it on an accepted connection only when the listener says IPPROTO_TCP: the
    listener ``bind_socket`` makes is served by asyncio here and the accepted socket's option
    read back (no clock: the machine's load cannot fail it), then the daemon answers on one
    connection."""
    import asyncio
    import socket

    from kvbridge.bootstrap.server import bind_socket

    async def accepted_nodelay() -> int:
        listener = bind_socket("127.0.0.1", 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=listener)
        try:
            _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            try:
                return await asyncio.wait_for(seen, 30)
            finally:
                writer.close()
        finally:
            server.close()
            await server.wait_closed()

    with bind_socket("127.0.0.1", 0) as listener:
        assert listener.proto == socket.IPPROTO_TCP
    assert asyncio.run(accepted_nodelay()) != 0
    name = instance_name("prefill")
    register_all(http, kvb, small_contract, name, (1, 1, 1, 1))
    body = kvb.lookup_body(small_contract, name, room=1)
    for _ in range(10):
        assert http.get("/healthz").status_code == 200
        assert http.post("/v1/lookup", json=body).status_code == 200

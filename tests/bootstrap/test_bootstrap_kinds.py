"""Pool kinds in the runtime contract: the DeepSeek-V4 preset's window, compressed and
state pools are fingerprinted field by field, a paged contract's encoding did not change,
and a decode whose window or ratio differs is refused at the handshake naming the field
(409 body, the mismatch record and the /diagnostics page), with a sentence for each field."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvbridge.bootstrap.contract import RuntimeContract, canonical_json, contract_for, contract_from_preset
from kvbridge.bootstrap.diff import diff_contracts
from kvbridge.errors import ContractError
from kvbridge.layout import AuxSchema
from kvbridge.layout.hybrid import deepseek_v4_pools, mamba_pools, window_pool


@pytest.fixture(scope="module")
def v4() -> RuntimeContract:
    return contract_from_preset("deepseek-v4", num_layers=4, page_size=16)


def _changed(contract: RuntimeContract, pool: str, **fields: Any) -> RuntimeContract:
    d = copy.deepcopy(contract.model_dump(mode="json"))
    next(p for p in d["pools"] if p["name"] == pool).update(fields)
    return RuntimeContract.model_validate(d)


def test_paged_pools_leave_the_kind_fields_out_of_the_encoding(v4):
    v32 = json.loads(canonical_json(contract_from_preset("deepseek-v3.2", num_layers=4, page_size=16)))
    assert not any(k in p for p in v32["pools"] for k in ("kind", "window", "ratio", "shard_units"))
    pools = {p["name"]: p for p in json.loads(canonical_json(v4))["pools"]}
    assert pools["swa"]["kind"] == "window" and pools["swa"]["window"] == 127
    assert (pools["csa"]["kind"], pools["csa"]["ratio"]) == ("compressed", 4)
    assert (pools["hca"]["kind"], pools["hca"]["ratio"]) == ("compressed", 128)
    assert pools["hca_tail"]["kind"] == "state"


def test_v4_preset_layers_and_round_trip(v4):
    assert v4.model.name == "deepseek-ai/DeepSeek-V4-Flash" and v4.model.target_layers == 4
    assert v4.pool("csa").layer_ids == [3] and v4.pool("hca").layer_ids == [0, 1, 2]
    assert v4.pool("draft").layer_ids == [4] and v4.pool("swa").layer_ids == [0, 1, 2, 3]
    assert v4.page_size == 16
    again = RuntimeContract.model_validate(v4.model_dump(mode="json"))
    assert again.fingerprint() == v4.fingerprint()


@pytest.mark.parametrize("pool, fields, word", [
    ("swa", dict(window=63), "window"),
    ("hca", dict(ratio=64), "ratio"),
    ("csa", dict(ratio=8), "ratio"),
    ("swa", dict(ring_stride=128), "ring_stride"),
    ("csa_tail", dict(ratio=2), "ratio"),
])
def test_each_kind_field_changes_the_fingerprint_and_is_diffed_by_name(v4, pool, fields, word):
    other = _changed(v4, pool, **fields)
    assert other.fingerprint() != v4.fingerprint()
    diff = diff_contracts(v4, other)
    assert [d.path for d in diff] == [f"pools.{pool}.{word}"]
    assert "one side only" not in diff[0].breaks and diff[0].breaks


def test_a_kind_field_on_the_wrong_kind_is_refused_by_name(v4):
    with pytest.raises(ValueError, match="ratio belongs to another pool kind"):
        _changed(v4, "swa", ratio=4)
    with pytest.raises(ValueError, match="window"):
        _changed(v4, "swa", window=0)


def test_hybrid_pools_through_contract_for():
    pools = {**mamba_pools([0, 2], conv_groups=(64, 16, 16), conv_kernel=4, num_heads=8, head_dim=16, state_size=16),
             "swa": window_pool("swa", [1, 3], 256, window=31, page_size=16)}
    c = contract_for(pools, model="tiny/hybrid", aux=AuxSchema.standard(0, "bfloat16", 0))
    assert c.pool("mamba_conv").shard_units == [64, 16, 16]
    assert c.pool("mamba_ssm").bytes_per_token == 8 * 16 * 16 * 4
    # a rank's TP-cut state slot is described by its whole slot
    tp2 = mamba_pools([0, 2], conv_groups=(64, 16, 16), conv_kernel=4, num_heads=8, head_dim=16, state_size=16,
                      tp_size=2)
    c2 = contract_for({**tp2, "swa": pools["swa"]}, model="tiny/hybrid", aux=AuxSchema.standard(0, "bfloat16", 0))
    assert c2.fingerprint() == c.fingerprint()
    with pytest.raises(ContractError):
        contract_for([*deepseek_v4_pools(4, 16).values(), window_pool("x", [9], 64, window=7, page_size=32)],
                     model="m", aux=AuxSchema.standard(0, "bfloat16", 0))


def test_handshake_refuses_a_decode_whose_window_differs(http: httpx.Client, kvb: Any, v4: RuntimeContract,
                                                         instance_name: Callable[[str], str], daemon: Any) -> None:
    prefill = instance_name("prefill-v4")
    r = http.post("/v1/ranks", json=kvb.body(kvb.register_request(v4, prefill)))
    assert r.status_code == 201, r.text
    assert http.post("/v1/lookup", json=kvb.lookup_body(v4, prefill, room=1)).status_code == 200
    decode = instance_name("decode-v4")
    narrow = _changed(v4, "swa", window=63)
    r = http.post("/v1/lookup", json=kvb.lookup_body(narrow, prefill, room=2, decode=decode))
    assert r.status_code == 409 and r.json()["error"] == "contract_mismatch"
    assert [(d["path"], d["prefill"], d["decode"]) for d in r.json()["diff"]] == [("pools.swa.window", 127, 63)]
    recorded = [m for m in http.get("/v1/diagnostics/mismatches").json() if m["right"]["instance"] == decode]
    assert recorded and recorded[0]["diff"][0]["path"] == "pools.swa.window"
    page = httpx.get(f"{daemon.url}/diagnostics", trust_env=False).text
    assert "pools.swa.window" in page


def test_doctor_names_the_kind_field_that_differs(v4):
    from kvbridge.bootstrap.schemas import InstanceFingerprint
    from kvbridge.doctor.checks import contract_check

    other = _changed(v4, "hca", ratio=64)
    rows = [InstanceFingerprint(instance="p", role="prefill", fingerprint=v4.fingerprint(), contract=v4, ranks=["r"]),
            InstanceFingerprint(instance="d", role="decode", fingerprint=other.fingerprint(), contract=other,
                                ranks=["r"])]
    check = contract_check(rows, "p", "d")
    assert check.status == "FAIL"
    assert "pools.hca.ratio: prefill 128 / decode 64" in check.detail
    assert check.data["diff"][0]["path"] == "pools.hca.ratio"


def test_contract_show_prints_the_kinds(capsys):
    from kvbridge.cli.main import main

    assert main(["contract", "show", "--preset", "deepseek-v4", "--layers", "4", "--page-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "window 127" in out and "compressed 1:128" in out and "state slot (tail of 4)" in out
    assert out.split()[1] == contract_from_preset("deepseek-v4", num_layers=4, page_size=16).fingerprint()


def test_handshake_refuses_a_bf16_decode_of_an_fp8_prefill_naming_the_dtype(
        http: httpx.Client, kvb: Any, v4: RuntimeContract, instance_name: Callable[[str], str]) -> None:
    """The contract carries each pool's dtype: an fp8 V4 prefill (SGLang's FlashMLA layout,
    ``deepseek-v4-fp8``) and a bf16 V4 decode of the same geometry are refused at the look-up,
    the diff naming ``pools.<pool>.dtype`` with both values."""
    fp8 = contract_from_preset("deepseek-v4-fp8", num_layers=4, page_size=16)
    prefill = instance_name("prefill-v4-fp8")
    r = http.post("/v1/ranks", json=kvb.body(kvb.register_request(fp8, prefill)))
    assert r.status_code == 201, r.text
    r = http.post("/v1/lookup", json=kvb.lookup_body(v4, prefill, room=3, decode=instance_name("decode-v4-bf16")))
    assert r.status_code == 409 and r.json()["error"] == "contract_mismatch"
    diff = {d["path"]: (d["prefill"], d["decode"]) for d in r.json()["diff"]}
    assert diff["pools.swa.dtype"] == ("v4_fp8_nope_bf16_rope", "bfloat16")
    assert diff["pools.csa_index.dtype"] == ("fp8_e4m3_with_scale", "bfloat16")
    assert diff["pools.hca.page_stride"] == (17 * 576, 0)  # 16 rows x 584 B padded to whole 576-byte rows
    assert "pools.csa.dtype" in r.json()["message"]  # among the first fields the refusal names
    assert not any(p.startswith("pools.csa_tail") for p in diff)  # the compressor state is fp32 on both


def test_contract_show_prints_the_fp8_rows_and_their_padded_pages(capsys):
    from kvbridge.cli.main import main

    assert main(["contract", "show", "--preset", "deepseek-v4-fp8", "--layers", "4", "--page-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "584 B/token (576+8) x 16 = 9344 padded to 9792 B/page" in out  # 16 x 584 B in 17 rows of 576
    assert "132 B/token (128+4) x 16 = 2112 B/page" in out

"""Runtime contract: canonical encoding, fingerprint stability and sensitivity,
source digest, presets (hard rule 7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvbridge.bootstrap import digest
from kvbridge.bootstrap.contract import (
    CONTRACT_PRESETS,
    FINGERPRINT_PREFIX,
    RuntimeContract,
    SpeculativeContract,
    canonical_json,
    contract_from_preset,
    contract_for,
    fingerprint,
    preset_contract,
    source_digest,
)
from kvbridge.bootstrap.diff import diff_contracts
from kvbridge.errors import ContractError
from kvbridge.layout import AuxSchema, PoolSpec, preset_pools
from kvbridge.layout.pools import PRESETS

Plain = dict[str, Any]


def _reorder(value: Any) -> Any:
    """The same contract with every object's keys and the pool list reversed."""
    if isinstance(value, dict):
        return {k: _reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        items = [_reorder(v) for v in value]
        return list(reversed(items)) if items and isinstance(items[0], dict) and "bytes_per_token" in items[0] else items
    return value


def test_canonical_encoding_is_compact_sorted_ascii_without_floats(small_contract: RuntimeContract) -> None:
    raw = canonical_json(small_contract)
    text = raw.decode("ascii")
    assert ", " not in text and ": " not in text and "\n" not in text
    plain = json.loads(text)
    assert list(plain) == sorted(plain)
    assert [p["name"] for p in plain["pools"]] == sorted(p["name"] for p in plain["pools"])

    def walk(v: Any) -> None:
        assert not isinstance(v, float) and v is not None and not isinstance(v, bool)
        for child in v.values() if isinstance(v, dict) else v if isinstance(v, list) else ():
            walk(child)

    walk(plain)


GOLDEN: Plain = {
    "wire_version": 1,
    "model": {"name": "m", "revision": "r1", "target_layers": 1, "draft_layers": 0},
    "pools": [
        {"name": "target", "dtype": "bfloat16", "abi": "bfloat16", "bytes_per_token": 1152, "page_size": 64,
         "layout": "rows", "value_bytes_per_token": 0, "scale_bytes_per_token": 0, "kernel_abi": "mla-bf16",
         "layer_ids": [0]},
    ],
    "cp_rule": "interleaved",
    "kernel": {"attention_backend": "flashmla", "abi": "mla-paged-v1"},
    "speculative": {"algorithm": "none", "hidden_size": 0, "hidden_dtype": "", "topk": 0},
    "aux": {"regions": [{"name": "room", "dtype": "uint64", "shape": [], "offset": 0, "nbytes": 8}], "row_bytes": 8},
    "source": {"algorithm": "sha256", "files": {"kvbridge/layout/pools.py": "missing"},
               "digest": digest.combine({"kvbridge/layout/pools.py": "missing"})},
}


def test_fingerprint_shape_and_golden_value() -> None:
    """Pins the encoding on a literal contract: if this changes, bump FINGERPRINT_PREFIX
    (daemons of two encodings must never agree by accident)."""
    fp = fingerprint(RuntimeContract.model_validate(GOLDEN))
    assert fp.startswith(FINGERPRINT_PREFIX) and len(fp) == len(FINGERPRINT_PREFIX) + 64
    assert fp == fingerprint(GOLDEN) == "kvb1:e857a36b0eeaedf6267f1204781501290f1371ff1a71755165cae95b6ce8732a"


def test_fingerprint_ignores_key_and_pool_order(small_contract: RuntimeContract) -> None:
    shuffled = _reorder(small_contract.model_dump(mode="json"))
    assert list(shuffled)[0] != sorted(shuffled)[0]
    assert [p["name"] for p in shuffled["pools"]] != sorted(p["name"] for p in shuffled["pools"])
    again = RuntimeContract.model_validate(shuffled)
    assert fingerprint(again) == fingerprint(small_contract) == fingerprint(shuffled)
    assert diff_contracts(small_contract, again) == []


def test_fingerprint_is_equal_across_processes(small_contract: RuntimeContract, tmp_path: Path) -> None:
    shuffled = tmp_path / "contract.json"
    shuffled.write_text(json.dumps(_reorder(small_contract.model_dump(mode="json")), indent=3))
    code = (
        "import json, sys\n"
        "from kvbridge.bootstrap.contract import RuntimeContract, contract_from_preset, fingerprint\n"
        "built = contract_from_preset('deepseek-v3.2-fp8', num_layers=2, page_size=16, draft_layers=1)\n"
        "loaded = RuntimeContract.model_validate(json.load(open(sys.argv[1])))\n"
        "print(fingerprint(built)); print(fingerprint(loaded))\n"
    )
    seen = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code, str(shuffled)], capture_output=True, text=True, env=env,
                             timeout=60, check=True, cwd=tmp_path)
        seen.update(out.stdout.split())
    assert seen == {fingerprint(small_contract)}


def test_every_field_changes_the_fingerprint(small_contract: RuntimeContract, mutation: Any) -> None:
    """``mutation`` is parametrized over every contract field (see conftest.MUTATIONS)."""
    path = mutation.path
    other = mutation.apply(small_contract)
    assert fingerprint(other) != fingerprint(small_contract)
    diff = diff_contracts(small_contract, other)
    assert path in [d.path for d in diff]
    assert all(d.breaks and d.prefill != d.decode for d in diff)


def test_mutations_cover_every_contract_section(all_mutations: list[Any]) -> None:
    sections = {m.path.split(".")[0] for m in all_mutations}
    assert sections == set(RuntimeContract.model_fields)


def test_floats_and_strings_for_ints_are_refused(small_contract: RuntimeContract) -> None:
    d = small_contract.model_dump(mode="json")
    d["pools"][0]["page_size"] = 16.0
    with pytest.raises(ValidationError, match="page_size"):
        RuntimeContract.model_validate(d)
    d = small_contract.model_dump(mode="json")
    d["wire_version"] = "1"
    with pytest.raises(ValidationError, match="wire_version"):
        RuntimeContract.model_validate(d)


def test_pools_must_share_one_page_size_and_distinct_names(small_contract: RuntimeContract) -> None:
    d = small_contract.model_dump(mode="json")
    next(p for p in d["pools"] if p["name"] == "draft")["page_size"] = 32
    with pytest.raises(ValidationError, match="one page size"):
        RuntimeContract.model_validate(d)
    d = small_contract.model_dump(mode="json")
    d["pools"].append(dict(d["pools"][0]))
    with pytest.raises(ValidationError, match="distinct"):
        RuntimeContract.model_validate(d)


def test_source_digest_covers_layout_and_wire_modules_and_marks_missing(tmp_path: Path) -> None:
    files = source_digest().files
    assert "kvbridge/layout/pools.py" in files and len(files["kvbridge/layout/pools.py"]) == 64
    assert "kvbridge/transfer/channel/wire.py" in files  # declared even while missing
    engine_file = tmp_path / "kv_pool.py"
    engine_file.write_text("PAGE = 64\n")
    with_engine = source_digest({"engine/kv_pool.py": engine_file, "engine/gone.py": tmp_path / "gone.py"})
    assert with_engine.files["engine/gone.py"] == "missing"
    assert with_engine.digest != source_digest().digest
    engine_file.write_text("PAGE = 32\n")
    assert source_digest({"engine/kv_pool.py": engine_file, "engine/gone.py": tmp_path / "gone.py"}).digest != with_engine.digest
    with pytest.raises(ContractError, match="relative"):
        source_digest({"/abs/path.py": engine_file})
    with pytest.raises(ContractError, match="kvbridge's own"):
        source_digest({"kvbridge/layout/pools.py": engine_file})


def test_source_digest_must_match_its_files(small_contract: RuntimeContract) -> None:
    d = small_contract.model_dump(mode="json")
    d["source"]["files"]["kvbridge/layout/pools.py"] = "0" * 64  # digest not recomputed: tampered
    with pytest.raises(ValidationError, match="source digest"):
        RuntimeContract.model_validate(d)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets(preset: str) -> None:
    c = preset_contract(preset, num_layers=3, page_size=64)
    names = [p.name for p in c.pools]
    assert ("index" in names) == preset.startswith("deepseek-v3.2")
    assert c.pool("draft").layer_ids == [3] and c.model.draft_layers == 1
    assert c.speculative.algorithm == "nextn"
    if "index" in names:
        index = c.pool("index")
        assert (index.layout, index.abi, index.value_bytes_per_token, index.scale_bytes_per_token) == ("values_then_scales", "uint8", 128, 4)
    assert c.pool("target").bytes_per_token == (656 if preset.endswith("-fp8") else 1152)
    assert set(CONTRACT_PRESETS) == set(PRESETS) | {"deepseek-v4", "deepseek-v4-fp8"}  # V4: window, compressed, state
    with pytest.raises(ContractError, match="preset"):
        preset_contract("llama")


def test_no_draft_layers_means_no_speculation() -> None:
    c = contract_from_preset("deepseek-v3", num_layers=2, draft_layers=0)
    assert c.speculative.algorithm == "none" and "draft" not in [p.name for p in c.pools]
    with pytest.raises(ValidationError, match="hidden_size"):
        SpeculativeContract(algorithm="eagle", hidden_size=0, hidden_dtype="bfloat16", topk=1)


def test_the_contract_aux_is_the_layout_aux_schema() -> None:
    """One AuxSchema: the contract holds its to_dict() and gives it back (it once rejected it)."""
    for hidden, dtype, topk in ((7168, "bfloat16", 1), (64, "float32", 4), (0, "bfloat16", 0)):
        schema = AuxSchema.standard(hidden, dtype, topk)
        c = contract_from_preset("deepseek-v3.2", num_layers=2, aux=schema)
        assert c.aux.model_dump() == schema.to_dict() and c.aux.to_schema() == schema
        assert RuntimeContract.model_validate(c.model_dump()).aux.to_schema() == schema
    bad = contract_from_preset("deepseek-v3.2", num_layers=2).model_dump()
    bad["aux"]["row_bytes"] = 7
    with pytest.raises(ValidationError, match="offsets/sizes do not match"):
        RuntimeContract.model_validate(bad)


def test_contract_for_describes_any_models_pools() -> None:
    """An MHA/GQA model: k and v pools per layer, fp32; the presets are instances of the same builder."""
    k = PoolSpec("k", "float32", "float32", 2 * 8 * 4, 16, (0, 1, 2))
    v = PoolSpec("v", "float32", "float32", 2 * 8 * 4, 16, (0, 1, 2))
    aux = AuxSchema.standard(0, "bfloat16", 0)
    c = contract_for({"k": k, "v": v}, model="Qwen/Qwen2-0.5B", aux=aux, lane_rule="contiguous",
                     kernel={"attention_backend": "sdpa", "abi": "torch-paged"})
    assert [p.to_spec() for p in c.pools] == [k, v] and c.cp_rule == "contiguous"
    assert c.model.target_layers == 3 and c.model.revision == "unspecified" and c.speculative.algorithm == "none"
    assert contract_for([v, k], model="Qwen/Qwen2-0.5B", aux=aux, lane_rule="contiguous",
                        kernel={"attention_backend": "sdpa", "abi": "torch-paged"}).fingerprint() == c.fingerprint()
    for dtype, abi, size in (("bfloat16", "bfloat16", 2), ("float16", "float16", 2), ("fp8_e4m3", "uint8", 1)):
        pool = PoolSpec("kv", dtype, abi, 128 * size, 16, (0,))
        assert contract_for([pool], model="m", aux=aux).pool("kv").abi == abi
    with pytest.raises(ContractError, match="model.target_layers") as err:
        contract_for([k], model={"name": "m", "target_layers": 0}, aux=aux)
    assert err.value.field == "model.target_layers"
    with pytest.raises(ContractError, match="lane rule 'striped'"):
        contract_for([k], model="m", aux=aux, lane_rule="striped")
    with pytest.raises(ContractError, match="one page size"):
        contract_for([k, PoolSpec("v", "float32", "float32", 64, 8, (0,))], model="m", aux=aux)
    preset = contract_from_preset("deepseek-v3.2-fp8", num_layers=2, page_size=16)
    rebuilt = contract_for(preset_pools("deepseek-v3.2-fp8", num_layers=2, page_size=16), model=preset.model,
                           aux=preset.aux.to_schema(), kernel=preset.kernel, speculative=preset.speculative)
    assert rebuilt == preset
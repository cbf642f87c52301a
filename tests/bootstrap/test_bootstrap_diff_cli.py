"""diff_contracts (paths, matching by name, what-it-breaks sentences) and the
``kvbridge contract`` command (show / fingerprint / diff, exit codes, --help)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.bootstrap.contract import RuntimeContract, contract_from_preset, fingerprint
from kvbridge.bootstrap.diff import FieldDiff, breaks_for, diff_contracts
from kvbridge.cli.main import main


def _plain(c: RuntimeContract) -> dict:
    return c.model_dump(mode="json")


def test_equal_contracts_have_no_diff(small_contract: RuntimeContract) -> None:
    assert diff_contracts(small_contract, small_contract) == []


def test_index_layout_diff_names_path_values_and_consequence(small_contract: RuntimeContract) -> None:
    d = _plain(small_contract)
    next(p for p in d["pools"] if p["name"] == "index")["layout"] = "rows"
    (only,) = diff_contracts(small_contract, RuntimeContract.model_validate(d))
    assert only == FieldDiff(path="pools.index.layout", prefill="values_then_scales", decode="rows",
                             breaks="index-K pages would be read with the wrong in-page layout")
    assert "pools.index.layout" in only.render()


def test_pools_are_matched_by_name_not_position(small_contract: RuntimeContract) -> None:
    d = _plain(small_contract)
    d["pools"].reverse()
    assert diff_contracts(_plain(small_contract), d) == []  # plain dicts, positions differ
    d["pools"] = [p for p in d["pools"] if p["name"] != "index"]
    (missing,) = diff_contracts(_plain(small_contract), d)
    assert missing.path == "pools.index" and missing.decode is None and missing.prefill["layout"] == "values_then_scales"
    assert "one side only" in missing.breaks


def test_aux_regions_matched_by_name_and_order_reported(small_contract: RuntimeContract) -> None:
    d = _plain(small_contract)
    d["aux"]["regions"][0], d["aux"]["regions"][1] = d["aux"]["regions"][1], d["aux"]["regions"][0]
    paths = [x.path for x in diff_contracts(_plain(small_contract), d)]
    assert paths == ["aux.regions.(order)"]


def test_source_file_change_is_reported_per_file(small_contract: RuntimeContract) -> None:
    from kvbridge.bootstrap import digest

    d = _plain(small_contract)
    d["source"]["files"]["kvbridge/layout/pools.py"] = "f" * 64
    d["source"]["digest"] = digest.combine(d["source"]["files"])
    (only,) = diff_contracts(small_contract, RuntimeContract.model_validate(d))
    assert only.path == "source.files.kvbridge/layout/pools.py"
    assert "kvbridge/layout/pools.py" in only.breaks


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("wire_version", "wire protocol"),
        ("model.revision", "weights"),
        ("pools.target.bytes_per_token", "target KV"),
        ("pools.draft.layer_ids", "draft KV"),
        ("cp_rule", "CP owner rank"),
        ("kernel.abi", "attention backend"),
        ("speculative.topk", "top-k"),
        ("aux.row_bytes", "aux row"),
        ("topology.cp_size", "CP ranks"),
    ],
)
def test_every_section_has_a_sentence(path: str, words: str) -> None:
    assert words in breaks_for(path)


# -- CLI ---------------------------------------------------------------------------------


def test_contract_show_json_round_trips_through_fingerprint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["contract", "show", "--preset", "deepseek-v3.2-fp8", "--layers", "4", "--page-size", "32"]) == 0
    human = capsys.readouterr().out
    assert "pools" in human and "values_then_scales" in human
    shown_fp = human.split()[1]
    assert main(["contract", "show", "--preset", "deepseek-v3.2-fp8", "--layers", "4", "--page-size", "32", "--json"]) == 0
    path = tmp_path / "a.json"
    path.write_text(capsys.readouterr().out)
    assert main(["contract", "fingerprint", str(path)]) == 0
    printed = capsys.readouterr().out.strip()
    expected = fingerprint(contract_from_preset("deepseek-v3.2-fp8", num_layers=4, page_size=32))
    assert printed == shown_fp == expected


def test_contract_diff_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_plain(contract_from_preset("deepseek-v3.2", num_layers=2))))
    b.write_text(json.dumps(_plain(contract_from_preset("deepseek-v3.2", num_layers=2, page_size=32))))
    assert main(["contract", "diff", str(a), str(a)]) == 0
    assert "equal" in capsys.readouterr().out
    assert main(["contract", "diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "pools.index.page_size" in out and "prefill: 64" in out and "decode:  32" in out
    assert main(["contract", "diff", "--json", str(a), str(b)]) == 1
    listed = json.loads(capsys.readouterr().out)
    assert {d["path"] for d in listed} == {"pools.draft.page_size", "pools.index.page_size", "pools.target.page_size"}
    assert main(["contract", "diff", str(a), str(tmp_path / "nope.json")]) == 2
    (tmp_path / "bad.json").write_text('{"wire_version": 1}')
    assert main(["contract", "fingerprint", str(tmp_path / "bad.json")]) == 2
    assert "not a runtime contract" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["contract"], ["contract", "show"], ["contract", "fingerprint"], ["contract", "diff"], ["bootstrap"]])
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    assert "usage: kvbridge" in capsys.readouterr().out


def test_console_entry_point_runs_in_a_fresh_process(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli.main", "contract", "show", "--layers", "2", "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    path = tmp_path / "c.json"
    path.write_text(out.stdout)
    fp = subprocess.run([sys.executable, "-m", "kvbridge.cli.main", "contract", "fingerprint", "-"], input=out.stdout,
                        capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert fp == fingerprint(RuntimeContract.model_validate_json(path.read_text()))

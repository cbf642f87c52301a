"""The weights identity (``bootstrap/weights.py``) and its place in the runtime contract:
another checkpoint of the same shapes under the same name differs in ``model.weights``, named
by the diff; a contract without it keeps the encoding (and fingerprint) it had."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvbridge import ConfigError, contract_for, diff_contracts, fingerprint, preset_pools, weights_digest
from kvbridge.layout import AuxSchema


def _safetensors(path: Path, seed: int, *, shape=(256, 512), name="w") -> None:
    """A real safetensors file (header + float32 data), written by hand."""
    data = np.random.default_rng(seed).standard_normal(shape).astype("<f4").tobytes()
    header = json.dumps({name: {"dtype": "F32", "shape": list(shape), "data_offsets": [0, len(data)]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def _checkpoint(root: Path, seed: int, **kw) -> Path:
    root.mkdir()
    for i in range(2):
        _safetensors(root / f"model-0000{i}.safetensors", seed + i, **kw)
    (root / "config.json").write_text("{}")
    return root


def test_the_digest_names_the_checkpoint_not_the_folder(tmp_path):
    a = weights_digest(_checkpoint(tmp_path / "a", 1))
    assert a.startswith("wd1:") and weights_digest(_checkpoint(tmp_path / "a-copy", 1)) == a  # same bytes elsewhere
    assert weights_digest(_checkpoint(tmp_path / "retrained", 7)) != a  # same shapes, other weights
    assert weights_digest(_checkpoint(tmp_path / "renamed", 1, name="v")) != a  # other tensor names
    one = tmp_path / "a" / "model-00001.safetensors"
    blob = bytearray(one.read_bytes())
    blob[-1] ^= 0xFF  # the last sample covers the end of the file
    one.write_bytes(bytes(blob))
    assert weights_digest(tmp_path / "a") != a
    assert weights_digest(tmp_path / "a", full=True) != weights_digest(tmp_path / "a")


def test_a_folder_without_weights_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="holds no weight files") as e:
        weights_digest(tmp_path)
    assert e.value.field == "model.weights"
    bad = tmp_path / "x.safetensors"
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ConfigError, match="safetensors header"):
        weights_digest(tmp_path)


def test_other_weights_under_one_name_differ_in_model_weights(tmp_path):
    pools, aux = preset_pools("deepseek-v3", num_layers=2, page_size=4, draft_layers=0), AuxSchema.standard(hidden_size=0)
    plain = contract_for(pools, model={"name": "m", "target_layers": 2}, aux=aux)
    with_a = contract_for(pools, model={"name": "m", "target_layers": 2, "weights": "wd1:aa"}, aux=aux)
    with_b = contract_for(pools, model={"name": "m", "target_layers": 2, "weights": "wd1:bb"}, aux=aux)
    assert b'"weights"' not in plain.canonical() and b'"weights":"wd1:aa"' in with_a.canonical()
    assert fingerprint(plain) == fingerprint(plain.model_dump()) and fingerprint(with_a) != fingerprint(with_b)
    [d] = diff_contracts(with_a, with_b)
    assert d.path == "model.weights" and "another checkpoint" in d.breaks

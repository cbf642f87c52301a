"""Tiny models (built locally, cached by config hash, deterministic), local
directories, pool geometry per model and dtype, and the import rules."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kvbridge as kvb
from kvbridge.integrations.transformers import (
    PagedKV,
    cache_geometry,
    load_model,
    model_identity,
    model_pools,
    tiny_model_dir,
)
from kvbridge.layout import describe_buffer


def test_import_kvbridge_and_the_integration_leave_transformers_unloaded():
    code = (
        "import sys, kvbridge, kvbridge.integrations.transformers as t; "
        "assert 'transformers' not in sys.modules, 'transformers imported eagerly'; "
        "import kvbridge.integrations.transformers.models; assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_tiny_models_are_deterministic_and_cached(tmp_path, tiny, model_cache):
    for name in ("tiny-qwen2", "tiny-deepseek-v3"):
        again = load_model(name, cache_dir=tmp_path)  # a second, independent build
        assert again.digest == tiny(name).digest
        folder = tiny_model_dir(name, tmp_path)
        stamp = (folder / "model.safetensors").stat().st_mtime_ns
        assert tiny_model_dir(name, tmp_path) == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp
        assert sum(f.stat().st_size for f in folder.iterdir()) < 4 << 20
        weights = {**dict(again.model.state_dict()), **(dict(again.draft.state_dict()) if again.draft else {})}
        assert all(bool(w.isfinite().all()) for w in weights.values())
    assert tiny("tiny-deepseek-v3").draft is not None and tiny("tiny-qwen2").draft is None


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    from kvbridge.integrations.transformers import cache_root

    monkeypatch.setenv("KVBRIDGE_CACHE", str(tmp_path))
    assert cache_root() == tmp_path / "models"
    assert cache_root(tmp_path / "x") == tmp_path / "x"


def test_a_local_directory_loads_and_a_missing_one_is_refused(tiny, model_cache, tmp_path):
    folder = tiny_model_dir("tiny-deepseek-v3", model_cache)
    lm = load_model(str(folder))
    assert lm.digest == tiny("tiny-deepseek-v3").digest and lm.draft is not None
    assert model_identity(lm) == {"name": folder.name, "revision": lm.digest, "target_layers": 2, "draft_layers": 1}
    with pytest.raises(kvb.ConfigError, match="nothing is downloaded") as err:
        load_model(str(tmp_path / "Qwen2-0.5B"))
    assert err.value.field == "model"
    with pytest.raises(kvb.ConfigError, match="dtype"):
        load_model("tiny-qwen2", dtype="float64", cache_dir=model_cache)


@pytest.mark.parametrize("dtype,itemsize", [("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_pools_follow_the_model_and_its_dtype(tiny, dtype, itemsize):
    qwen, ds = tiny("tiny-qwen2").model, tiny("tiny-deepseek-v3").model
    k = model_pools(qwen, 16, dtype=dtype)
    assert set(k) == {"k", "v"} and k["k"].layer_ids == (0, 1) and k["k"].abi == dtype
    assert k["k"].bytes_per_token == 2 * 16 * itemsize  # 2 KV heads of 16, head-major
    assert model_pools(qwen, 16, 2, 1, dtype=dtype)["v"].bytes_per_token == 16 * itemsize
    assert model_pools(qwen, 16, 4, 3, dtype=dtype)["v"].bytes_per_token == 16 * itemsize  # replicated head 1
    mla = model_pools(ds, 16, dtype=dtype)
    assert set(mla) == {"target", "draft"} and mla["draft"].layer_ids == (2,)
    assert mla["target"].bytes_per_token == (32 + 16) * itemsize
    assert mla["target"].kernel_abi == "transformers/mla-normed-latent+rope-deinterleaved"
    assert model_pools(ds, 16, 8, 5, dtype=dtype) == mla  # MLA rows are replicated across TP
    assert set(model_pools(ds, 16, draft=False)) == {"target"}


def test_geometry_refuses_what_it_cannot_page(tiny):
    with pytest.raises(kvb.TopologyError):
        model_pools(tiny("tiny-qwen2").model, 16, tp_size=3)
    from transformers import Qwen2Config

    sliding = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(kvb.ConfigError, match="sliding_attention") as err:
        cache_geometry(sliding)
    assert err.value.field == "layer_types"


def test_paged_buffers_are_page_major_and_registrable(tiny):
    specs = model_pools(tiny("tiny-deepseek-v3").model, 4)
    paged = PagedKV(specs, capacity_pages=6, fill=0x55)
    bufs = paged.buffers()
    assert sorted(bufs) == [("draft", 2), ("target", 0), ("target", 1)]
    for (pool, lid), buf in bufs.items():
        desc = describe_buffer(specs[pool], lid, buf)
        assert desc.capacity_pages == 6 and desc.bytes_per_page == 4 * 48 * 4
        assert bool((buf.view(torch.uint8) == 0x55).all())
    # one storage per pool: layer l's buffer follows layer l-1's
    assert bufs[("target", 1)].data_ptr() - bufs[("target", 0)].data_ptr() == 6 * 4 * 48 * 4
    with pytest.raises(kvb.PageRangeError):
        paged.write("target", torch.zeros(2, 1, 48), torch.tensor([24]))

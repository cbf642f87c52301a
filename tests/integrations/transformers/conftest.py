"""Tiny models for model-mode tests, built once per session into a private
cache directory (never ~/.cache, never a hub)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="model mode needs the 'model' extra (transformers)")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("kvbridge-models")


@pytest.fixture(scope="session")
def tiny(model_cache):
    from kvbridge.integrations.transformers import load_model

    loaded: dict[str, object] = {}

    def get(name: str, dtype: str = "float32"):
        if (name, dtype) not in loaded:
            loaded[(name, dtype)] = load_model(name, dtype=dtype, cache_dir=model_cache)
        return loaded[(name, dtype)]

    return get


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny matrices on a shared 2-core machine: one intra-op thread is several
    times faster than two fighting other processes for the cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

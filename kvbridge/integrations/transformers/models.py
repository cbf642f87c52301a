"""Models for model mode: tiny random-weight models built locally, or a local
Hugging Face directory. Nothing is ever downloaded.

    tiny-qwen2         Qwen2 GQA: 2 layers, 4 query heads, 2 KV heads of 16
    tiny-deepseek-v3   DeepSeek-V3 MLA: 2 layers (1 dense, 1 MoE), kv_lora_rank 32,
                       rope 16, one NextN/MTP layer (transformers' ``MtpModel``)
    PATH               a local HF directory (``from_pretrained(..., local_files_only=True)``);
                       a draft only where the directory holds ``mtp.safetensors``

A tiny model is built once from its config with a fixed seed (float32 weights,
a few hundred KB) and kept under the cache directory (``$KVBRIDGE_CACHE/models``,
default ``~/.cache/kvbridge/models``) in a folder named by the hash of
(config, seed, builder version, transformers version): every process that asks
for it loads the same bytes, and the weights digest names them in the contract.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import kvbridge as kvb

# model mode's settings table (kvbridge.SettingsReader; kvbridge/integrations/README.md)
KEYS = {"cache": ("KVBRIDGE_CACHE", "where tiny models are built and kept (<cache>/models; default ~/.cache/kvbridge)")}
SEED = 0
BUILDER_VERSION = 2
MTP_FILE = "mtp.safetensors"

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": {
        "model_type": "qwen2",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "initializer_range": 0.2,
    },
    "tiny-deepseek-v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 512,
        "initializer_range": 0.2,
    },
}
TINY_MODELS = tuple(TINY_CONFIGS)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A causal LM ready for model mode: ``model`` (eval mode) and, for a
    DeepSeek-V3 with a NextN layer, ``draft`` (transformers' ``MtpModel``)."""

    name: str
    path: Path
    model: Any
    draft: Any | None
    digest: str

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def cache_root(cache_dir: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Path:
    """Where tiny models live: ``cache_dir``, else ``$KVBRIDGE_CACHE/models``,
    else ``~/.cache/kvbridge/models`` (``KEYS``, read with ``kvbridge.SettingsReader``)."""
    if cache_dir is not None:
        return Path(cache_dir)
    root = kvb.SettingsReader(KEYS, None, env, where="environment").text("cache")
    return Path(root) / "models" if root else Path.home() / ".cache" / "kvbridge" / "models"


def tiny_key(name: str) -> str:
    """Hash naming a tiny model's folder: config, seed, builder and transformers versions."""
    import transformers

    if name not in TINY_CONFIGS:
        raise kvb.ConfigError(f"unknown tiny model {name!r}; tiny models are {', '.join(TINY_MODELS)}", field="model")
    key = {"config": TINY_CONFIGS[name], "seed": SEED, "builder": BUILDER_VERSION, "hf": transformers.__version__}
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tiny_model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder of tiny model ``name``, built on first use. Concurrent
    builders each write a private folder and rename it into place; the first wins."""
    path = cache_root(cache_dir) / f"{name}-{tiny_key(name)}"
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=path.parent))
    try:
        _build_tiny(name, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any other
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _build_tiny(name: str, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_CONFIGS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with _quiet_progress():
        model.save_pretrained(out)
    if _num_draft_layers(config):
        from safetensors.torch import save_file
        from transformers.modeling_layers import MtpModel

        draft = MtpModel(model, _num_draft_layers(config))
        # MtpModel's generic init leaves DeepSeek's experts and router as torch.empty (a real checkpoint
        # brings them): initialise the draft layers with the main model's own scheme
        for module in draft.layers.modules():
            model._init_weights(module)
        weights = _own_draft_weights(draft)
        bad = [k for k, v in weights.items() if not bool(v.isfinite().all())]
        if bad:
            raise kvb.ConfigError(f"tiny model {name!r}: draft weights {bad[:3]} are not finite", field="model")
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / MTP_FILE))


def _num_draft_layers(config: Any) -> int:
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def _own_draft_weights(draft: Any) -> dict[str, torch.Tensor]:
    """The MTP layers' own weights; embedding, head and rotary are the main model's."""
    return {k: v for k, v in draft.state_dict().items() if k.startswith("layers.")}


def load_model(
    name_or_path: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load ``tiny-qwen2`` / ``tiny-deepseek-v3`` (built on first use) or a
    local HF directory, in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    if name_or_path in TINY_CONFIGS:
        path, name = tiny_model_dir(name_or_path, cache_dir), name_or_path
    else:
        path = Path(name_or_path)
        if not (path / "config.json").is_file():
            raise kvb.ConfigError(
                f"model {name_or_path!r} is neither a tiny model ({', '.join(TINY_MODELS)}) nor a local "
                "Hugging Face directory with a config.json (nothing is downloaded)",
                field="model",
            )
        name = path.name
    torch_dtype = _torch_dtype(dtype)
    with _quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    model = model.to(device).eval()
    draft = None
    if _num_draft_layers(model.config) and (path / MTP_FILE).is_file():
        from safetensors.torch import load_file
        from transformers.modeling_layers import MtpModel

        draft = MtpModel(model, _num_draft_layers(model.config))
        weights = load_file(str(path / MTP_FILE))
        missing = set(_own_draft_weights(draft)) - set(weights)
        if missing:
            raise kvb.ConfigError(f"{path / MTP_FILE} lacks draft weights {sorted(missing)[:3]}", field="model")
        draft.load_state_dict(weights, strict=False)
        draft = draft.to(device=device, dtype=torch_dtype).eval()
    return LoadedModel(name=name, path=path, model=model, draft=draft, digest=weights_digest(path))


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers draws a progress bar per load and save; workers and tests want quiet logs."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _torch_dtype(dtype: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise kvb.ConfigError(f"model dtype {dtype!r} is not one of {tuple(table)}", field="dtype")
    return table[dtype]


FULL_DIGEST_BYTES = 64 << 20


def weights_digest(path: Path) -> str:
    """sha256 over config.json and every safetensors file: whole files up to
    64 MiB (tiny models), else name, size and header (tensor names, shapes,
    dtypes and offsets) so that a large checkpoint is not read end to end."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            if size <= FULL_DIGEST_BYTES:
                h.update(fh.read())
            else:
                h.update(fh.read(min(int.from_bytes(fh.read(8), "little"), FULL_DIGEST_BYTES)))
    return h.hexdigest()


def model_identity(lm: LoadedModel) -> dict[str, Any]:
    """The contract's model section: name, weights digest, target and draft layers."""
    return {
        "name": lm.name,
        "revision": lm.digest,
        "target_layers": int(lm.config.num_hidden_layers),
        "draft_layers": len(lm.draft.layers) if lm.draft is not None else 0,
    }

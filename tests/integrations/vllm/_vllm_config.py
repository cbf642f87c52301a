"""vLLM's real config objects for the connector tests, built offline: a tiny model's
``config.json`` (no weights, no tokenizer), ``VllmConfig`` from the JSON a user types
after ``--kv-transfer-config``, and ``KVCacheConfig`` from vLLM's own
``get_kv_cache_configs`` over the model's attention specs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GQA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
           num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, head_dim=64, vocab_size=512,
           max_position_embeddings=4096, torch_dtype="bfloat16", rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
# DeepSeek V3-shaped MLA (kv_lora_rank 512 + rope 64 = the 576-wide latent), 2 layers
MLA = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=256, intermediate_size=512,
           moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
           kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2, vocab_size=512,
           max_position_embeddings=4096, torch_dtype="bfloat16", rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
           rope_theta=10000.0)  # fmt: skip


def model_dir(root: Path, kind: str = "gqa", **overrides: Any) -> str:
    d = root / f"model-{kind}-{abs(hash(json.dumps(overrides, sort_keys=True))) % 10**8}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**(GQA if kind == "gqa" else MLA), **overrides}))
    return str(d)


def transfer_json(role: str, extra: dict[str, Any], connector: str = "KVBridgeConnector") -> str:
    """The ``--kv-transfer-config`` a user types (docs/vllm.md)."""
    return json.dumps({"kv_connector": connector, "kv_connector_module_path": "kvbridge.integrations.vllm",
                       "kv_role": role, "kv_connector_extra_config": extra})


def vllm_config(model: str, role: str, extra: dict[str, Any], *, block_size: int = 16, tp: int = 1,
                dtype: str = "bfloat16", max_batched: int = 64, engine_id: str | None = None,
                layout: str = "LBNHC", window: int = 0, mamba: bool = False) -> Any:
    """``window``: a gpt-oss-like hybrid (even layers a sliding window of ``window`` tokens, odd
    layers full attention) served with ``KVBridgeHMAConnector`` and vLLM's hybrid manager on;
    ``mamba``: a Mamba2 hybrid (even layers Mamba2 state, ``MAMBA_SHAPES``) the same way."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    connector = "KVBridgeHMAConnector" if window or mamba else "KVBridgeConnector"
    kv = KVTransferConfig(**json.loads(transfer_json(role, extra, connector)),
                          **({"engine_id": engine_id} if engine_id else {}))
    mc = ModelConfig(model=model, tokenizer=None, skip_tokenizer_init=True, dtype=dtype, max_model_len=512)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched, max_model_len=512,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
                    scheduler_config=sc, kv_transfer_config=kv, device_config=DeviceConfig("cpu"),
                    parallel_config=ParallelConfig(tensor_parallel_size=tp))
    vc.cache_config.kv_cache_layout = layout  # what the engine core resolves before profiling
    vc.hybrid_window = window  # (the test's own notes: attention_specs reads them)
    vc.hybrid_mamba = mamba
    if mamba:  # Mamba prefix caching is mamba_cache_mode "align", which kvbridge refuses: off, as vLLM has it
        vc.cache_config.enable_prefix_caching = False
    if window or mamba:  # vLLM's CPU platform turns the hybrid manager off for served models; its classes run with it on
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    return vc


MAMBA_SHAPES = ((96, 3), (4, 8, 16))  # Mamba2 conv (x+B+C channels, kernel - 1) bf16; SSM (heads, dim, state) fp32


def kv_cache_config(vc: Any, num_blocks: int) -> Any:
    """vLLM's KVCacheConfig for the model's attention layers (one rank's shard of the heads)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    specs = attention_specs(vc)
    page = next(iter(specs.values())).page_size_bytes
    (cfg,) = get_kv_cache_configs(vc, [specs], [page * len(specs) * num_blocks])
    vc.cache_config.num_gpu_blocks = cfg.num_blocks  # what the engine core sets after profiling
    return cfg


def attention_specs(vc: Any) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    mc, tp = vc.model_config, vc.parallel_config.tensor_parallel_size
    layers = mc.hf_config.num_hidden_layers
    dtype = getattr(torch, "bfloat16" if mc.dtype == torch.bfloat16 else str(mc.dtype).removeprefix("torch."))
    bs = vc.cache_config.block_size
    if mc.use_mla:
        head = mc.hf_config.kv_lora_rank + mc.hf_config.qk_rope_head_dim
        return {f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=head,
                                                                      dtype=dtype) for i in range(layers)}
    heads = max(1, mc.get_total_num_kv_heads() // tp)
    window = getattr(vc, "hybrid_window", 0)
    if getattr(vc, "hybrid_mamba", False):  # vLLM's Mamba state block covers the model's length (cache mode none)
        from vllm.v1.kv_cache_interface import MambaSpec

        full = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=mc.get_head_size(), dtype=dtype)
        mamba = MambaSpec(block_size=mc.max_model_len, shapes=MAMBA_SHAPES, dtypes=(torch.bfloat16, torch.float32),
                          page_size_padded=full.page_size_bytes)
        return {f"model.layers.{i}.mixer" if i % 2 == 0 else f"model.layers.{i}.self_attn.attn":
                mamba if i % 2 == 0 else full for i in range(layers)}
    if window:
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        geo = dict(block_size=bs, num_kv_heads=heads, head_size=mc.get_head_size(), dtype=dtype)
        return {f"model.layers.{i}.self_attn.attn": SlidingWindowSpec(**geo, sliding_window=window) if i % 2 == 0
                else FullAttentionSpec(**geo) for i in range(layers)}
    return {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size=bs, num_kv_heads=heads,
                                                                   head_size=mc.get_head_size(), dtype=dtype)
            for i in range(layers)}

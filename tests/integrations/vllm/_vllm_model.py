"""Tiny random-weight models that ``vllm serve`` loads offline, built in the test.

A model folder is what a hub download would leave: ``config.json``, ``model.safetensors`` and a
tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), all made here, no network. The
tokenizer is a word-level one over ``w0 .. w{n}`` (space separated), so a prompt is text a user
could type and its token count is the word count plus the BOS token.

vLLM's CPU attention kernel wants head_dim 64 (not 16), so the GQA model has 4 query heads of
64 over 2 KV heads; weights are drawn with a wider spread than transformers' default so that
greedy decoding depends on the context (a transfer that delivered the wrong KV would change the
tokens, which is what the end-to-end test compares).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 512
SPECIALS = ("<unk>", "<s>", "</s>")

LLAMA_GQA: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.2,
}  # fmt: skip
# DeepSeek-V3-shaped MLA: V3's 576-wide latent (kv_lora_rank 512 + rope 64: the only latent width vLLM's MLA
# backends take), fewer and narrower heads, dense layers only.
DEEPSEEK_MLA: dict[str, Any] = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": VOCAB,
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
    "first_k_dense_replace": 2, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 1, "topk_group": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.2,
}  # fmt: skip


def words(ids: list[int]) -> str:
    """The prompt text whose tokens (after BOS) are ``ids``."""
    return " ".join(f"w{i - len(SPECIALS)}" for i in ids)


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(VOCAB - len(SPECIALS))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=1024)  # fmt: skip
    fast.save_pretrained(out)


def build_model(out: Path, spec: dict[str, Any], seed: int = 0) -> Path:
    """Writes a random-weight model of ``spec`` (bf16 weights) and the tokenizer to ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(out)
    build_tokenizer(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out

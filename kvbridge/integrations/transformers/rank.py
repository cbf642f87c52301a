"""One model-mode rank: the model, the pools it caches into (this TP rank's heads),
their paged buffers, the runtime contract and the aux row, in one object a worker
(or an engine of one's own) holds.

The contract is built with ``kvbridge.contract_for`` from the model's own pools:
model name and weights digest, one pool per cache tensor family (GQA ``k``/``v``
head-sharded across TP, MLA ``target`` + ``draft`` replicated), the kernel field
naming the transformers version and attention implementation whose cache layout
the bytes follow, NextN speculation when the model has a draft layer, and this
package's ``geometry.py`` and ``paged.py`` in the source digest.

The aux row is ``kvbridge.AuxSchema.standard``: the first generated token, the
cached-token count, the last hidden state (the model's dtype) and, with a draft,
the draft's top-1 guess for the token after the first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvbridge as kvb
from kvbridge.integrations.transformers.geometry import cache_geometry, pools_of
from kvbridge.integrations.transformers.models import LoadedModel, load_model, model_identity
from kvbridge.integrations.transformers.paged import PagedKV
from kvbridge.integrations.transformers.runner import Prefilled

HERE = Path(__file__).parent
SOURCES = {f"kvbridge/integrations/transformers/{name}": HERE / name for name in ("geometry.py", "paged.py")}


def model_aux_schema(lm: LoadedModel) -> kvb.AuxSchema:
    """The standard aux row for this model: hidden state in the model's dtype, top-1 draft guess."""
    dtype = str(lm.model.dtype).removeprefix("torch.")
    if dtype not in ("float32", "bfloat16"):
        raise kvb.ConfigError(f"model mode carries the hidden state as float32 or bfloat16, not {dtype}", field="dtype")
    return kvb.AuxSchema.standard(int(lm.config.hidden_size), dtype, 1 if lm.draft is not None else 0)


def model_contract(lm: LoadedModel, specs: dict[str, kvb.PoolSpec], aux: kvb.AuxSchema, *,
                   lane_rule: str = "interleaved") -> kvb.RuntimeContract:
    """The runtime contract of ``lm``'s cache as ``specs`` (any TP rank's: head-sharded pools
    enter as their whole row)."""
    import transformers

    hidden = aux.region("hidden")
    speculative = {"algorithm": "nextn" if lm.draft is not None else "none", "hidden_size": hidden.count,
                   "hidden_dtype": hidden.dtype, "topk": aux.region("topk_ids").count}
    attn = str(getattr(lm.config, "_attn_implementation", None) or "eager")
    kernel = {"attention_backend": f"transformers-{attn}", "abi": f"transformers=={transformers.__version__}"}
    return kvb.contract_for(specs, model=model_identity(lm), aux=aux, lane_rule=lane_rule, kernel=kernel,
                            speculative=speculative, extra_sources=SOURCES)


def aux_values(lm: LoadedModel, pre: Prefilled) -> dict[str, Any]:
    """The aux row of a prefilled request (``KVSender.send(aux=...)``): first token, token
    count, last hidden state as stored (bf16 bits or float32), the draft's top-1."""
    hidden = pre.hidden.detach().cpu()
    stored = hidden.view(torch.int16).numpy().view(np.uint16) if hidden.dtype == torch.bfloat16 else hidden.numpy()
    ids, probs = np.zeros(0, np.int32), np.zeros(0, np.float32)
    if lm.draft is not None and pre.draft_logits is not None:
        p = torch.softmax(pre.draft_logits.detach().float().cpu(), dim=-1)
        top = int(p.argmax())
        ids, probs = np.array([top], np.int32), np.array([float(p[top])], np.float32)
    return dict(first_token=pre.first_token, num_cached_tokens=pre.num_tokens, hidden_is_cp_local=True,
                hidden=stored.copy(), topk_ids=ids, topk_probs=probs)


class ModelRank:
    """What one model-mode rank owns: ``lm``, ``geom`` (this TP rank's heads), ``specs``,
    ``contract``, ``aux_schema`` and ``paged`` (``capacity_pages`` pages per buffer,
    every byte ``fill`` at first) on ``device``."""

    def __init__(
        self,
        model: str,
        *,
        page_size: int,
        capacity_pages: int,
        fill: int,
        tp_size: int = 1,
        tp_rank: int = 0,
        lane_rule: str = "interleaved",
        dtype: str = "float32",
        device: str = "cpu",
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.lm = load_model(model, dtype=dtype, device=device, cache_dir=cache_dir)
        self.geom = cache_geometry(self.lm.model, tp_size=tp_size, tp_rank=tp_rank)
        self.specs = pools_of(self.geom, page_size, draft=self.lm.draft is not None)
        self.aux_schema = model_aux_schema(self.lm)
        self.contract = model_contract(self.lm, self.specs, self.aux_schema, lane_rule=lane_rule)
        self.paged = PagedKV(self.specs, capacity_pages, device=device, fill=fill)
        self.page_size = page_size

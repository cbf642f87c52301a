"""Model mode's pools for a worker (``--model``): the specs, contract and aux schema of
a ``kvbridge.integrations.transformers.ModelRank`` (the model's own cache, this TP
rank's heads) instead of a preset, and its paged buffers instead of zeroed ones."""

from __future__ import annotations

from typing import Any

import torch

from kvbridge.transfer.engine.registry import engine_entry


class ModelPools:
    """Mixed into a worker before its role class (``ModelPools, PrefillWorker``)."""

    pool_fill = 0  # every byte of a fresh pool: prefill SRC_STALE, decode DST_POISON
    cfg: Any
    model_rank: Any = None
    aux_device: str

    def build_geometry(self) -> tuple[dict, Any, Any]:
        from kvbridge.integrations.transformers import ModelRank

        cfg = self.cfg
        torch.set_num_threads(cfg.threads)  # bit-equal logits: the same count on both sides
        self.model_rank = ModelRank(cfg.model, page_size=cfg.page_size, capacity_pages=cfg.pages, fill=self.pool_fill,
                                    tp_size=cfg.tp_size, tp_rank=cfg.tp_rank, lane_rule=cfg.lane_rule,
                                    dtype=cfg.model_dtype, device=cfg.model_device)
        return self.model_rank.specs, self.model_rank.contract, self.model_rank.aux_schema

    def allocate_buffers(self) -> dict:
        reaches_gpu = engine_entry(self.cfg.engine).kind in ("same-host", "composite")  # CUDA IPC: ipc, auto
        if (self.cfg.protocol == "rdma" or reaches_gpu) and self.cfg.model_device.startswith("cuda"):
            # NVLink and CUDA IPC move device memory only (auto would send host rows over Mooncake): aux rows there too
            self.aux_device = self.cfg.model_device
        return self.model_rank.paged.buffers()

"""``kvbridge decode-worker --model M``: a decode rank that rebuilds a transformers
model's cache from the pages it received and generates.

A Decode(room, num_tokens, prefill_instance, max_new_tokens) op:

    pages for every logical page in random order, each checked to hold the poison
    (DST_POISON) before use; an aux slot; KVReceiver(room) -> init(pages, slot, num_tokens)
    Success -> this rank's rows of the room (its KV heads) -> EXCHANGE/<room>.tp<j>.pt,
               with the check that every byte past the valid rows still holds the poison
    TP rank 0: once every rank's rows are there (MLA: its own are whole), the whole rows,
               the model's cache rebuilt from them, greedy decode from the aux row's first
               token -> EXCHANGE/<room>.out.pt (tokens, logits, draft logits, aux row)
    the room's pages are refilled with the poison and freed; reply RoomResult

The exchange directory (``--exchange-dir``, shared memory on one host) stands in for
TP attention: real decode TP ranks would each attend over their own heads and
all-reduce; here rank 0 gathers the head slices and runs the whole model. The files
stay until their reader (``kvbridge demo``) removes them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbridge.errors import ConfigError
from kvbridge.integrations.transformers.paged import DST_POISON
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker import ops
from kvbridge.worker.model_pools import ModelPools
from kvbridge.worker.decode import DecodeTask, DecodeWorker


@dataclass
class ModelDecodeTask(DecodeTask):
    max_new_tokens: int = 0
    problems: list[str] = field(default_factory=list)
    received: bool = False


def rows_path(exchange: Path, room: int, tp_rank: int) -> Path:
    return exchange / f"{room}.tp{tp_rank}.pt"


def out_path(exchange: Path, room: int) -> Path:
    return exchange / f"{room}.out.pt"


def save_atomic(obj: Any, path: Path) -> None:
    """Readers never see half a file: write aside, then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class ModelDecodeWorker(ModelPools, DecodeWorker):
    pool_fill = DST_POISON

    def __init__(self, cfg: Any, engine_factory: Any = None) -> None:
        super().__init__(cfg, engine_factory)
        self.exchange = Path(cfg.exchange_dir or f"/dev/shm/kvbridge-{cfg.instance}")
        self.exchange.mkdir(parents=True, exist_ok=True)
        self.rng = np.random.default_rng(1000 + cfg.tp_rank)

    def begin(self, peer: bytes, request_id: int, op: ops.Decode) -> ModelDecodeTask:
        if op.max_new_tokens < 0:
            raise ConfigError(f"room {op.room}: max_new_tokens must be >= 0", room=op.room, rank=self.cfg.rank_name,
                              field="max_new_tokens")
        num_pages = -(-op.num_tokens // self.cfg.page_size)
        pages = self.rng.permutation(self.pages.allocate(op.room, num_pages)).astype(np.int64)
        task = ModelDecodeTask(op.room, op.num_tokens, peer, request_id, page_ids=pages,
                               max_new_tokens=op.max_new_tokens)
        dirty = self.model_rank.paged.first_unfilled(pages, DST_POISON)  # a stray write into a free page shows here
        if dirty:
            task.problems.append(f"before room {op.room} took its pages: {dirty}")
        try:
            task.aux_slot = int(self.aux_slots.allocate(op.room, 1)[0])
            self.aux_buffer[task.aux_slot] = 0
            task.receiver = self.endpoint.receiver(op.room, op.prefill_instance, op.prefill_dp_rank)
        except BaseException:
            self._free(op.room)
            raise
        return task

    def advance(self, task: ModelDecodeTask) -> ops.RoomResult | None:
        state = task.receiver.poll()
        if state == KVPoll.WaitingForInput and not task.initialised and not task.aborting:
            task.mark("bootstrapped")
            task.receiver.init(task.page_ids, task.aux_slot, task.num_tokens)
            task.initialised = True
        elif state == KVPoll.Success:
            if not task.received:
                task.mark("committed")
                self._store_rows(task)
                task.received = True
            if self.cfg.tp_rank != 0:
                return self._done(task)
            rows = self._gather(task)
            if rows is None:
                return None  # the other TP ranks' head slices are not all there yet
            task.mark("gathered")
            self._generate(task, rows)
            return self._done(task)
        elif state == KVPoll.Failed:
            task.mark("failed")
            return self._failed(task)
        return None

    def _store_rows(self, task: ModelDecodeTask) -> None:
        """This rank's rows of the room and the poison check past the valid rows."""
        from kvbridge.integrations.transformers import read_rows

        rank = self.model_rank
        rows = {k: v.cpu() for k, v in read_rows([rank.geom], [rank.paged], task.page_ids, task.num_tokens).items()}
        tail = rank.paged.first_unfilled(task.page_ids, DST_POISON, tokens=task.num_tokens)
        if tail:
            task.problems.append(f"room {task.room}: {tail}")
        save_atomic({"rows": rows, "problems": list(task.problems), "tp_rank": self.cfg.tp_rank},
                    rows_path(self.exchange, task.room, self.cfg.tp_rank))

    def _gather(self, task: ModelDecodeTask) -> dict[str, torch.Tensor] | None:
        """Whole rows: this rank's, or with head-sharded pools every decode TP rank's, merged."""
        from kvbridge.integrations.transformers import cache_geometry, merge_head_rows

        rank = self.model_rank
        if rank.geom.kind != "gqa" or self.cfg.tp_size == 1:
            return torch.load(rows_path(self.exchange, task.room, 0))["rows"]
        paths = [rows_path(self.exchange, task.room, j) for j in range(self.cfg.tp_size)]
        if not all(p.exists() for p in paths):
            return None
        parts = [torch.load(p)["rows"] for p in paths]
        geoms = [cache_geometry(rank.lm.model, tp_size=self.cfg.tp_size, tp_rank=j) for j in range(self.cfg.tp_size)]
        return {pool: merge_head_rows(geoms, [p[pool] for p in parts]) for pool in parts[0]}

    def _generate(self, task: ModelDecodeTask, rows: dict[str, torch.Tensor]) -> None:
        from kvbridge.integrations.transformers import cache_geometry, decode, rebuild_caches

        lm = self.model_rank.lm
        aux = task.receiver.aux
        cache, draft_cache = rebuild_caches(lm, cache_geometry(lm.model), rows)
        out = decode(lm, cache, draft_cache, aux.first_token, task.num_tokens, task.max_new_tokens)
        task.mark("decoded")
        save_atomic({"tokens": out.tokens, "logits": out.logits.cpu(),
                     "draft_logits": None if out.draft_logits is None else out.draft_logits.cpu(),
                     "aux": {"first_token": aux.first_token, "num_cached_tokens": aux.num_cached_tokens,
                             "hidden": np.asarray(aux.hidden).copy(), "topk_ids": np.asarray(aux.topk_ids).copy(),
                             "topk_probs": np.asarray(aux.topk_probs).copy()}},
                    out_path(self.exchange, task.room))

    def _done(self, task: ModelDecodeTask) -> ops.RoomResult:
        stats = dict(task.receiver.stats or {})
        self._free(task.room)
        reason = "; ".join(task.problems[:3])
        return ops.RoomResult(room=task.room, ok=not task.problems, reason=reason, rank=self.cfg.rank_name,
                              num_bytes=int(stats.get("bytes", 0)), timings=dict(task.marks))

    def _free(self, room: int) -> None:
        self.model_rank.paged.fill_pages(self.pages.pages_of(room), DST_POISON)  # poisoned again before reuse
        super()._free(room)

    def housekeeping(self) -> None:
        for room, receiver in list(self.held.items()):  # a failed room's pages, once no write can reach them
            if receiver.pages_releasable:
                self.model_rank.paged.fill_pages(self.pages.held_pages(room), DST_POISON)
        super().housekeeping()

"""``kvbridge prefill-worker --model M``: a prefill rank that runs a transformers model.

Prefill(room, num_tokens, chunk_tokens, prompt, batch_id, batch_size) ops with the
same batch id gather until ``batch_size`` of them arrived; then the batch runs:

    every room: local pages for the logical pages this CP rank owns, in random order
                (as an engine's allocator hands them out); KVSender(room).init(num_tokens)
    prefill the batch, chunk_tokens per step (one shot with 0); after each step the
        RankWriter pages the rows this rank owns (rank-local order, hard rule 2), then
        each room sends the owned pages that start in the step with num_tokens_ready
        (kvbridge holds a page the step ends inside); the last step carries is_last and,
        on the CP rank that owns the last token, the aux row (first token, last hidden
        state, the draft's top-1): every TP rank passes it, each writes it to the decode
        ranks it is the first source of
    sender Success/Failed -> free the pages (refilled with SRC_STALE), reply RoomResult

CP and TP are simulated: every CP rank runs the whole prompt and stores only the
pages it owns; every TP rank runs the whole model and stores only its KV heads.
The pages, their ownership, the aux row's owner and what decode counts are real.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.integrations.transformers.paged import SRC_STALE
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker import ops
from kvbridge.worker.model_pools import ModelPools
from kvbridge.worker.prefill import PrefillTask, PrefillWorker


@dataclass
class ModelPrefillTask(PrefillTask):
    prompt: list[int] = field(default_factory=list)
    table: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # local page i -> physical page
    chunk_tokens: int = 0


class ModelPrefillWorker(ModelPools, PrefillWorker):
    pool_fill = SRC_STALE

    def __init__(self, cfg: Any, engine_factory: Any = None) -> None:
        super().__init__(cfg, engine_factory)
        self.batches: dict[int, list[ModelPrefillTask]] = {}
        self.batch_sizes: dict[int, int] = {}
        self.rng = np.random.default_rng(cfg.cp_rank * 1009 + cfg.tp_rank)

    def begin(self, peer: bytes, request_id: int, op: ops.Prefill) -> ModelPrefillTask:
        prompt = self._check_prompt(op)
        num_pages = -(-op.num_tokens // self.cfg.page_size)
        stored = self.pages.allocate(op.room, self.lanes.num_local_pages(self.cfg.cp_rank, num_pages))
        task = ModelPrefillTask(op.room, op.num_tokens, peer, request_id, prompt=prompt,
                                table=self.rng.permutation(stored).astype(np.int64), chunk_tokens=op.chunk_tokens)
        try:
            task.sender = self.endpoint.sender(op.room)
            task.sender.init(op.num_tokens)
        except BaseException:
            self.pages.free(op.room)
            raise
        size = self.batch_sizes.setdefault(op.batch_id, op.batch_size)
        batch = self.batches.setdefault(op.batch_id, [])
        batch.append(task)
        if size != op.batch_size:
            self._fail_batch(op.batch_id, f"batch {op.batch_id}: batch_size {op.batch_size} in room {op.room}'s op, "
                                          f"{size} in the first op of the batch")
        elif len(batch) == size:
            self._run_batch(op.batch_id)
        return task

    def _check_prompt(self, op: ops.Prefill) -> list[int]:
        vocab = int(self.model_rank.lm.config.vocab_size)
        prompt = op.prompt
        if not isinstance(prompt, list) or len(prompt) != op.num_tokens:
            raise ConfigError(f"room {op.room}: model mode needs the prompt's {op.num_tokens} token ids, got "
                              f"{len(prompt) if isinstance(prompt, list) else type(prompt).__name__}", room=op.room,
                              rank=self.cfg.rank_name, field="prompt")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ConfigError(f"room {op.room}: token ids must be integers in [0, {vocab})", room=op.room,
                              rank=self.cfg.rank_name, field="prompt")
        if op.batch_size < 1 or len(self.batches.get(op.batch_id, [])) >= op.batch_size:
            raise ConfigError(f"room {op.room}: batch {op.batch_id} of size {op.batch_size} is full or invalid",
                              room=op.room, rank=self.cfg.rank_name, field="batch_size")
        return prompt

    def _fail_batch(self, batch_id: int, reason: str) -> None:
        for task in self.batches.pop(batch_id, []):
            self.abort(task, reason)
        self.batch_sizes.pop(batch_id, None)

    def _run_batch(self, batch_id: int) -> None:
        """Prefill the whole batch; each step sends the pages it completed (see the module doc)."""
        from kvbridge.integrations.transformers import RankWriter, aux_values, prefill

        tasks = self.batches.pop(batch_id)
        self.batch_sizes.pop(batch_id, None)
        rank = self.model_rank
        writer = RankWriter(rank.geom, rank.paged, self.lanes, self.cfg.cp_rank)
        for q, task in enumerate(tasks):
            writer.add_request(q, task.num_tokens, task.table)
            task.logical, task.local = writer.owned_pages(q)
            task.mark("filled")
        ps = self.cfg.page_size

        def on_step(chunks: Any, done: Any) -> None:
            for chunk in chunks:
                task = tasks[chunk.index]
                pick = (task.logical * ps >= chunk.start) & (task.logical * ps < chunk.stop)
                last = chunk.stop == task.num_tokens
                aux = aux_values(rank.lm, done[chunk.index]) if last and task.sender.writes_aux else None
                task.sender.send(task.logical[pick], task.local[pick], num_tokens_ready=chunk.stop, is_last=last,
                                 aux=aux)
                if last:
                    task.mark("sent")

        chunk = tasks[0].chunk_tokens or None
        try:
            prefill(rank.lm, [t.prompt for t in tasks], chunk_size=chunk, writers=[writer], on_step=on_step)
        except (KVBridgeError, RuntimeError, ValueError) as exc:
            for task in tasks:
                self.abort(task, f"prefill of batch {batch_id} failed on {self.cfg.rank_name}: {exc}")

    def advance(self, task: ModelPrefillTask) -> ops.RoomResult | None:
        state = task.sender.poll()
        if state not in (KVPoll.Success, KVPoll.Failed):
            return None
        self.model_rank.paged.fill_pages(task.table, SRC_STALE)  # no write from them is in flight any more
        return self._result(task, state)

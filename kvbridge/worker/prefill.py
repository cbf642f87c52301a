"""``kvbridge prefill-worker``: one prefill rank running synthetic prefills.

A Prefill(room, num_tokens, chunk_tokens) op:

    allocate local pages for the logical pages this CP rank owns
    fill them with synthetic KV (every pool, every layer; compute padding = PAD_BYTE)
    KVSender(room).init(num_tokens)
    once the decode side asked (WaitingForInput): send chunk by chunk, with num_tokens_ready, the
        owned pages each chunk reached (kvbridge holds a page a chunk ends inside until it is complete);
        the last chunk carries is_last and, on the owner of the last token, the aux row
    sender Success/Failed -> free the pages, reply RoomResult
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.layout.aux import owner_of_last_token
from kvbridge.layout.lanes import OwnerLanes
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker import ops
from kvbridge.worker.base import Task, WorkerBase
from kvbridge.worker.synthetic import fill_pages, make_aux


@dataclass
class PrefillTask(Task):
    sender: Any = None
    logical: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # owned logical pages, ascending
    local: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # their physical pages here
    chunk_ends: list[int] = field(default_factory=list)  # token count after each chunk
    chunks_sent: int = 0
    aux: Any = None  # the AuxRow, when this rank owns the last valid token


class PrefillWorker(WorkerBase):
    role = "prefill"
    room_op = ops.Prefill

    def __init__(self, cfg, engine_factory=None) -> None:
        super().__init__(cfg, engine_factory)
        self.lanes = OwnerLanes(cfg.cp_size, cfg.lane_rule)

    def make_endpoint(self) -> Any:
        from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint

        cfg = self.cfg
        pcfg = PrefillConfig(
            instance=cfg.instance,
            dp_rank=cfg.dp_rank,
            cp_rank=cfg.cp_rank,
            tp_rank=cfg.tp_rank,
            dp_size=cfg.dp_size,
            cp_size=cfg.cp_size,
            tp_size=cfg.tp_size,
            lane_rule=cfg.lane_rule,
            host=cfg.host,
            control_port=cfg.control_port,
            secret=cfg.secret_bytes,
            lease_ttl=cfg.lease_ttl,
            target_timeout=cfg.transfer_timeout,
            max_slices_per_call=cfg.max_slices_per_call,
            aux_device=self.aux_device,
            staging=cfg.staging,
            staging_bytes=cfg.staging_bytes,
            staging_slot_bytes=cfg.staging_slot_bytes,
            trace=cfg.trace,
        )
        bootstrap = self.bootstrap_client()
        return PrefillEndpoint(pcfg, self.engine, self.specs, self.buffers, self.contract, bootstrap, self.aux_schema)

    def extra_ready(self) -> dict[str, Any]:
        return {"control": self.endpoint.endpoint}

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "control_connections": self.endpoint.connections()}

    def begin(self, peer: bytes, request_id: int, op: ops.Prefill) -> PrefillTask:
        ps = self.cfg.page_size
        num_pages = -(-op.num_tokens // ps)
        logical = self.lanes.owned_pages(self.cfg.cp_rank, num_pages)
        stored = self.pages.allocate(op.room, self.lanes.num_local_pages(self.cfg.cp_rank, num_pages))
        _, local_index = self.lanes.owners(logical, num_pages)
        task = PrefillTask(op.room, op.num_tokens, peer, request_id, logical=logical, local=stored[local_index])
        try:
            for spec in self.specs.values():
                for layer_id in spec.layer_ids:
                    buf = self.buffers[(spec.name, layer_id)]
                    fill_pages(spec, buf, op.room, layer_id, task.logical, task.local, op.num_tokens)
            task.mark("filled")
            chunk = op.chunk_tokens if op.chunk_tokens > 0 else op.num_tokens
            task.chunk_ends = [min(end, op.num_tokens) for end in range(chunk, op.num_tokens + chunk, chunk)]
            if owner_of_last_token(op.num_tokens, ps, self.lanes) == self.cfg.cp_rank:
                task.aux = self.aux_schema.unpack(make_aux(self.aux_schema, op.room, op.num_tokens))
            task.sender = self.endpoint.sender(op.room)
            task.sender.init(op.num_tokens, binding=op.binding)
        except BaseException:
            self.pages.free(op.room)
            raise
        return task

    def advance(self, task: PrefillTask) -> ops.RoomResult | None:
        state = task.sender.poll()
        if state in (KVPoll.Success, KVPoll.Failed):
            return self._result(task, state)
        if state in (KVPoll.WaitingForInput, KVPoll.Transferring) and not task.aborting:
            task.mark("decode_ready")
            self._send_next_chunk(task)
        return None

    def _send_next_chunk(self, task: PrefillTask) -> None:
        """Send the owned pages the next chunk reaches, saying how many tokens are ready: a page
        the chunk ends inside is held by kvbridge until a later chunk completes it."""
        if task.chunks_sent >= len(task.chunk_ends):
            return
        ps = self.cfg.page_size
        is_last = task.chunks_sent == len(task.chunk_ends) - 1
        lo = task.chunk_ends[task.chunks_sent - 1] if task.chunks_sent else 0
        hi = task.chunk_ends[task.chunks_sent]
        pick = (task.logical * ps >= lo) & (task.logical * ps < hi)  # pages starting in [lo, hi)
        task.chunks_sent += 1
        if not pick.any() and not is_last:
            return
        task.sender.send(task.logical[pick], task.local[pick], num_tokens_ready=hi, is_last=is_last,
                         aux=task.aux if is_last else None)
        task.mark("first_write")  # send() posts at once when decode already asked (first mark wins)
        if is_last:
            task.mark("sent")

    def _result(self, task: PrefillTask, state: KVPoll) -> ops.RoomResult:
        self.pages.free(task.room)  # final: no write from these pages is in flight any more
        task.mark("done")
        ok = state == KVPoll.Success
        return ops.RoomResult(
            room=task.room,
            ok=ok,
            reason="" if ok else (task.sender.failure_reason or "failed"),
            rank=self.cfg.rank_name,
            num_bytes=self.owned_bytes(task) if ok else 0,
            timings=dict(task.marks),
        )

    def owned_bytes(self, task: PrefillTask) -> int:
        """Valid KV bytes of the pages this rank owns (what it writes to each decode rank)."""
        ps, n = self.cfg.page_size, task.num_tokens
        tokens = int(np.minimum((task.logical + 1) * ps, n).sum() - (task.logical * ps).sum())
        return sum(tokens * s.bytes_per_token * s.num_layers for s in self.specs.values())

    def abort(self, task: PrefillTask, reason: str) -> None:
        task.aborting = True
        task.sender.abort(reason)

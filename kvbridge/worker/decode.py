"""``kvbridge decode-worker``: one decode rank receiving and checking synthetic KV.

A Decode(room, num_tokens, prefill_instance) op:

    allocate destination pages (one mapping for every pool; contiguous when possible) and an aux slot
    pre-fill the partial last page with SENTINEL_BYTE (so a written padding row shows)
    KVReceiver(room, prefill_instance); once bootstrapped: init(pages, aux_slot, num_tokens)
    Success -> verify every byte of every pool and layer, and the aux row; free; reply
    Failed  -> reply with the reason; free the pages only when pages_releasable (hard rule 6),
               until then they are held and re-checked every step
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvbridge.transfer.poll import KVPoll
from kvbridge.worker import ops
from kvbridge.worker.base import Task, WorkerBase
from kvbridge.worker.pages import PageAllocator
from kvbridge.worker.poison import PagePoison
from kvbridge.worker.synthetic import prepare_destination, verify_aux, verify_pages


@dataclass
class DecodeTask(Task):
    receiver: Any = None
    page_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    aux_slot: int = -1
    initialised: bool = False
    binding: bytes = b""


class DecodeWorker(WorkerBase):
    role = "decode"
    room_op = ops.Decode

    def __init__(self, cfg, engine_factory=None) -> None:
        super().__init__(cfg, engine_factory)
        self.aux_slots = PageAllocator(cfg.aux_rows)
        self.aux_buffer: torch.Tensor | None = None
        self.held: dict[int, Any] = {}  # room -> receiver of a failed room whose pages a write may still reach
        self.poison: PagePoison | None = None  # --poison-pages: released pages are poisoned and checked before reuse

    def make_endpoint(self) -> Any:
        from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint

        cfg = self.cfg
        if cfg.poison_pages:
            self.poison = PagePoison(self.buffers, cfg.rank_name)
        dcfg = DecodeConfig(
            instance=cfg.instance,
            dp_rank=cfg.dp_rank,
            tp_rank=cfg.tp_rank,
            dp_size=cfg.dp_size,
            tp_size=cfg.tp_size,
            host=cfg.host,
            secret=cfg.secret_bytes,
            transfer_timeout=cfg.transfer_timeout,
            peer_timeout=cfg.peer_timeout,
            lease_quarantine=cfg.lease_quarantine,
            lease_ttl=cfg.lease_ttl,
            staging=cfg.staging,
            staging_bytes=cfg.staging_bytes,
            staging_slot_bytes=cfg.staging_slot_bytes,
            staging_granted_slots=cfg.staging_granted_slots,
            trace=cfg.trace,
        )
        self.aux_buffer = torch.zeros((cfg.aux_rows, self.aux_schema.row_bytes), dtype=torch.uint8,
                                      device=self.aux_device)
        bootstrap = self.bootstrap_client()
        return DecodeEndpoint(
            dcfg, self.engine, self.specs, self.buffers, self.contract, bootstrap, self.aux_buffer, self.aux_schema
        )

    def begin(self, peer: bytes, request_id: int, op: ops.Decode) -> DecodeTask:
        num_pages = -(-op.num_tokens // self.cfg.page_size)
        page_ids = self.pages.allocate(op.room, num_pages)
        if self.poison is not None:
            self.poison.check(page_ids, f"found when room {op.room} took them")
        try:
            aux_slot = int(self.aux_slots.allocate(op.room, 1)[0])
        except BaseException:
            self.pages.free(op.room)
            raise
        task = DecodeTask(op.room, op.num_tokens, peer, request_id, page_ids=page_ids, aux_slot=aux_slot,
                          binding=op.binding)
        try:
            self.aux_buffer[aux_slot] = 0
            task.receiver = self.endpoint.receiver(op.room, op.prefill_instance, op.prefill_dp_rank)
        except BaseException:
            self._free(op.room)
            raise
        return task

    def advance(self, task: DecodeTask) -> ops.RoomResult | None:
        state = task.receiver.poll()
        if state == KVPoll.WaitingForInput and not task.initialised and not task.aborting:
            task.mark("bootstrapped")
            # lane-major order inside the allocated block: one run per prefill CP rank
            task.page_ids = task.page_ids[task.receiver.lanes.lane_major(len(task.page_ids))]
            for spec in self.specs.values():
                for layer_id in spec.layer_ids:
                    prepare_destination(spec, self.buffers[(spec.name, layer_id)], task.page_ids, task.num_tokens)
            task.receiver.init(task.page_ids, task.aux_slot, task.num_tokens, binding=task.binding)
            task.initialised = True
        elif state == KVPoll.Transferring:
            task.mark("transferring")
        elif state == KVPoll.Success:
            task.mark("committed")
            return self._verify_and_free(task)
        elif state == KVPoll.Failed:
            task.mark("failed")
            return self._failed(task)
        return None

    def _verify_and_free(self, task: DecodeTask) -> ops.RoomResult:
        t0 = time.monotonic()
        stats = dict(getattr(task.receiver, "stats", {}) or {})
        verified, problems = 0, []
        if self.cfg.verify:
            for spec in self.specs.values():
                for layer_id in spec.layer_ids:
                    buf = self.buffers[(spec.name, layer_id)]
                    verdict = verify_pages(spec, buf, task.room, layer_id, task.page_ids, task.num_tokens)
                    verified += verdict.bytes_checked
                    if not verdict.ok:
                        problems.append(verdict.first_error)
            aux = task.receiver.aux if task.receiver.aux is not None else self.aux_buffer[task.aux_slot].numpy()
            aux_problem = verify_aux(self.aux_schema, aux, task.room, task.num_tokens)
            if aux_problem:
                problems.append(aux_problem)
        task.marks["verify_s"] = round(time.monotonic() - t0, 6)
        self._free(task.room)
        reason = "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
        return ops.RoomResult(
            room=task.room,
            ok=not problems,
            reason=reason,
            rank=self.cfg.rank_name,
            num_bytes=int(stats.get("bytes", self.room_bytes(task.num_tokens))),
            bytes_verified=verified,
            num_slices=int(stats.get("slices", 0)),
            timings=dict(task.marks),
        )

    def room_bytes(self, num_tokens: int) -> int:
        """Valid KV bytes of a room over every pool and layer (what a transfer writes)."""
        return sum(num_tokens * s.bytes_per_token * s.num_layers for s in self.specs.values())

    def _failed(self, task: DecodeTask) -> ops.RoomResult:
        if task.receiver.pages_releasable:
            self._free(task.room)
        else:  # hard rule 6: a prefill rank may still write these pages
            self.pages.hold(task.room)
            self.aux_slots.hold(task.room)
            self.held[task.room] = task.receiver
        return ops.RoomResult(
            task.room, False, task.receiver.failure_reason or "failed", self.cfg.rank_name, timings=dict(task.marks)
        )

    def _free(self, room: int) -> None:
        pages = self.pages.pages_of(room)
        self.pages.free(room)
        self.aux_slots.free(room)
        if self.poison is not None:
            self.poison.poison(pages)

    def housekeeping(self) -> None:
        for room, receiver in list(self.held.items()):
            if receiver.pages_releasable:
                if self.poison is not None:
                    self.poison.poison(self.pages.held_pages(room))
                self.pages.release(room)
                self.aux_slots.release(room)
                del self.held[room]
                self.log.info("room %d: pages released after every prefill rank let go", room)

    def abort(self, task: DecodeTask, reason: str) -> None:
        task.aborting = True
        task.receiver.abort(reason)

    def stats(self) -> dict[str, Any]:
        out = {**super().stats(), "rooms_held": len(self.held), "aux_free": self.aux_slots.num_free}
        if self.poison is not None:  # every free page, now: a late write shows even if the page was never reused
            self.poison.check(self.pages.free_pages(), "in a sweep of the free pages")
            out |= {"late_writes": self.poison.late_writes, "pages_poison_checked": self.poison.pages_checked}
        return out

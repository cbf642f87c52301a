"""One in-process PD pair for the bench: cp prefill endpoints and one decode endpoint.

Each rank has its own transfer engine (Mooncake engines in one process write to
each other over loopback like separate processes do) and its own buffers; the
bootstrap daemon is a separate process. Allocation is contiguous on both sides:

    prefill rank r   local pages 0 .. n_r-1      (owned logical pages, ascending)
    decode           pages 0 .. num_pages-1      (page_ids[l] = l)

so the three methods below move exactly the same slices between the same buffers:

    kvbridge  receiver(room) .. init .. senders send .. Success   (handshake to commit)
    raw       engine.submit_write(plan.src, plan.dst, plan.length) per prefill rank, all in flight together
    memcpy    ctypes.memmove of every slice of the same plans
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvbridge.errors import TransferTimeout
from kvbridge.layout.aux import owner_of_last_token
from kvbridge.layout.lanes import OwnerLanes
from kvbridge.layout.plan import TransferPlan, describe_buffer, plan_transfer
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker.resources import allocate_buffers, aux_schema_of, build_contract, build_specs
from kvbridge.worker.synthetic import fill_pages, make_aux, verify_pages

FINAL = (KVPoll.Success, KVPoll.Failed)
# One process hosts every rank here: on a loaded 2-core host a heartbeat can lag seconds behind.
PEER_TIMEOUT_S = 30.0
POLL_S = 0.0005  # how often the bench, like an engine's scheduler step, polls its rooms


@dataclass(frozen=True)
class RigSpec:
    cp: int
    max_tokens: int
    preset: str = "deepseek-v3.2-fp8"
    layers: int = 4
    draft_layers: int = 1
    page_size: int = 64
    engine: str = "mooncake"
    max_slices_per_call: int = 1024
    bootstrap: str = ""
    token: str | None = None
    dst_order: str = "lane-major"  # or "logical"


class Rig:
    def __init__(self, spec: RigSpec) -> None:
        from kvbridge.bootstrap.client import BootstrapClient
        from kvbridge.transfer.engine import create_engine
        from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
        from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint

        self.spec = spec
        self.specs = build_specs(spec.preset, spec.layers, spec.page_size, spec.draft_layers)
        self.contract = build_contract(spec.preset, spec.layers, spec.page_size, spec.draft_layers, "interleaved")
        self.aux_schema = aux_schema_of(self.contract)
        self.lanes = OwnerLanes(spec.cp)
        max_pages = -(-spec.max_tokens // spec.page_size)
        self.prefill_instance = f"bench-prefill-cp{spec.cp}"
        self.src_engines: list[Any] = []
        self.dst_engine: Any = None
        self.prefill: list[Any] = []
        self.src_buffers: list[dict] = []
        self.decode: Any = None
        try:
            for cp_rank in range(spec.cp):
                engine = self._engine(create_engine)
                self.src_engines.append(engine)
                bufs = allocate_buffers(self.specs, max(1, len(self.lanes.owned_pages(cp_rank, max_pages))))
                cfg = PrefillConfig(instance=self.prefill_instance, cp_rank=cp_rank, cp_size=spec.cp,
                                    max_slices_per_call=spec.max_slices_per_call)
                ep = PrefillEndpoint(cfg, engine, self.specs, bufs, self.contract,
                                     BootstrapClient(spec.bootstrap, token=spec.token), self.aux_schema)
                ep.start()
                self.prefill.append(ep)
                self.src_buffers.append(bufs)
            self.dst_engine = self._engine(create_engine)
            self.dst_buffers = allocate_buffers(self.specs, max_pages)
            self.aux_buffer = torch.zeros((4, self.aux_schema.row_bytes), dtype=torch.uint8)
            self.decode = DecodeEndpoint(
                DecodeConfig(instance=f"bench-decode-cp{spec.cp}", peer_timeout=PEER_TIMEOUT_S), self.dst_engine, self.specs, self.dst_buffers,
                self.contract, BootstrapClient(spec.bootstrap, token=spec.token), self.aux_buffer, self.aux_schema,
            )  # fmt: skip
            self.decode.start()
        except BaseException:
            self.close()
            raise

    def _engine(self, create_engine: Any) -> Any:
        if self.spec.engine == "local":  # in-process memmove between regions of one shared fabric
            from kvbridge.transfer.engine import LocalFabric

            self._fabric = getattr(self, "_fabric", None) or LocalFabric()
            return create_engine("local", fabric=self._fabric, max_slices_per_call=self.spec.max_slices_per_call)
        return create_engine(self.spec.engine, host="127.0.0.1", max_slices_per_call=self.spec.max_slices_per_call)

    # ---- one request length --------------------------------------------------------------------
    def owned(self, cp_rank: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(owned logical pages, their local pages) of a rank: contiguous local allocation."""
        logical = self.lanes.owned_pages(cp_rank, -(-num_tokens // self.spec.page_size))
        return logical, np.arange(len(logical), dtype=np.int32)

    def fill(self, fill_room: int, num_tokens: int) -> None:
        for cp_rank, bufs in enumerate(self.src_buffers):
            logical, local = self.owned(cp_rank, num_tokens)
            for spec in self.specs.values():
                for lid in spec.layer_ids:
                    fill_pages(spec, bufs[(spec.name, lid)], fill_room, lid, logical, local, num_tokens)

    def dst_pages(self, num_tokens: int) -> np.ndarray:
        """Decode page of each logical page: one contiguous block, laid out lane-major
        (each CP rank's pages consecutive: one run per rank) or in logical order."""
        num_pages = -(-num_tokens // self.spec.page_size)
        if self.spec.dst_order == "lane-major":
            return self.lanes.lane_major(num_pages).astype(np.int32)
        return np.arange(num_pages, dtype=np.int32)

    def plans(self, num_tokens: int) -> list[TransferPlan]:
        """The slices each prefill rank writes for a request of ``num_tokens`` (what kvbridge plans too)."""
        dst = [describe_buffer(self.specs[p], lid, b) for (p, lid), b in self.dst_buffers.items()]
        dst_pages = self.dst_pages(num_tokens)
        out = []
        for cp_rank, bufs in enumerate(self.src_buffers):
            src = [describe_buffer(self.specs[p], lid, b) for (p, lid), b in bufs.items()]
            logical, local = self.owned(cp_rank, num_tokens)
            out.append(plan_transfer(self.specs, src, dst, logical, local, dst_pages[logical], num_tokens))
        return out

    def ideal_slices(self, num_tokens: int) -> int:
        """runs x layers x pools, + 1 for the aux row (it rides in the last batch): a run is a
        stretch of pages consecutive on both sides."""
        layers = sum(s.num_layers for s in self.specs.values())
        runs = 0
        dst_pages = self.dst_pages(num_tokens)
        for cp_rank in range(self.spec.cp):
            logical, local = self.owned(cp_rank, num_tokens)
            if len(logical):
                dst = dst_pages[logical]
                runs += 1 + int(np.count_nonzero((np.diff(dst) != 1) | (np.diff(local) != 1)))
        return runs * layers + 1

    def run_kvbridge(self, room: int, num_tokens: int, timeout: float = 120.0) -> tuple[float, dict]:
        """Seconds from the receiver's creation (handshake) to commit; the receiver's stats."""
        ps = self.spec.page_size
        page_ids = self.dst_pages(num_tokens)
        aux_owner = owner_of_last_token(num_tokens, ps, self.lanes)
        aux = self.aux_schema.unpack(make_aux(self.aux_schema, room, num_tokens))
        t0 = time.perf_counter()
        receiver = self.decode.receiver(room, self.prefill_instance)
        senders = [ep.sender(room) for ep in self.prefill]
        for s in senders:
            s.init(num_tokens)
        sent = [False] * len(senders)
        initialised = False
        deadline = time.monotonic() + timeout
        while True:
            state = receiver.poll()
            if state == KVPoll.WaitingForInput and not initialised:
                receiver.init(page_ids, 0, num_tokens)
                initialised = True
            for r, s in enumerate(senders):
                if not sent[r] and s.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring):
                    logical, local = self.owned(r, num_tokens)
                    s.send(logical, local, is_last=True, aux=aux if r == aux_owner else None)
                    sent[r] = True
            if state in FINAL:
                break
            if time.monotonic() > deadline:
                receiver.abort("bench timeout")
                raise TransferTimeout(f"room {room} not done after {timeout:.0f}s", room=room)
            time.sleep(POLL_S)
        elapsed = time.perf_counter() - t0
        if state != KVPoll.Success:
            raise TransferTimeout(f"kvbridge room failed: {receiver.failure_reason}", room=room)
        while any(s.poll() not in FINAL for s in senders) and time.monotonic() < deadline:
            time.sleep(0.001)
        stats = dict(receiver.stats)
        stats["slices"] = sum(s.stats.get("slices", 0) for s in senders)  # what kvbridge really posted
        return elapsed, stats

    def run_raw(self, plans: list[TransferPlan], timeout: float = 120.0) -> float:
        session = self.dst_engine.session_id
        t0 = time.perf_counter()
        handles = [(eng, eng.submit_write(session, p.src, p.dst, p.length)) for eng, p in zip(self.src_engines, plans)]
        for eng, h in handles:
            eng.wait(h, timeout)
        return time.perf_counter() - t0

    @staticmethod
    def run_memcpy(plans: list[TransferPlan]) -> float:
        move = ctypes.memmove
        t0 = time.perf_counter()
        for p in plans:
            for s, d, n in zip(p.src.tolist(), p.dst.tolist(), p.length.tolist()):
                move(d, s, n)
        return time.perf_counter() - t0

    def verify(self, fill_room: int, num_tokens: int) -> tuple[int, list[str]]:
        page_ids = self.dst_pages(num_tokens)
        checked, problems = 0, []
        for spec in self.specs.values():
            for lid in spec.layer_ids:
                v = verify_pages(spec, self.dst_buffers[(spec.name, lid)], fill_room, lid, page_ids, num_tokens)
                checked += v.bytes_checked
                if not v.ok:
                    problems.append(v.first_error)
        return checked, problems

    def close(self) -> None:
        for ep in [*self.prefill, self.decode]:
            if ep is not None:
                ep.close()
        for eng in [*self.src_engines, self.dst_engine]:
            if eng is not None:
                eng.close()

"""Scheduler-shaped drivers of kvbridge's SGLang backend.

``PrefillServer`` and ``DecodeServer`` call the backend in the order, and with the
arguments, of SGLang 0.5.23's prefill and decode loops, over ``RankWorld``s
(``_sgl_world.py``: SGLang's own pools, metadata buffers and ``KVArgs`` on the
CPU); each method names the SGLang function it mirrors. A server's ranks share
this process, so their MIN all-reduce is done here (``min_poll``). What the
harness does not mirror: the model (KV rows are synthetic, written row by row as
chunks "run"), the radix cache (a decode prefix is pages holding a marker) and
the process groups.
"""

from __future__ import annotations

import random
import time
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation import utils as disagg_utils
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.disaggregation.utils import _apply_metadata_gate
from sglang.srt.mem_cache.common import kv_to_page_indices, kv_to_page_num, suffix_page_indices

from _sgl_world import NOT_COMPUTED, PAGE, POOL_PAGES, PREFIX_MARK, RankWorld, metadata_errors, metadata_req
from kvbridge.worker.synthetic import SENTINEL_BYTE, verify_pages


def prompt(room: int, n: int, salt: int = 0) -> np.ndarray:
    """A request's prompt token ids (deterministic per room): what both servers' Req carry."""
    return (np.arange(n, dtype=np.int64) * 37 + room % 9973 + salt * 101) % 50_000


def sglang_req(room: int, addr: str, tokens: np.ndarray) -> SimpleNamespace:
    """What SGLang's queue methods read of a ``Req``: its prompt (``array('q')``, as SGLang's
    ``Req.origin_input_ids``) and bootstrap fields."""
    host, port = addr.rsplit(":", 1)
    return SimpleNamespace(rid=f"req-{room}", origin_input_ids=array("q", np.asarray(tokens, np.int64).tolist()),
                           bootstrap_host=host,
                           bootstrap_port=int(port), bootstrap_room=room, disagg_prefill_dp_rank=None,
                           sampling_params=SimpleNamespace(max_new_tokens=16))


def min_poll(per_rank: list[list[int]]) -> list[int]:
    """What ``poll_and_all_reduce_attn_cp_tp_group`` / ``poll_and_all_reduce`` return to every
    rank: the MIN over the ranks of each request's poll."""
    return [min(polls) for polls in zip(*per_rank)] if per_rank else []


# -- prefill ---------------------------------------------------------------------------------


@dataclass
class PReq:
    room: int
    n: int
    chunk: int
    pages: np.ndarray
    senders: list
    optimistic: bool = False
    hold_after: int | None = None  # stop computing after this many chunks, until resumed
    phase: str = "bootstrap"  # bootstrap | running | inflight | done
    meta_idx: list[int] = field(default_factory=list)
    extend_end: int = 0
    # per rank, as each rank's own Req holds them: req.start_send_idx, req.disagg_decode_prefix_len
    start_send_idx: list[int] = field(default_factory=list)
    decode_prefix: list[int] = field(default_factory=list)
    chunks_done: int = 0
    pending_bootstrap: bool = True
    held_reported: bool = False


class PrefillServer:
    """One prefill server: its ranks (all attention CP x TP ranks, in this process), driven like
    ``Scheduler.event_loop_normal_disagg_prefill``: ``pop_bootstrapped``, run one chunk of each
    running request, ``process_disagg_prefill_inflight_queue``.

    With pipeline stages (ranks with ``pp_rank``), as ``event_loop_pp_disagg_prefill``: the
    bootstrap poll is PP rank 0's, all-reduced over its ranks and handed to every stage
    (``poll_and_all_reduce_prefill_pp``); every stage finalizes, computes its layers and calls
    ``send_kv_chunk`` (its own metadata row included); a request leaves the inflight queue once
    every stage polls Success or Failed (``_pp_pd_get_prefill_transferred_ids``: the intersection
    of the stages' lists), with the MIN of their polls."""

    def __init__(self, name: str, worlds: list[RankWorld], shard: int, bootstrap_addr: str) -> None:
        self.name, self.worlds, self.shard, self.addr = name, worlds, shard, bootstrap_addr
        self.pp_size = max(w.ranks.get("pp_size", 1) for w in worlds)
        self.reqs: dict[int, PReq] = {}
        self.free = list(range(1, POOL_PAGES + 1))  # page 0 is SGLang's padding slot
        self.events: list[dict] = []

    def add(self, room: int, n: int, chunk: int, optimistic: bool = False, hold_after: int | None = None,
            bad_pages: bool = False, tokens: np.ndarray | None = None) -> None:
        """``PrefillBootstrapQueue.add`` -> SGLang's own ``create_sender`` (kvbridge's patch binds the
        room to ``tokens``, the prompt: default ``prompt(room, n)``) on every rank."""
        tokens = prompt(room, n) if tokens is None else tokens
        senders = []
        for w in self.worlds:
            req = sglang_req(room, self.addr, tokens)
            queue = SimpleNamespace(transfer_backend=disagg_utils.TransferBackend.KVBRIDGE, kv_manager=w.mgr,
                                    bootstrap_port=req.bootstrap_port, _check_if_req_exceed_kv_capacity=lambda _r: False,
                                    _process_req=lambda _r: None)  # fmt: skip
            assert PrefillBootstrapQueue.create_sender(queue, req, 0)
            senders.append(req.disagg_kv_sender)
        pages = self._alloc(kv_to_page_num(n, PAGE), bad_pages)
        for w in self.worlds:  # rows no chunk computed yet
            held = pages if self.shard == 1 else pages[pages % self.shard == w.ranks["attn_tp_rank"]] // self.shard
            for buf in w.buffers.values():
                buf[held] = NOT_COMPUTED
        self.reqs[room] = PReq(room, n, chunk, pages, senders, optimistic=optimistic, hold_after=hold_after,
                               start_send_idx=[0] * len(senders), decode_prefix=[0] * len(senders))  # fmt: skip

    def _alloc(self, num_pages: int, bad: bool) -> np.ndarray:
        """Page ids (the same on every rank: SGLang allocates SPMD). With a KV shard of N ranks the
        allocator's round-robin starts at rank 0: position i gets a page id of lane i % N
        (``bad``: shifted by one, which kvbridge refuses)."""
        pages = []
        for i in range(num_pages):
            lane = (i + bad) % self.shard
            page = next(p for p in random.sample(self.free, len(self.free)) if p % self.shard == lane)
            self.free.remove(page)
            pages.append(page)
        return np.array(pages, dtype=np.int64)

    def polls(self, reqs: list[PReq], stage: int | None = None) -> list[int]:
        """The MIN of the ranks' polls (``stage``: of that pipeline stage's ranks only)."""
        ranks = [i for i, w in enumerate(self.worlds) if stage is None or w.ranks.get("pp_rank", 0) == stage]
        return min_poll([[int(r.senders[i].poll()) for r in reqs] for i in ranks])

    def inflight_polls(self, reqs: list[PReq]) -> list[int]:
        """Pipeline stages: Transferring until every stage's poll is final (see the class docstring)."""
        if self.pp_size == 1:
            return self.polls(reqs)
        stages = [self.polls(reqs, s) for s in range(self.pp_size)]
        final = (KVPoll.Success, KVPoll.Failed)
        return [min(p) if all(x in final for x in p) else int(KVPoll.Transferring) for p in zip(*stages)]

    def step(self) -> None:
        self.pop_bootstrapped()
        for r in [r for r in self.reqs.values() if r.phase == "running"]:
            self.run_chunk(r)
        self.process_inflight_queue()

    def pop_bootstrapped(self) -> None:
        """``PrefillBootstrapQueue.pop_bootstrapped`` (optimistic prefill: ``can_prefill_before_bootstrap``)."""
        queue = [r for r in self.reqs.values() if r.phase == "bootstrap"]
        for r, poll in zip(queue, self.polls(queue, 0 if self.pp_size > 1 else None)):
            if poll == KVPoll.Failed:
                self.finish(r, "Failed", self.failure(r))  # handle_bootstrap_failure
            elif poll == KVPoll.Bootstrapping and r.optimistic:
                self.ensure_metadata_buffer(r)
                r.phase = "running"
            elif poll == KVPoll.WaitingForInput:
                self.finalize_bootstrap(r)
                r.phase = "running"

    def ensure_metadata_buffer(self, r: PReq) -> None:
        if not r.meta_idx:
            r.meta_idx = [w.meta_alloc.alloc() for w in self.worlds]

    def finalize_bootstrap(self, r: PReq) -> None:
        """``PrefillBootstrapQueue.finalize_bootstrap``: ``pop_decode_prefix_len()``, then
        ``init(pages after the prefix, metadata_buffer_index)``, on every rank."""
        self.ensure_metadata_buffer(r)
        for i, (s, idx) in enumerate(zip(r.senders, r.meta_idx)):
            prefix = s.pop_decode_prefix_len()
            r.start_send_idx[i] = r.decode_prefix[i] = prefix
            s.init(kv_to_page_num(r.n - prefix, PAGE), idx)
        r.pending_bootstrap = False

    def run_chunk(self, r: PReq) -> None:
        """One forward of a chunked prefill, then what follows it in the non-overlap loop:
        ``process_prefill_chunk`` -> ``send_kv_chunk`` for a chunk that is not the last,
        ``process_batch_result_disagg_prefill`` -> ``send_kv_chunk(last_chunk=True)`` for the last."""
        if r.hold_after is not None and r.chunks_done >= r.hold_after:
            if not r.held_reported:  # its chunks so far were sent: decode had asked (WaitingForInput)
                r.held_reported = True
                self.events.append({"server": self.name, "room": r.room, "event": "held"})
            return
        start, end = r.extend_end, min(r.extend_end + r.chunk, r.n)
        for w in self.worlds:
            w.write_rows(r.room, r.pages, start, end, r.n, self.shard)
        r.extend_end, r.chunks_done = end, r.chunks_done + 1
        if end < r.n:
            if not r.pending_bootstrap:
                self.send_kv_chunk(r, last_chunk=False)
            return
        r.phase = "inflight"
        self.events.append({"server": self.name, "room": r.room, "event": "computed"})
        if not r.pending_bootstrap:
            self.send_kv_chunk(r, last_chunk=True)

    def send_kv_chunk(self, r: PReq, last_chunk: bool) -> None:
        """``Scheduler._send_kv_chunk`` on every rank: from the rank's ``start_send_idx`` (the
        decode prefix at first); a chunk that is not the last ends on a page boundary (its
        partial page waits); the last carries the DSA state indices after the decode prefix
        (``suffix_page_indices``) and the metadata row."""
        req_to_token = torch.as_tensor(np.repeat(r.pages, PAGE) * PAGE + np.tile(np.arange(PAGE), r.pages.size))[None]
        for i, (w, s, idx) in enumerate(zip(self.worlds, r.senders, r.meta_idx)):
            start, end = r.start_send_idx[i], min(r.extend_end, r.n)
            if not last_chunk:
                end -= end % PAGE
            if end < start:
                continue
            state = [suffix_page_indices(req_to_token, 0, r.decode_prefix[i], r.n, PAGE)] if last_chunk else None
            page_indices = kv_to_page_indices(req_to_token[0, start:end], PAGE)
            if last_chunk:  # a stage but the last holds no last hidden state: its row is not the room's
                last_stage = w.ranks.get("pp_rank", 0) == self.pp_size - 1
                w.meta.set_buf(metadata_req(r.room if last_stage else r.room ^ 1, idx))
            if s.should_send_kv_chunk(len(page_indices), last_chunk):
                s.send(page_indices, state, num_kv_tokens=end - start)
            r.start_send_idx[i] = end

    def process_inflight_queue(self) -> None:
        """``process_disagg_prefill_inflight_queue`` (``handle_pending_bootstrap`` for a request
        that prefilled before its bootstrap finished)."""
        queue = [r for r in self.reqs.values() if r.phase == "inflight"]
        for r, poll in zip(queue, self.inflight_polls(queue)):
            if r.pending_bootstrap:
                if poll == KVPoll.Failed:
                    self.finish(r, "Failed", self.failure(r))
                elif poll == KVPoll.WaitingForInput:
                    self.finalize_bootstrap(r)
                    self.send_kv_chunk(r, last_chunk=True)
            elif poll == KVPoll.Success:
                for s in r.senders:
                    s.clear()
                metrics = [vars(s.get_transfer_metric()) for s in r.senders]
                self.finish(r, "Success", "", metrics=metrics, prefix=list(r.decode_prefix))
            elif poll == KVPoll.Failed:
                self.finish(r, "Failed", self.failure(r))

    def failure(self, r: PReq) -> list[str]:
        """Every rank's ``failure_exception()`` (``handle_inflight_transfer_failure``)."""
        out = []
        for s in r.senders:
            try:
                s.failure_exception()
            except Exception as exc:  # SGLang catches what the backend raises
                out.append(f"{type(exc).__name__}: {exc}")
        return out

    def abort(self, room: int) -> None:
        """``Scheduler.abort_request``: every rank's sender aborts; a request still computing is
        retired (``_retire_aborted_prefill_result``), one in flight is polled to Failed."""
        r = self.reqs[room]
        for s in r.senders:
            s.abort()
        if r.phase == "running":
            self.finish(r, "Failed", self.failure(r))

    def finish(self, r: PReq, state: str, reasons: Any, **extra: Any) -> None:
        for w, idx in zip(self.worlds, r.meta_idx):
            w.meta_alloc.free(idx)
        r.meta_idx = []
        self.free.extend(r.pages.tolist())
        r.phase = "done"
        self.events.append({"server": self.name, "room": r.room, "event": "done", "state": state, "reasons": reasons,
                            **extra})


# -- decode ----------------------------------------------------------------------------------


@dataclass
class DReq:
    room: int
    n: int
    prefix: int
    addr: str
    receiver: Any
    rid: str = ""
    phase: str = "pending"  # pending | prealloc | transfer | done
    waiting_for_input: bool = False
    meta_idx: int = -1
    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prefix_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    held_polls: int = 0  # polls that read Transferring while kvbridge's room had already failed
    bootstrap_host: str = "127.0.0.1"  # for SGLang's _apply_metadata_gate (not a fake transfer)

    @property
    def req(self) -> DReq:  # _apply_metadata_gate reads decode_req.req.bootstrap_*
        return self

    @property
    def bootstrap_room(self) -> int:
        return self.room

    @property
    def metadata_buffer_index(self) -> int:
        return self.meta_idx


class DecodeServer:
    """One decode rank driven like ``Scheduler.process_decode_queue``: the prealloc queue
    (``_resolve_pending_reqs``, ``_update_handshake_waiters``, ``pop_preallocated``), then the
    transfer queue (``pop_transferred``)."""

    RETRY_S, MAX_RETRIES = 0.1, 300  # SGLang: 1 s and 15 (scheduling cycles); shorter here, as many seconds

    def __init__(self, name: str, world: RankWorld) -> None:
        self.name, self.w = name, world
        self.reqs: dict[int, DReq] = {}
        self.free = list(range(1, POOL_PAGES + 1))
        self.used: set[int] = set()  # pages ever handed to a transfer
        self.prefix_pages: set[int] = set()
        self.tries: dict[str, tuple[float, int]] = {}
        self.events: list[dict] = []

    def add(self, room: int, n: int, prefix: int, addr: str, tokens: np.ndarray | None = None) -> None:
        """``DecodePreallocQueue.add`` -> SGLang's own ``_create_receiver_and_enqueue`` (kvbridge's patch
        binds the receiver to ``tokens``: default ``prompt(room, n)``) -> ``_resolve_prefill_dp_rank``."""
        tokens = prompt(room, n) if tokens is None else tokens
        queue = SimpleNamespace(transfer_backend=disagg_utils.TransferBackend.KVBRIDGE, kv_manager=self.w.mgr,
                                queue=[])
        made = DecodePreallocQueue._create_receiver_and_enqueue(queue, sglang_req(room, addr, tokens), False)
        r = DReq(room, n, prefix, addr, made.kv_receiver)
        self.reqs[room] = r
        dp = self.resolve_prefill_dp_rank(r)
        if dp is not None:
            r.receiver.init(dp)
            r.phase = "prealloc"

    def resolve_prefill_dp_rank(self, r: DReq) -> int | None:
        info = self.w.mgr.prefill_info_table.get(r.addr)
        if info is None:
            return None
        if info.dp_size == 1:
            return 0
        return r.room % info.dp_size if info.follow_bootstrap_room else None

    def step(self) -> None:
        self.resolve_pending_reqs()
        self.update_handshake_waiters()
        self.pop_preallocated()
        self.pop_transferred()

    def resolve_pending_reqs(self) -> None:
        """``_resolve_pending_reqs`` / ``_ensure_prefill_info``: ``try_ensure_parallel_info(addr)``
        once per retry interval, a bounded number of times, then ``_init_receiver``."""
        for r in [r for r in self.reqs.values() if r.phase == "pending"]:
            last, count = self.tries.get(r.addr, (0.0, 0))
            if time.monotonic() - last < self.RETRY_S:
                continue
            if not self.w.mgr.try_ensure_parallel_info(r.addr):
                self.tries[r.addr] = (time.monotonic(), count + 1)
                if count + 1 >= self.MAX_RETRIES:
                    r.receiver.abort()
                    r.phase = "prealloc"  # the handshake poll reports the failure
                continue
            self.tries.pop(r.addr, None)
            r.receiver.init(self.resolve_prefill_dp_rank(r))
            r.phase = "prealloc"

    def update_handshake_waiters(self) -> None:
        queue = [r for r in self.reqs.values() if r.phase in ("pending", "prealloc")]
        for r, poll in zip(queue, min_poll([[int(r.receiver.poll()) for r in queue]])):
            if poll == KVPoll.WaitingForInput:
                r.waiting_for_input = True
            elif poll == KVPoll.Failed:
                self.finish(r, "Failed", self.failure(r))

    def pop_preallocated(self) -> None:
        """``pop_preallocated`` -> ``_pre_alloc`` -> ``_send_kv_metadata``: pages after the decode
        prefix (``kv_to_page_indices`` of ``req_to_token[prefix:len]``), the DSA state's
        ``suffix_page_indices``, ``decode_prefix_len``."""
        for r in [r for r in self.reqs.values() if r.phase == "prealloc" and r.waiting_for_input]:
            num_pages = kv_to_page_num(r.n, PAGE)
            first = r.prefix // PAGE if r.prefix % PAGE == 0 else -(-r.prefix // PAGE)
            taken = random.sample(self.free, num_pages)
            for p in taken:
                self.free.remove(p)
            r.prefix_pages, r.pages = np.array(taken[:first], np.int64), np.array(taken[first:], np.int64)
            for p in r.prefix_pages:  # the cached prefix: decode's own KV, a transfer must leave it alone
                for buf in self.w.buffers.values():
                    buf[p] = PREFIX_MARK
            for buf in self.w.buffers.values():  # poison again: a reused page must show a late write
                buf[r.pages] = SENTINEL_BYTE
            self.prefix_pages.update(r.prefix_pages.tolist())
            self.used.update(r.pages.tolist())
            all_pages = np.concatenate([r.prefix_pages, r.pages])
            req_to_token = torch.as_tensor(np.repeat(all_pages, PAGE) * PAGE + np.tile(np.arange(PAGE), num_pages))[None]
            r.meta_idx = self.w.meta_alloc.alloc()
            page_indices = kv_to_page_indices(req_to_token[0, r.prefix:r.n], PAGE).astype(np.int32)
            state = [suffix_page_indices(req_to_token, 0, r.prefix, r.n, PAGE)]
            r.receiver.send_metadata(page_indices, r.meta_idx, state, decode_prefix_len=r.prefix)
            r.phase = "transfer"

    def pop_transferred(self) -> None:
        """``DecodeTransferQueue.pop_transferred`` (with ``_poll_with_metadata_gate``)."""
        queue = [r for r in self.reqs.values() if r.phase == "transfer"]
        polls = [int(r.receiver.poll()) for r in queue]
        _apply_metadata_gate(polls, queue, self.w.meta)
        for r, poll in zip(queue, min_poll([polls])):
            handle = r.receiver._handle
            if poll == KVPoll.Transferring and handle is not None and int(handle.poll()) == KVPoll.Failed:
                r.held_polls += 1
            if poll == KVPoll.Failed:
                releasable = r.receiver.pages_releasable
                self.finish(r, "Failed", self.failure(r), releasable=releasable, held_polls=r.held_polls)
            elif poll == KVPoll.Success:
                errors = metadata_errors(self.w.meta.get_buf(r.meta_idx), r.room) + self.verify(r)
                r.receiver = None  # _commit_transfer_to_req drops it, keeping the checksum of the row
                checksum = self.w.meta.get_kv_checksum(r.meta_idx) if self.w.meta.kv_checksum is not None else None
                self.finish(r, "Success", "", errors=errors, checksum=checksum)

    def verify(self, r: DReq) -> list[str]:
        """Every byte of every pool and layer of the room; prefix pages still hold their marker."""
        errors = []
        first = r.prefix_pages.size
        for (pool, layer), buf in self.w.buffers.items():
            v = verify_pages(self.w.specs[pool], buf, r.room, layer, r.pages, r.n, first_page=first)
            if not v.ok:
                errors.append(v.first_error)
            if r.prefix_pages.size and not (buf[r.prefix_pages] == PREFIX_MARK).all():
                errors.append(f"room {r.room} pool {pool} layer {layer}: a prefix page was written")
        return errors

    def untouched(self) -> list[str]:
        """No byte outside the pages handed to transfers changed; prefix pages kept their marker."""
        errors = []
        for (pool, layer), buf in self.w.buffers.items():
            for p in range(buf.shape[0]):
                want = PREFIX_MARK if p in self.prefix_pages else SENTINEL_BYTE
                if p not in self.used and not (buf[p] == want).all():
                    errors.append(f"pool {pool} layer {layer} page {p} written outside any transfer")
        return errors

    def failure(self, r: DReq) -> list[str]:
        try:
            r.receiver.failure_exception()
        except Exception as exc:  # SGLang catches what the backend raises
            return [f"{type(exc).__name__}: {exc}"]
        return []

    def abort(self, room: int) -> None:
        """``Scheduler.abort_request``: the receiver aborts; its request keeps being polled."""
        self.reqs[room].receiver.abort()

    def finish(self, r: DReq, state: str, reasons: Any, **extra: Any) -> None:
        if r.meta_idx >= 0:
            self.w.meta.clear_slot(r.meta_idx)
            self.w.meta_alloc.free(r.meta_idx)
        self.free.extend(r.prefix_pages.tolist() + r.pages.tolist())  # freed the moment SGLang sees Failed
        r.phase = "done"
        self.events.append({"server": self.name, "room": r.room, "event": "done", "state": state, "reasons": reasons,
                            **extra})

"""Prefill's share of the pool kinds beyond paged KV (window, compressed, request state) in the
rooms: per write, the units of each kind pool that the write's chunk completes, planned beside
the chunk's pages (``kvbridge.layout.kinds``: ``chunk_extent``, ``lane_units``, ``plan_kind``).

    room of n tokens, chunks ending at t0 < t1 < ... < n      (PrefillRoom.chunk_tokens)
    write of chunk i to target T: per kind pool, chunk_extent(spec, n, t_{i-1}, t_i, last)
      window (paged)   the window's pages complete by t_i, on the room's page mapping (our local
                       pages, T's page ids): pages outside [n - W, n) never travel
      compressed       the pages of entries complete by t_i, on the pool's own units (the engine's
                       ``kind_units`` here, T's ``TransferRequest.kind_units`` there): an entry
                       of an incomplete window never travels
      state            the slot, with the last chunk only, from the owner of the last valid token
                       (the aux row's CP rank), beside the aux row (one write, one completion)
    the last write to T carries whatever the last chunk completes (``kind_last`` in its PagesDone)

What is refused, by name (docs/concepts.md, "Pool kinds in the rooms"): staged writes, layer
ranges (PP, layer-wise sends), heterogeneous TP, a decode prefix, decode ranks that do not say
the token count; under CP, compressed and ring-window pools (``check_kind_topology``).

Pure bookkeeping over plain data: the room machine's write book (``writes.py``) asks ``plan``
and puts the answer in the write it posts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbridge.errors import ConfigError, KVBridgeError, LayoutError, PageRangeError
from kvbridge.layout import BufferDesc, OwnerLanes, PoolSpec, TransferPlan
from kvbridge.layout.kinds import (check_kind_topology, chunk_extent, kind_specs, lane_units, needed_extent,
                                   own_units_pools, plan_kind, token_page_size)
from kvbridge.layout.pools import STATE, WINDOW
from kvbridge.transfer.channel import wire

__all__ = ["KindWrites", "check_kind_config", "token_page_size"]


def check_kind_config(specs: Mapping[str, PoolSpec], *, cp_size: int, lane_rule: str, pp_size: int,
                      staging: str, rank: str) -> None:
    """Refuse at construction, by name, what the rooms do not carry for the kind pools."""
    kinds = kind_specs(specs)
    if not kinds:
        return
    names = ", ".join(f"{n} ({s.kind})" for n, s in sorted(kinds.items()))
    if staging != "never":
        raise ConfigError(f"pools {names}: the rooms carry window, compressed and state pools on the direct path "
                          f"only; set staging 'never' (got {staging!r})", rank=rank, field="staging")
    if pp_size > 1:
        raise ConfigError(f"pools {names}: pipeline stages (pp_size {pp_size}) are not carried for window, "
                          "compressed and state pools", rank=rank, field="pp_size")
    try:
        check_kind_topology(list(kinds.values()), cp_size, lane_rule)
    except KVBridgeError as exc:
        raise ConfigError(exc.reason, rank=rank, field=exc.field or "cp_size") from None
    # (a paged window's page is a token page: the contract gives every token-paged pool one page
    # size, so its owner lane is the token page's)


@dataclass
class _Room:
    """One room's kind books: the engine's units, and per target how far its kinds were planned."""

    src: dict[str, np.ndarray] = field(default_factory=dict)  # pool -> our unit of each logical unit
    dst: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # target -> pool -> its units
    bufs: dict[str, list[BufferDesc]] = field(default_factory=dict)  # target -> its registered buffers
    done: dict[str, int] = field(default_factory=dict)  # target -> tokens whose units were planned
    later: set[str] = field(default_factory=set)  # window pools whose pages the engine gives later (None)
    held: dict[str, dict[str, int]] = field(default_factory=dict)  # target -> pool waiting for them -> from
    dst_own: dict[str, set[str]] = field(default_factory=dict)  # target -> window pools on its own pages
    last: set[str] = field(default_factory=set)  # targets the last chunk's units were planned for


class KindWrites:
    """The kind pools' share of each write of this prefill rank (module docstring)."""

    def __init__(self, specs: Mapping[str, PoolSpec], src_bufs: Sequence[BufferDesc], *, lanes: OwnerLanes,
                 cp_rank: int, tp_size: int, rank: str) -> None:
        self.specs = kind_specs(specs)
        self.page_size = token_page_size(specs)
        self.src_bufs = list(src_bufs)
        self.lanes = lanes
        self.cp_rank = cp_rank
        self.tp_size = tp_size
        self.rank = rank
        self.own = own_units_pools(self.specs)
        # paged windows the engine may put on pages of their own (an SWA pool beside the full KV)
        self.windows = sorted(n for n, sp in self.specs.items() if sp.kind == WINDOW and not sp.ring_stride)
        self.rooms: dict[int, _Room] = {}
        self._caps = {(d.pool, d.layer_id): d.capacity_pages for d in self.src_bufs}

    def __bool__(self) -> bool:
        return bool(self.specs)

    def _room(self, room: int) -> _Room:
        hit = self.rooms.get(room)
        if hit is None:
            hit = self.rooms[room] = _Room()
        return hit

    def forget(self, room: int) -> None:
        self.rooms.pop(room, None)

    # -- the engine's units ----------------------------------------------------------------

    def engine_units(self, room: int, units: Mapping[str, object]) -> None:
        """``KVSender.init(kind_units=)`` / ``send(kind_units=)``: our physical unit of each
        logical unit of the compressed, state and ring pools (a state pool: its one slot),
        checked inside our registered buffers (hard rule 5) before anything is kept. A paged
        window pool may be on pages of its own too (SGLang's SWA pool): its units are our pages
        of the window's pages, from the first; ``None`` says they come later (with the last
        chunk): until then no write carries that pool (its pages wait for their ids)."""
        ctx = dict(room=room, rank=self.rank)
        unknown = sorted(set(units) - set(self.own) - set(self.windows))
        if unknown:
            raise LayoutError(f"kind_units names {unknown}; the pools on units of their own are {self.own}, and "
                              f"paged windows {self.windows} may be", field="kind_units", **ctx)
        later = {pool for pool, ids in units.items() if ids is None}
        if later - set(self.windows):
            raise LayoutError(f"kind_units: None (units given later) for {sorted(later - set(self.windows))}; only "
                              "paged window pools may wait for theirs", field="kind_units", **ctx)
        self._room(room).later.update(later)
        checked = {}
        for pool, ids in units.items():
            if ids is None:
                continue
            arr = np.asarray(ids).reshape(-1)
            if arr.size and arr.dtype.kind not in "iu":
                raise LayoutError(f"kind_units[{pool!r}] must be integers, got {arr.dtype}", field="kind_units", **ctx)
            arr = arr.astype(np.int64)
            cap = min(self._caps[(pool, lid)] for lid in self.specs[pool].layer_ids)
            if arr.size and (arr.min() < 0 or arr.max() >= cap):
                raise PageRangeError(f"kind_units[{pool!r}] must lie in [0, {cap}) (registered capacity)",
                                     field="kind_units", **ctx)
            checked[pool] = arr
        self._room(room).src.update(checked)

    # -- a decode rank's request -----------------------------------------------------------

    def accept(self, req: wire.TransferRequest, dst_bufs: Sequence[BufferDesc], dst_pages: np.ndarray,
               num_tokens: int) -> None:
        """Check what ``req`` asks of the kind pools against what its decode rank registered
        (hard rule 5: every destination unit inside every registered buffer of its pool), and
        keep its units; raises KVBridgeError naming why (nothing was posted for it)."""
        ctx = dict(room=req.room, rank=req.decode_rank)
        asked = [p for p in req.pools if p in self.specs]
        if not asked:
            if req.kind_units:
                raise LayoutError(f"kind_units for pools {sorted(req.kind_units)} this request does not ask for",
                                  field="kind_units", **ctx)
            return
        if not req.num_tokens:
            raise LayoutError(f"pools {asked} are window, compressed or state pools: the request must say its token "
                              "count (num_tokens), which decides the window and the complete entries",
                              field="num_tokens", **ctx)
        if req.first_page:
            raise LayoutError(f"a decode prefix (first_page {req.first_page}) is not carried for window, compressed "
                              "and state pools", field="first_page", **ctx)
        if req.num_decode_ranks != self.tp_size:
            raise LayoutError(f"decode TP size {req.num_decode_ranks} differs from prefill's {self.tp_size}: "
                              f"heterogeneous TP is not carried for pools {asked}", field="num_decode_ranks", **ctx)
        own = [p for p in asked if p in self.own]
        windows = sorted(set(req.kind_units) & set(self.windows) & set(asked))
        fine = sorted(p for p in asked if p in self.windows and p not in windows
                      and self.specs[p].page_size != self.page_size)
        if fine:  # a window paging finer than the room's pages is on units of its own, never the room's pages
            raise LayoutError(f"window pools {fine} page finer than the room's {self.page_size}-token pages: the "
                              "request must hand their own units (kind_units)", field="kind_units", **ctx)
        if sorted(req.kind_units) != sorted(own + windows):
            raise LayoutError(f"kind_units names {sorted(req.kind_units)}; the pools asked on units of their own are "
                              f"{sorted(own)} (and paged windows may be)", field="kind_units", **ctx)
        caps: dict[str, int] = {}
        for d in dst_bufs:
            if d.pool in self.specs:
                caps[d.pool] = min(caps.get(d.pool, 1 << 62), d.capacity_pages)
        units = {}
        for pool in asked:
            spec, ext = self.specs[pool], needed_extent(self.specs[pool], num_tokens)
            if pool in self.own or pool in windows:
                ids = np.frombuffer(req.kind_units[pool], dtype="<i4").astype(np.int64)
                want = (1 if ext.count else 0) if spec.kind == STATE or spec.ring_stride else ext.count
                if ids.size != want:
                    raise LayoutError(f"kind_units[{pool!r}]: {ids.size} units for the {want} decode needs of "
                                      f"{num_tokens} tokens", field="kind_units", **ctx)
            else:  # a paged window: the window's pages on the room's mapping
                ids = dst_pages[ext.first:ext.stop]
            cap = caps.get(pool)
            if cap is None:
                raise LayoutError(f"decode rank registered no buffer of pool {pool!r}", field="pools", **ctx)
            reach = ids if not spec.ring_stride else ids * spec.ring_stride // spec.page_size + \
                (spec.ring_stride - 1) // spec.page_size
            if ids.size and (ids.min() < 0 or reach.max() >= cap):
                raise PageRangeError(f"pool {pool!r} ({spec.kind}): destination unit {int(ids.max())} outside the "
                                     f"{cap} its decode rank registered; nothing written", field="kind_units", **ctx)
            units[pool] = ids
        kr = self._room(req.room)
        kr.dst[req.decode_rank] = units
        kr.bufs[req.decode_rank] = [d for d in dst_bufs if d.pool in self.specs]
        kr.done[req.decode_rank] = 0
        kr.dst_own[req.decode_rank] = set(windows)

    def wants(self, room: int, decode_rank: str) -> bool:
        """Whether the target still waits for kind units (the last chunk's not planned yet)."""
        kr = self.rooms.get(room)
        return kr is not None and decode_rank in kr.dst and decode_rank not in kr.last

    # -- a write -----------------------------------------------------------------------------

    def plan(self, room: int, decode_rank: str, num_tokens: int, end: int, last: bool, local_of: np.ndarray,
             dst_pages: np.ndarray, owns_last: bool) -> tuple[TransferPlan | None, dict[str, bytes]]:
        """The kind units that tokens ``[done, end)`` complete for target ``decode_rank`` (``last``:
        the room's last chunk), planned (checked: hard rule 5) and what its report names; (None,
        {}) when it takes no kind pool. Raises KVBridgeError: the target fails, nothing of this
        write is posted."""
        kr = self.rooms.get(room)
        if kr is None or decode_rank not in kr.dst or decode_rank in kr.last:
            return None, {}
        done = kr.done[decode_rank]
        dst_bufs = kr.bufs[decode_rank]
        held = kr.held.setdefault(decode_rank, {})
        plans, report = [], {}
        for pool, dst in kr.dst[decode_rank].items():
            spec = self.specs[pool]
            if pool in kr.later and pool not in kr.src and not last:
                held.setdefault(pool, done)  # its pages' ids come later: plan them from here then
                continue
            ext = chunk_extent(spec, num_tokens, min(held.pop(pool, done), end), end, last)
            if not ext.count:
                continue
            final = needed_extent(spec, num_tokens)
            logical = lane_units(spec, ext, self.lanes, self.cp_rank, num_tokens, self.page_size)
            if spec.kind == STATE and not owns_last:
                continue  # (lane_units: the slot is the last valid token's owner's)
            if not len(logical):
                continue
            if pool in self.own:
                src_all = kr.src.get(pool)
                if src_all is None:
                    raise LayoutError(f"pool {pool!r} ({spec.kind}): the engine gave no kind_units for it "
                                      "(KVSender.init/send(kind_units=))", field="kind_units", room=room, rank=self.rank)
                if spec.kind == STATE or spec.ring_stride:
                    src, dst_u, subset = src_all[:1], dst, None
                else:
                    if logical.max() >= src_all.size:
                        raise LayoutError(f"pool {pool!r}: the engine's kind_units cover {src_all.size} units, the "
                                          f"write needs unit {int(logical.max())}", field="kind_units", room=room,
                                          rank=self.rank)
                    src, dst_u, subset = src_all[logical], dst[logical - final.first], logical
                if (spec.kind == STATE or spec.ring_stride) and not src.size:
                    raise LayoutError(f"pool {pool!r}: the engine gave no slot", field="kind_units", room=room,
                                      rank=self.rank)
            elif pool in kr.src or pool in kr.later:  # a paged window on pages of its own
                src_all = kr.src.get(pool)
                if src_all is None or src_all.size != final.count:
                    raise LayoutError(f"window pool {pool!r}: the engine's kind_units name "
                                      f"{0 if src_all is None else src_all.size} pages, the window of {num_tokens} "
                                      f"tokens is {final.count}", field="kind_units", room=room, rank=self.rank)
                src = src_all[logical - final.first]
                dst_u = dst[logical - final.first] if pool in kr.dst_own[decode_rank] else dst_pages[logical]
                subset = logical
            else:  # a paged window: our pages as handed in, the target's page ids
                if spec.page_size != self.page_size:
                    raise LayoutError(f"window pool {pool!r} pages finer than the room's {self.page_size}-token pages: "
                                      "the engine gave no kind_units for it", field="kind_units", room=room,
                                      rank=self.rank)
                src = local_of[logical]
                if (src < 0).any():
                    raise LayoutError(f"window pool {pool!r}: logical page {int(logical[src < 0][0])} is in the window "
                                      "but was not handed in by send()", field="logical_pages", room=room,
                                      rank=self.rank)
                dst_u = dst[logical - final.first] if pool in kr.dst_own[decode_rank] else dst_pages[logical]
                subset = logical
            plans.append(plan_kind(spec, self.src_bufs, dst_bufs, ext, src, dst_u, logical=subset, room=room,
                                   rank=self.rank))
            report[pool] = logical.astype("<i4").tobytes()
        kr.done[decode_rank] = max(done, end)
        if last:
            kr.last.add(decode_rank)
        plans = [p for p in plans if p.num_slices]
        return (TransferPlan.concat(plans) if plans else TransferPlan.empty()), report

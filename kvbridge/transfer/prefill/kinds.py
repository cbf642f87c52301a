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
      state            the slot, once, with the chunk that ends at the request's length n (the
                       last chunk at the latest), from the owner of the last valid token (the aux
                       row's CP rank in each pipeline stage)
    a write's units are reported once every layer of them landed; at full length: ``kind_last``

Layer ranges (layer-wise sends ``send(..., layers=(a, b))``, pipeline stages): the books are per
layer of each pool (the stage's layers only: a stage's specs are cut to them). A range carries
the layers of every kind pool that target layers ``[a, b)`` hold (the stage rule: a draft layer
with the range that ends at the last target layer), each layer's units as ``chunk_extent`` gives
them from that layer's own progress; a state layer travels with the range that holds it at the
request's full length. A unit is reported (``PagesDone.kind_units``) once every layer of it on
this rank landed, so decode counts units per pool and pipeline stage, whatever the ranges.

    V4, 4 layers, ranges (0,2) (2,4)    swa layers 0-3, hca 0-2, csa 3, hca_tail 0-2, csa_tail 3
    range (0, 2), ready t      swa/hca pages complete by t, layers 0-1; hca_tail layers 0-1 if t = n
    range (2, 4), ready t      swa 2-3, hca 2, csa 3 ...; hca page reported once layers 0-2 landed

Heterogeneous TP: a sharded state slot (Mamba conv groups, SSM heads) goes to each decode rank
the TP route draws it from (``kvbridge.layout.tp_route``), cut by ``state_slices``: the overlap
of our part of every shard group with the decode rank's; replicated slots, windows and
compressed entries come whole from the decode rank's first source.

Direct and staged writes alike (a staged write's plan is the same, its report names the same
units: ``writes.py``). What is refused, by name (docs/concepts.md, "Pool kinds in the rooms"):
head-sharded window or compressed pools across TP sizes, a decode prefix, decode ranks that do not
say the token count; under CP, compressed and ring-window pools (``check_kind_topology``). The
configuration's share is refused at construction (``transfer.registration.check_kind_config``).

Pure bookkeeping over plain data: the room machine's write book (``writes.py``) asks ``plan``
and puts the answer in the write it posts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvbridge.errors import LayoutError, PageRangeError
from kvbridge.layout import BufferDesc, OwnerLanes, PoolSpec, TransferPlan
from kvbridge.layout.kinds import (check_kind_topology, chunk_extent, kind_specs, lane_units, needed_extent,
                                   own_units_pools, plan_kind, state_tp_spec, token_page_size)
from kvbridge.layout.pools import STATE, WINDOW
from kvbridge.transfer.channel import wire

__all__ = ["KindWrite", "KindWrites", "token_page_size"]


@dataclass
class _Book:
    """One pool's books for one target, per layer of the pool on this rank (its ``layer_ids``
    order): tokens whose units were planned, whether the full length's were (a unit travels once
    per layer), and, per logical unit of the needed extent, the layers planned and landed: a
    unit is reported once every layer of it landed (a layer range carries some layers only)."""

    done: np.ndarray  # per layer: tokens whose units were planned
    fin: np.ndarray  # per layer: the units at the request's full length planned (nothing more to send)
    planned: np.ndarray  # [units, layers] posted to the target
    got: np.ndarray  # [units, layers] landed there
    reported: np.ndarray  # per unit: named in a report (once)
    first: int  # the needed extent's first logical unit


@dataclass
class _Room:
    """One room's kind books: the engine's units, and per target how far its kinds were planned."""

    src: dict[str, np.ndarray] = field(default_factory=dict)  # pool -> our unit of each logical unit
    dst: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # target -> pool -> its units
    bufs: dict[str, list[BufferDesc]] = field(default_factory=dict)  # target -> its registered buffers
    books: dict[str, dict[str, _Book]] = field(default_factory=dict)  # target -> pool -> its books
    later: set[str] = field(default_factory=set)  # window pools whose pages the engine gives later (None)
    dst_own: dict[str, set[str]] = field(default_factory=dict)  # target -> window pools on its own pages


@dataclass(frozen=True)
class KindWrite:
    """What one write carries of the kind pools: per pool, (logical units, layer indices) pairs
    (every layer of the pair's units), and whether they are at the request's full length."""

    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]]
    final: bool

    def __bool__(self) -> bool:
        return bool(self.parts)


class KindWrites:
    """The kind pools' share of each write of this prefill rank (module docstring)."""

    def __init__(self, specs: Mapping[str, PoolSpec], src_bufs: Sequence[BufferDesc], *, lanes: OwnerLanes,
                 cp_rank: int, tp_size: int, rank: str, num_target_layers: int | None = None,
                 tp_rank: int = 0) -> None:
        """``num_target_layers``: the model's target layer count (the contract's; default: one
        past the largest layer id of ``specs``), which places draft layers in a layer range."""
        self.specs = kind_specs(specs)
        self.num_target_layers = num_target_layers if num_target_layers is not None else 1 + max(
            (lid for sp in specs.values() for lid in sp.layer_ids), default=0)
        self.page_size = token_page_size(specs)
        self.src_bufs = list(src_bufs)
        self.lanes = lanes
        self.cp_rank = cp_rank
        self.tp_size = tp_size
        self.tp_rank = tp_rank
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
        if req.num_decode_ranks != self.tp_size:  # state slots are cut per TP size; the rest is whole rows
            sliced = [p for p in asked if self.specs[p].head_sharded]
            if sliced:
                raise LayoutError(f"decode TP size {req.num_decode_ranks} differs from prefill's {self.tp_size}: "
                                  f"head-sharded window or compressed pools {sliced} are not sliced across TP sizes",
                                  field="num_decode_ranks", **ctx)
        if req.want_digest and req.num_decode_ranks != self.tp_size:
            cut = [p for p in asked if self.specs[p].kind == STATE and self.specs[p].shard_units]
            if cut:  # a slot cut across TP sizes lands in pieces of another rank's slot: no unit digest covers it
                raise LayoutError(f"digests of sharded state pools {cut} across TP sizes ({self.tp_size} -> "
                                  f"{req.num_decode_ranks}) are not computed; turn verify_digest off",
                                  field="want_digest", **ctx)
        dst_bpp = {d.pool: d.bytes_per_page for d in dst_bufs if d.pool in self.specs}
        for pool in asked:
            spec = self.specs[pool]
            want = state_tp_spec(spec, req.num_decode_ranks).bytes_per_page if spec.kind == STATE \
                else spec.bytes_per_page
            if pool in dst_bpp and dst_bpp[pool] != want:
                raise LayoutError(f"pool {pool!r} ({spec.kind}): decode rank registered {dst_bpp[pool]} B per "
                                  f"{'slot' if spec.kind == STATE else 'page'}, a TP size of {req.num_decode_ranks} "
                                  f"holds {want} B", field="num_decode_ranks", **ctx)
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
        kr.dst_own[req.decode_rank] = set(windows)
        books = kr.books[req.decode_rank] = {}
        for pool, ids in units.items():
            spec, ext = self.specs[pool], needed_extent(self.specs[pool], num_tokens)
            nl = spec.num_layers
            books[pool] = _Book(np.zeros(nl, np.int64), np.zeros(nl, bool), np.zeros((ext.count, nl), bool),
                                np.zeros((ext.count, nl), bool), np.zeros(ext.count, bool), ext.first)

    def wants(self, room: int, decode_rank: str) -> bool:
        """Whether the target still waits for kind units to be planned (some layer of some pool
        not yet at the request's full length)."""
        kr = self.rooms.get(room)
        return kr is not None and decode_rank in kr.books and any(
            not b.fin.all() for b in kr.books[decode_rank].values())

    def settled(self, room: int, decode_rank: str) -> bool:
        """Nothing of the kinds left for the target: every unit planned, and every one planned landed."""
        kr = self.rooms.get(room)
        if kr is None or decode_rank not in kr.books:
            return True
        return all(b.fin.all() and (b.planned == b.got).all() for b in kr.books[decode_rank].values())

    def range_layers(self, pool: str, layers: tuple[int, int] | None) -> np.ndarray:
        """Indices (into the pool's ``layer_ids``) of the layers target layers ``layers`` carry: the
        stage rule (``kvbridge.layout.stages``: a draft layer with the range that ends at the last
        target layer); None: all of them."""
        ids = np.asarray(self.specs[pool].layer_ids, dtype=np.int64)
        if layers is None:
            return np.arange(ids.size)
        start, end = layers
        inside = (ids >= start) & (ids < end)
        if end >= self.num_target_layers:
            inside |= ids >= self.num_target_layers
        return np.flatnonzero(inside)

    # -- a write -----------------------------------------------------------------------------

    def plan(self, room: int, decode_rank: str, num_tokens: int, end: int, last: bool, local_of: np.ndarray,
             dst_pages: np.ndarray, owns_last: bool, layers: tuple[int, int] | None = None, *,
             decode_tp: tuple[int, int] = (1, 0)) -> tuple[TransferPlan | None, KindWrite]:
        """The kind units that tokens ``[done, end)`` complete for target ``decode_rank``, of the
        layers that target layers ``layers`` carry (None: every layer), planned (checked: hard rule
        5), and what the write carries (``KindWrite``, for ``landed``). ``last``: the room's last
        chunk; a chunk that ends at the request's length is final too: it completes every unit of
        its layers, state included (docs/concepts.md, "Layer ranges"). ``owns_last``: this CP rank
        owns the last valid token (in its pipeline stage): it sends the state slots.
        ``decode_tp``: the target's (tp_size, tp_rank): a sharded state slot sends the target its
        overlap with ours (``state_slices``), a replicated one whole (the TP route picked us). Raises
        KVBridgeError: the target fails, nothing of this write is posted."""
        final = last or end == num_tokens
        kr = self.rooms.get(room)
        if kr is None or decode_rank not in kr.books:
            return None, KindWrite({}, final)
        dst_bufs = kr.bufs[decode_rank]
        books = kr.books[decode_rank]
        plans, parts = [], {}
        for pool, dst in kr.dst[decode_rank].items():
            spec, b = self.specs[pool], books[pool]
            sel = self.range_layers(pool, layers)
            sel = sel[~b.fin[sel]]
            if not sel.size:
                continue
            if pool in kr.later and pool not in kr.src and not last:
                continue  # its pages' ids come later: their units wait (this pool's done stays)
            for done in np.unique(b.done[sel]).tolist():
                group = sel[b.done[sel] == done]
                ext = chunk_extent(spec, num_tokens, min(done, end), end, final)
                if not ext.count or (spec.kind == STATE and not owns_last):
                    continue  # (lane_units: a state slot is the last valid token's owner's)
                logical = lane_units(spec, ext, self.lanes, self.cp_rank, num_tokens, self.page_size)
                if not len(logical):
                    continue
                src, dst_u, subset = self._units(kr, room, decode_rank, pool, spec, logical, dst, local_of,
                                                 dst_pages, num_tokens)
                cut = spec if group.size == spec.num_layers else \
                    replace(spec, layer_ids=tuple(spec.layer_ids[i] for i in group.tolist()))
                tp, dst_spec = (1, 0, 1, 0), None
                if spec.kind == STATE and spec.shard_units:
                    tp = (self.tp_size, self.tp_rank, *decode_tp)
                    dst_spec = replace(state_tp_spec(spec, decode_tp[0]), layer_ids=cut.layer_ids)
                plans.append(plan_kind(cut, self.src_bufs, dst_bufs, ext, src, dst_u, dst_spec=dst_spec, tp=tp,
                                       logical=subset, room=room, rank=self.rank))
                parts.setdefault(pool, []).append((logical, group))
            b.done[sel] = np.maximum(b.done[sel], end)
            if final:
                b.fin[sel] = True
        for pool, pairs in parts.items():  # (after every plan: a refused one marks nothing)
            b = books[pool]
            for logical, group in pairs:
                b.planned[np.ix_(logical - b.first, group)] = True
        plans = [p for p in plans if p.num_slices]
        return (TransferPlan.concat(plans) if plans else TransferPlan.empty()), KindWrite(parts, final)

    def landed(self, room: int, decode_rank: str, write: KindWrite) -> tuple[dict[str, bytes], bool]:
        """A write's kind units reached the target: the units whose every layer (on this rank) has
        now landed, once each, packed for its ``PagesDone``, and whether they are at the full length."""
        kr = self.rooms.get(room)
        if kr is None or decode_rank not in kr.books or not write:
            return {}, False
        report = {}
        for pool, pairs in write.parts.items():
            b = kr.books[decode_rank][pool]
            touched = np.unique(np.concatenate([logical for logical, _ in pairs])) - b.first
            for logical, group in pairs:
                b.got[np.ix_(logical - b.first, group)] = True
            whole = touched[b.got[touched].all(axis=1) & ~b.reported[touched]]
            if whole.size:
                b.reported[whole] = True
                report[pool] = (whole + b.first).astype("<i4").tobytes()
        return report, write.final

    def src_units(self, room: int, pool: str, logical: np.ndarray, local_of: np.ndarray,
                  num_tokens: int) -> np.ndarray:
        """Our units holding ``logical`` units of ``pool`` (a state or ring pool: its one slot or
        row), as a write planned them: what a report's digests read (``SendDigested``)."""
        kr, spec = self.rooms[room], self.specs[pool]
        if pool in self.own:
            src_all = kr.src[pool]
            return src_all[:1] if spec.kind == STATE or spec.ring_stride else src_all[logical]
        if pool in kr.src:  # a paged window on pages of its own: the window's pages, from the first
            return kr.src[pool][logical - needed_extent(spec, num_tokens).first]
        return local_of[logical]

    def _units(self, kr: _Room, room: int, decode_rank: str, pool: str, spec: PoolSpec, logical: np.ndarray,
               dst: np.ndarray, local_of: np.ndarray, dst_pages: np.ndarray,
               num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Our units, the target's, and the logical subset (None: a slot) of ``logical``."""
        final = needed_extent(spec, num_tokens)
        if pool in self.own:
            src_all = kr.src.get(pool)
            if src_all is None:
                raise LayoutError(f"pool {pool!r} ({spec.kind}): the engine gave no kind_units for it "
                                  "(KVSender.init/send(kind_units=))", field="kind_units", room=room, rank=self.rank)
            if spec.kind == STATE or spec.ring_stride:
                if not src_all.size:
                    raise LayoutError(f"pool {pool!r}: the engine gave no slot", field="kind_units", room=room,
                                      rank=self.rank)
                return src_all[:1], dst, None
            if logical.max() >= src_all.size:
                raise LayoutError(f"pool {pool!r}: the engine's kind_units cover {src_all.size} units, the "
                                  f"write needs unit {int(logical.max())}", field="kind_units", room=room,
                                  rank=self.rank)
            return src_all[logical], dst[logical - final.first], logical
        if pool in kr.src or pool in kr.later:  # a paged window on pages of its own
            src_all = kr.src.get(pool)
            if src_all is None or src_all.size != final.count:
                raise LayoutError(f"window pool {pool!r}: the engine's kind_units name "
                                  f"{0 if src_all is None else src_all.size} pages, the window of {num_tokens} "
                                  f"tokens is {final.count}", field="kind_units", room=room, rank=self.rank)
            src = src_all[logical - final.first]
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
        return src, dst_u, logical

"""Turning a decode rank's TransferRequest into a checked :class:`Target`.

Everything about the destination is checked here, before any write is posted
(hard rule 5): the page mapping covers exactly the request's pages, every
destination page lies inside every destination buffer it will be written to,
buffers pair by (pool, layer id) with equal page sizes (hard rule 8), and the
aux slot lies inside the registered aux rows. A bad request fails its target
with the reason; nothing is written.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from kvbridge.errors import LayoutError, PageRangeError
from kvbridge.layout import AuxSchema, BufferDesc, PoolSpec
from kvbridge.layout.plan import PairedBuffers, pair_buffers
from kvbridge.transfer import wire
from kvbridge.transfer.sender import Target


class DestinationCache:
    """Each decode peer's destination buffers, parsed and paired with ours once: a decode
    rank's registered buffers do not change while it lives, so every later request from
    it skips the per-buffer work (bounded, least recently used first out)."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple[list[BufferDesc], PairedBuffers]] = OrderedDict()

    def lookup(self, req: wire.TransferRequest, specs: Mapping[str, PoolSpec], src_bufs: Sequence[BufferDesc],
               pools: tuple[str, ...]) -> tuple[list[BufferDesc], PairedBuffers]:
        key = (req.decode_rank, req.session, pools, tuple(map(tuple, req.buffers)))
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit
        dst_bufs = [BufferDesc.from_list(b) for b in req.buffers]
        paired = pair_buffers(specs, src_bufs, dst_bufs, pools, room=req.room, rank=req.decode_rank)
        self._entries[key] = (dst_bufs, paired)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return dst_bufs, paired


def target_from_request(
    req: wire.TransferRequest,
    ident: bytes,
    specs: Mapping[str, PoolSpec],
    src_bufs: Sequence[BufferDesc],
    aux_schema: AuxSchema,
    num_pages: int,
    cache: DestinationCache,
) -> Target:
    ctx = dict(room=req.room, rank=req.decode_rank)
    pools = tuple(req.pools)
    unknown = [p for p in pools if p not in specs]
    if unknown or not pools or len(set(pools)) != len(pools):
        raise LayoutError(f"decode asked for pools {list(pools)}; this rank has {sorted(specs)}", field="pools", **ctx)
    dst_pages = wire.unpack_pages(req.page_ids).astype(np.int64)
    if dst_pages.size != num_pages:
        raise LayoutError(f"{dst_pages.size} destination pages for a request of {num_pages} pages "
                          f"({req.num_tokens} tokens)", field="page_ids", **ctx)
    dst_bufs, paired = cache.lookup(req, specs, src_bufs, pools)  # PairingError: missing layer, page sizes
    lo, hi = (int(dst_pages.min()), int(dst_pages.max())) if dst_pages.size else (0, -1)
    if lo < 0 or hi >= paired.min_dst_capacity:
        bad = lo if lo < 0 else hi
        for spec, _, _, _, dst_cap in paired.pairs:  # name the first buffer the page falls outside of
            for layer, cap in zip(spec.layer_ids, dst_cap.tolist()):
                if bad < 0 or bad >= cap:
                    raise PageRangeError(f"destination page {bad} outside pool {spec.name!r} layer {layer}'s "
                                         f"{cap} registered pages; nothing written", field="page_ids", **ctx)
    aux_addr = None
    if req.aux_capacity:
        if req.aux_row_bytes != aux_schema.row_bytes:
            raise LayoutError(f"decode aux rows of {req.aux_row_bytes} B, this rank's schema has {aux_schema.row_bytes} B",
                              field="aux_row_bytes", **ctx)
        if not 0 <= req.aux_slot < req.aux_capacity:
            raise PageRangeError(f"aux slot {req.aux_slot} outside the {req.aux_capacity} registered aux rows",
                                 field="aux_slot", **ctx)
        aux_addr = req.aux_base + req.aux_slot * req.aux_row_bytes
    deadline = time.monotonic() + (req.deadline_ms / 1000.0 if req.deadline_ms > 0 else 3600.0)
    return Target(decode_rank=req.decode_rank, ident=ident, session=req.session, dst_pages=dst_pages,
                  dst_bufs=dst_bufs, pools=pools, aux_addr=aux_addr, deadline=deadline, want_digest=req.want_digest,
                  paired=paired)

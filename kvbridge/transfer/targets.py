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
from collections.abc import Mapping, Sequence

import numpy as np

from kvbridge.errors import LayoutError, PageRangeError, PairingError
from kvbridge.layout import AuxSchema, BufferDesc, PoolSpec
from kvbridge.transfer import wire
from kvbridge.transfer.sender import Target


def target_from_request(
    req: wire.TransferRequest,
    ident: bytes,
    specs: Mapping[str, PoolSpec],
    src_bufs: Sequence[BufferDesc],
    aux_schema: AuxSchema,
    num_pages: int,
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
    dst_bufs = [BufferDesc.from_list(b) for b in req.buffers]
    dst_index = {(d.pool, d.layer_id): d for d in dst_bufs}
    if len(dst_index) != len(dst_bufs):
        raise PairingError("destination lists a (pool, layer id) twice", field="buffers", **ctx)
    src_index = {(d.pool, d.layer_id): d for d in src_bufs}
    lo, hi = (int(dst_pages.min()), int(dst_pages.max())) if dst_pages.size else (0, -1)
    for pool in pools:
        for layer in specs[pool].layer_ids:
            d = dst_index.get((pool, layer))
            if d is None:
                raise PairingError(f"destination has no buffer for pool {pool!r} layer {layer}", field="buffers", **ctx)
            if d.bytes_per_page != src_index[(pool, layer)].bytes_per_page:
                raise PairingError(f"pool {pool!r} layer {layer}: destination pages of {d.bytes_per_page} B, "
                                   f"source pages of {src_index[(pool, layer)].bytes_per_page} B", field="bytes_per_page", **ctx)
            if lo < 0 or hi >= d.capacity_pages:
                bad = lo if lo < 0 else hi
                raise PageRangeError(f"destination page {bad} outside pool {pool!r} layer {layer}'s "
                                     f"{d.capacity_pages} registered pages; nothing written", field="page_ids", **ctx)
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
                  dst_bufs=dst_bufs, pools=pools, aux_addr=aux_addr, deadline=deadline, want_digest=req.want_digest)

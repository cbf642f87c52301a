"""One rank's pools of every kind for model mode (torch buffers on the CPU), the physical units
of one request in them, and one prefill chunk's share sent through a transfer engine. The
model-specific modules (``v4.py``, ``hybrid.py``) write a transformers cache into them and
rebuild one from them. Only kvbridge's public API is used."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

import kvbridge as kvb

__all__ = ["KindPools", "send_chunk"]


class KindPools:
    """One rank's pools (``capacity`` units of each), for one request at a time: ``units[pool]``
    are the physical units (pages, or one slot) of the request's logical units, from logical
    unit ``first[pool]`` on."""

    def __init__(self, specs: Mapping[str, kvb.PoolSpec], capacity: int, fill: int = 0) -> None:
        self.specs = dict(specs)
        self.buffers = {
            (name, lid): torch.full((capacity * spec.bytes_per_page,), fill, dtype=torch.uint8)
            for name, spec in self.specs.items() for lid in spec.layer_ids
        }
        self.units: dict[str, np.ndarray] = {}
        self.first: dict[str, int] = {}  # the logical unit of units[pool][0]

    def descs(self) -> list[Any]:
        """The buffers as a peer sees them (``BufferDesc``)."""
        return [kvb.describe_buffer(self.specs[name], lid, buf.view(getattr(torch, self.specs[name].abi)))
                for (name, lid), buf in sorted(self.buffers.items())]

    def regions(self) -> list[tuple[int, int]]:
        return [(buf.data_ptr(), buf.numel()) for _, buf in sorted(self.buffers.items())]

    def allocate(self, num_tokens: int, *, needed: bool, order: str = "ascending", base: int = 0) -> None:
        """Physical units for a request of ``num_tokens``: prefill every logical unit it writes,
        decode (``needed``) only the units of what it needs (``kvbridge.needed_extent``: the
        window's pages, the complete entries' pages, the slot); ascending or reversed."""
        self.units, self.first = {}, {}
        for name, spec in self.specs.items():
            ext = kvb.needed_extent(spec, num_tokens)
            if needed or spec.kind == "state":
                first, count = ext.first, ext.count
            else:
                rows = num_tokens // spec.ratio if spec.kind == "compressed" else num_tokens
                first, count = 0, -(-rows // spec.page_size)
            ids = np.arange(base, base + count, dtype=np.int64)
            self.units[name] = ids[::-1].copy() if order == "reversed" else ids
            self.first[name] = first

    # --- rows <-> pages ------------------------------------------------------------------------------------

    def page_rows(self, name: str, lid: int) -> torch.Tensor:
        spec = self.specs[name]
        return self.buffers[(name, lid)].view(-1, spec.page_size, spec.bytes_per_token)

    def put(self, name: str, lid: int, first: int, rows: torch.Tensor) -> None:
        """Rows (any float tensor, ``[k, width]``) of logical positions ``first..first+k-1``."""
        if not len(rows):
            return
        spec = self.specs[name]
        pos = np.arange(first, first + len(rows))
        pages = self.units[name][pos // spec.page_size - self.first[name]]
        data = rows.contiguous().view(torch.uint8).reshape(len(rows), -1)
        self.page_rows(name, lid)[torch.from_numpy(pages), torch.from_numpy(pos % spec.page_size)] = data

    def get(self, name: str, lid: int, first: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        spec = self.specs[name]
        pos = np.arange(first, first + count)
        pages = self.units[name][pos // spec.page_size - self.first[name]]
        rows = self.page_rows(name, lid)[torch.from_numpy(pages), torch.from_numpy(pos % spec.page_size)]
        return rows.contiguous().view(dtype)

    def slot(self, name: str, lid: int) -> torch.Tensor:
        spec = self.specs[name]
        slot = int(self.units[name][0])
        return self.buffers[(name, lid)][slot * spec.bytes_per_page : (slot + 1) * spec.bytes_per_page]


def send_chunk(src: KindPools, dst: KindPools, engine: Any, session: str, num_tokens: int, done: int, end: int,
               last: bool, lanes: Any = None, cp_rank: int = 0, token_page_size: int = 1,
               reports: list | None = None) -> int:
    """Plan and write one prefill chunk's share of every pool (``kvbridge.chunk_extent``: each
    unit once, state with the last chunk) from ``src`` into ``dst`` through ``engine``; with
    ``lanes`` (``kvbridge.OwnerLanes``) only what CP rank ``cp_rank`` owns
    (``kvbridge.lane_units``). Returns the bytes written; ``reports`` gets ``(pool, logical
    units, last)`` per pool written, what a prefill rank reports to decode's ledger."""
    src_descs, dst_descs = src.descs(), dst.descs()
    total = 0
    for name, spec in src.specs.items():
        ext = kvb.chunk_extent(spec, num_tokens, done, end, last)
        if not ext.count:
            continue
        if spec.kind == "state":
            if lanes is not None and not len(kvb.lane_units(spec, ext, lanes, cp_rank, num_tokens, token_page_size)):
                continue
            plan = kvb.plan_kind(spec, src_descs, dst_descs, ext, src.units[name], dst.units[name])
            logical = np.arange(ext.first, ext.stop)
        else:  # each side's units start at its own first logical unit
            logical = np.arange(ext.first, ext.stop) if lanes is None else \
                kvb.lane_units(spec, ext, lanes, cp_rank, num_tokens, token_page_size)
            plan = kvb.plan_kind(spec, src_descs, dst_descs, ext, src.units[name][logical - src.first[name]],
                                 dst.units[name][logical - dst.first[name]], logical=logical)
        if plan.num_slices:
            engine.write(session, plan.src, plan.dst, plan.length)
            total += plan.num_bytes
        if reports is not None and len(logical):
            reports.append((name, logical, last))
    return total

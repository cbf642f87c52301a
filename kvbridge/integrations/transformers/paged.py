"""Paged pools on one rank, and the cache I/O between them and a model.

A pool's storage is one tensor ``[layers, pages, page_size, row_elems]`` in the
model's dtype; the buffer of (pool, layer id) is its slice ``[i]``, contiguous
and page-major, so it can be registered with a transfer engine as it is. A cache
slot is ``physical_page * page_size + offset``; reads and writes index all
layers of a pool at once (one ``index_put`` per pool per step, no loop over pages).

A prefill CP rank stores only the rows of the logical pages it owns
(``OwnerLanes``): request by request in batch order, owned rows in token order
(rank-local order, hard rule 2), at its own local page table. Chunked prefill
writes each chunk's rows as they appear, so a page cut by a chunk boundary is
filled in two steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

import kvbridge as kvb
from kvbridge.integrations.transformers.geometry import TORCH_DTYPES, CacheGeometry, layer_rows

SRC_STALE = 0xC3  # prefill pool bytes no row was written to
DST_POISON = 0x55  # decode pool before any transfer


class PageAllocator:
    """Hands out free physical pages in random order, as an engine's allocator
    does after a while of churn (seeded, so a run can be replayed)."""

    def __init__(self, capacity: int, seed: int = 0) -> None:
        self.capacity = capacity
        self._free = list(np.random.default_rng(seed).permutation(capacity))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> np.ndarray:
        if not self.can_allocate(n):
            raise kvb.PageRangeError(f"{n} pages asked, {len(self._free)} of {self.capacity} free", field="pages")
        pages, self._free = self._free[:n], self._free[n:]
        return np.array(pages, dtype=np.int64)

    def free(self, pages: np.ndarray) -> None:
        self._free.extend(int(p) for p in pages)


class PagedKV:
    """The registered paged pools of one rank, filled with ``fill`` bytes."""

    def __init__(
        self,
        specs: Mapping[str, kvb.PoolSpec],
        capacity_pages: int,
        *,
        device: str | torch.device = "cpu",
        fill: int = DST_POISON,
    ) -> None:
        self.specs = dict(specs)
        self.capacity_pages = capacity_pages
        self._store: dict[str, torch.Tensor] = {}
        for name, spec in self.specs.items():
            if spec.layout != "rows":
                raise kvb.LayoutError(
                    f"pool {name!r}: model mode pages the rows layout, not {spec.layout}", field="layout"
                )
            if spec.abi not in TORCH_DTYPES:
                raise kvb.LayoutError(
                    f"pool {name!r}: model mode stores {tuple(TORCH_DTYPES)}, not {spec.abi}", field="abi"
                )
            dtype = TORCH_DTYPES[spec.abi]
            elems = spec.bytes_per_token // torch.empty(0, dtype=dtype).element_size()
            store = torch.empty((spec.num_layers, capacity_pages, spec.page_size, elems), dtype=dtype, device=device)
            store.view(torch.uint8).fill_(fill)
            self._store[name] = store

    def buffers(self) -> dict[tuple[str, int], torch.Tensor]:
        """One page-major buffer per (pool, layer id), to register."""
        return {(n, lid): self._store[n][i] for n, spec in self.specs.items() for i, lid in enumerate(spec.layer_ids)}

    def slot_view(self, pool: str) -> torch.Tensor:
        """``[layers, slots, row_elems]`` of a pool (a view)."""
        store = self._store[pool]
        return store.view(store.shape[0], -1, store.shape[-1])

    def byte_view(self, pool: str) -> torch.Tensor:
        """``[layers, slots, row_bytes]`` uint8 of a pool (a view)."""
        return self.slot_view(pool).view(torch.uint8)

    def write(self, pool: str, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows ``[layers, n, row_elems]`` of every layer of ``pool`` into ``slots``."""
        view = self.slot_view(pool)
        self._check_slots(pool, slots)
        view[:, slots.to(view.device)] = rows.to(device=view.device, dtype=view.dtype)

    def read(self, pool: str, slots: torch.Tensor) -> torch.Tensor:
        """Rows ``[layers, n, row_elems]`` of every layer of ``pool`` at ``slots``."""
        view = self.slot_view(pool)
        self._check_slots(pool, slots)
        return view[:, slots.to(view.device)]

    def page_view(self, pool: str) -> torch.Tensor:
        """``[layers, pages, page_bytes]`` uint8 of a pool (a view)."""
        store = self._store[pool]
        return store.view(torch.uint8).view(store.shape[0], store.shape[1], -1)

    def fill_pages(self, pages: np.ndarray, fill: int) -> None:
        """Every byte of physical ``pages`` in every pool and layer becomes ``fill`` (poisoning
        pages a room gave back, so the next room's checks see any late or stray write)."""
        index = torch.as_tensor(np.asarray(pages, dtype=np.int64))
        for pool in self.specs:
            view = self.page_view(pool)
            view[:, index.to(view.device)] = fill

    def first_unfilled(self, pages: np.ndarray, fill: int, tokens: int = 0) -> str | None:
        """``None`` when every byte of ``pages`` (physical, in logical order) past the first
        ``tokens`` rows of the request still holds ``fill``; else where the first one does not."""
        pages = np.asarray(pages, dtype=np.int64)
        for pool, spec in self.specs.items():
            view = self.byte_view(pool)
            slots = (pages[:, None] * spec.page_size + np.arange(spec.page_size)).reshape(-1)[tokens:]
            rest = view[:, torch.as_tensor(slots).to(view.device)].cpu()
            bad = (rest != fill).nonzero()
            if len(bad):
                layer, k, byte = (int(x) for x in bad[0])
                slot = int(slots[k])
                return (f"pool {pool!r} layer {spec.layer_ids[layer]} page {slot // spec.page_size} row "
                        f"{slot % spec.page_size} byte {byte} is {int(rest[layer, k, byte]):#04x}, expected "
                        f"untouched {fill:#04x}")
        return None

    def _check_slots(self, pool: str, slots: torch.Tensor) -> None:
        num_slots = self.capacity_pages * self.specs[pool].page_size
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
            raise kvb.PageRangeError(f"pool {pool!r}: a slot is outside {num_slots} slots", field="slots")


def slots_of(page_table: np.ndarray | Sequence[int], positions: np.ndarray, page_size: int) -> torch.Tensor:
    """Cache slots of token ``positions`` of a request whose logical page ``l``
    is physical page ``page_table[l]``."""
    table = np.asarray(page_table, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    if len(positions) and int(positions.max()) // page_size >= len(table):
        raise kvb.LayoutError(
            f"token {int(positions.max())} is on logical page {int(positions.max()) // page_size}; "
            f"the page table maps {len(table)} pages",
            field="page_table",
        )
    return torch.from_numpy(table[positions // page_size] * page_size + positions % page_size)


@dataclass
class ChunkKV:
    """What request ``index`` added to its cache in one prefill step: tokens
    ``[start, stop)``; ``layers[layer_id]`` is that layer's ``(keys, values)``
    for those tokens (target layers, then draft layers)."""

    index: int
    start: int
    stop: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]


class RankWriter:
    """What one prefill CP rank stores: of every request, the rows of the
    logical pages it owns, at physical pages of its local page table."""

    def __init__(self, geom: CacheGeometry, paged: PagedKV, lanes: kvb.OwnerLanes, cp_rank: int) -> None:
        self.geom, self.paged, self.lanes, self.cp_rank = geom, paged, lanes, cp_rank
        self.page_size = next(iter(paged.specs.values())).page_size
        self._requests: dict[int, tuple[int, np.ndarray]] = {}

    def local_pages_needed(self, num_tokens: int) -> int:
        return self.lanes.num_local_pages(self.cp_rank, -(-num_tokens // self.page_size))

    def add_request(self, index: int, num_tokens: int, local_table: np.ndarray) -> None:
        """``local_table[i]`` is the physical page of this rank's local page ``i``."""
        need = self.local_pages_needed(num_tokens)
        if len(local_table) < need:
            raise kvb.LayoutError(
                f"request {index}: {len(local_table)} local pages for the {need} this rank stores",
                rank=self.cp_rank,
                field="local_table",
            )
        self._requests[index] = (num_tokens, np.asarray(local_table, dtype=np.int64))

    def owned_pages(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(logical pages, physical pages)`` of request ``index`` that this
        rank owns and sends, ascending: what a sender's ``send`` takes."""
        num_tokens, table = self._requests[index]
        num_pages = -(-num_tokens // self.page_size)
        logical = self.lanes.owned_pages(self.cp_rank, num_pages)
        _, local = self.lanes.owners(logical, num_pages)
        return logical, table[local]

    def write(self, step: Sequence[ChunkKV]) -> int:
        """Store the owned rows of one prefill step of the batch (rank-local
        order); returns the number of rows written per layer."""
        picks, slots = [], []
        for chunk in step:
            num_tokens, table = self._requests[chunk.index]
            positions = np.arange(chunk.start, chunk.stop, dtype=np.int64)
            owner, local = self.lanes.owners(positions // self.page_size, -(-num_tokens // self.page_size))
            mine = owner == self.cp_rank
            picks.append((chunk, torch.from_numpy(np.flatnonzero(mine))))
            slots.append(table[local[mine]] * self.page_size + positions[mine] % self.page_size)
        if not picks:
            return 0
        flat_slots = torch.from_numpy(np.concatenate(slots))
        for pool, spec in self.paged.specs.items():
            parts = []
            for chunk, idx in picks:
                if len(chunk.layers) <= max(spec.layer_ids):
                    raise kvb.LayoutError(
                        f"request {chunk.index} produced {len(chunk.layers)} layers, pool {pool!r} needs "
                        f"layers {spec.layer_ids}",
                        rank=self.cp_rank,
                        field="layer_ids",
                    )
                layers = [layer_rows(self.geom, lid, *chunk.layers[lid])[pool] for lid in spec.layer_ids]
                parts.append(torch.stack(layers)[:, idx])
            self.paged.write(pool, torch.cat(parts, dim=1), flat_slots)
        return len(flat_slots)

"""Owner lanes: which CP rank holds (and sends) each logical page of a request.

With ``cp_size = 3`` and 8 logical pages:

    interleaved   owner  0 1 2 0 1 2 0 1      owner = l % cp,  local = l // cp
                  local  0 0 0 1 1 1 2 2
    contiguous    owner  0 0 0 1 1 1 2 2      chunk = ceil(num_pages / cp)
                  local  0 1 2 0 1 2 0 1      owner = l // chunk,  local = l % chunk
    balanced      owner  0 0 0 1 1 1 2 2      base = num_pages // cp, rem = num_pages % cp:
                  local  0 1 2 0 1 2 0 1      ranks < rem hold base + 1 pages, the others base
    replicated    owner  0 0 0 0 0 0 0 0      every rank stores every page (local = l);
                  local  0 1 2 3 4 5 6 7      rank 0 is the one that sends them

``contiguous`` and ``balanced`` both give each rank one run of pages and differ
only in the sizes: with 4 pages over 3 ranks, ``contiguous`` gives 2 2 0 and
``balanced`` 2 1 1 (SGLang's split when all CP ranks transfer).

``owned_pages`` is what a rank *sends*; ``num_local_pages`` is what it *stores*
(they differ only for ``replicated``, where ranks 1.. store pages they do not send).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import LayoutError

INTERLEAVED = "interleaved"
CONTIGUOUS = "contiguous"
# SGLang's all-CP-ranks transfer mode (SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER):
# sglang.srt.disaggregation.utils._get_cp_rank_page_bounds (0.5.23) gives rank r
# the run starting at r * base + min(r, rem), base + (r < rem) pages long.
BALANCED = "balanced"
REPLICATED = "replicated"
LANE_RULES = (INTERLEAVED, CONTIGUOUS, REPLICATED, BALANCED)


@dataclass(frozen=True)
class OwnerLanes:
    """The CP layout rule of one prefill instance (part of the runtime contract)."""

    cp_size: int
    rule: str = INTERLEAVED

    def __post_init__(self) -> None:
        if not isinstance(self.cp_size, (int, np.integer)) or isinstance(self.cp_size, bool) or self.cp_size < 1:
            raise LayoutError(f"cp_size must be a positive integer, got {self.cp_size!r}", field="cp_size")
        if self.rule not in LANE_RULES:
            raise LayoutError(f"owner-lane rule {self.rule!r} is not one of {LANE_RULES}", field="rule")

    def chunk_pages(self, num_pages: int) -> int:
        """Pages per rank under the ``contiguous`` rule: ``ceil(num_pages / cp_size)``."""
        return -(-num_pages // self.cp_size)

    def owners(self, logical_pages: np.ndarray, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        """``(owner cp rank, local page index on that rank)`` of each logical page."""
        pages = np.asarray(logical_pages)
        _check_num_pages(num_pages)
        if pages.size and not np.issubdtype(pages.dtype, np.integer):
            raise LayoutError(f"logical pages must be integers, got dtype {pages.dtype}", field="logical_pages")
        pages = pages.astype(np.int64, copy=False)
        if pages.size and (pages.min() < 0 or pages.max() >= num_pages):
            bad = pages[(pages < 0) | (pages >= num_pages)][0]
            raise LayoutError(f"logical page {bad} outside a request of {num_pages} pages", field="logical_pages")
        return self._owners(pages, num_pages)

    def owner_ranks(self, pages: np.ndarray, num_pages: int) -> np.ndarray | None:
        """The owner cp rank of each of ``pages`` (int64, checked inside ``[0, num_pages)`` by the
        caller: a room's send path, which has its bounds already), or None where one rank owns
        every page (``cp_size`` 1). :meth:`owners` checks its input."""
        return None if self.cp_size == 1 else self._owners(pages, num_pages)[0]

    def _owners(self, pages: np.ndarray, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        """The rule itself on checked int64 ``pages``: (owner cp rank, local page index)."""
        if self.rule == INTERLEAVED:
            return pages % self.cp_size, pages // self.cp_size
        if self.rule == CONTIGUOUS:
            chunk = max(self.chunk_pages(num_pages), 1)
            return pages // chunk, pages % chunk
        if self.rule == BALANCED:
            base, rem = divmod(num_pages, self.cp_size)
            long_pages = rem * (base + 1)  # pages held by the ranks of base + 1 pages
            past = pages - long_pages
            short = max(base, 1)  # base is 0 only when every page is a long rank's
            in_long = pages < long_pages
            owner = np.where(in_long, pages // (base + 1), rem + past // short)
            local = np.where(in_long, pages % (base + 1), past % short)
            return owner, local
        return np.zeros_like(pages), pages.copy()

    def owned_pages(self, cp_rank: int, num_pages: int) -> np.ndarray:
        """Ascending logical pages that ``cp_rank`` owns (and sends)."""
        self._check_rank(cp_rank)
        _check_num_pages(num_pages)
        if self.rule == INTERLEAVED:
            return np.arange(cp_rank, num_pages, self.cp_size, dtype=np.int64)
        if self.rule == CONTIGUOUS:
            chunk = self.chunk_pages(num_pages)
            return np.arange(min(cp_rank * chunk, num_pages), min((cp_rank + 1) * chunk, num_pages), dtype=np.int64)
        if self.rule == BALANCED:
            base, rem = divmod(num_pages, self.cp_size)
            start = cp_rank * base + min(cp_rank, rem)
            return np.arange(start, start + base + (cp_rank < rem), dtype=np.int64)
        return np.arange(num_pages if cp_rank == 0 else 0, dtype=np.int64)

    def num_local_pages(self, cp_rank: int, num_pages: int) -> int:
        """Pages of the request that ``cp_rank`` stores in its own pool."""
        if self.rule == REPLICATED:
            self._check_rank(cp_rank)
            _check_num_pages(num_pages)
            return num_pages
        return len(self.owned_pages(cp_rank, num_pages))

    def owner_of_token(self, token: int, page_size: int, num_pages: int) -> int:
        """The CP rank that owns the page holding ``token``."""
        if page_size <= 0:
            raise LayoutError(f"page_size must be positive, got {page_size}", field="page_size")
        if token < 0 or token >= num_pages * page_size:
            raise LayoutError(
                f"token {token} outside a request of {num_pages} pages of {page_size} tokens", field="token"
            )
        return self.owner_of_page(token // page_size, num_pages)

    def owner_of_page(self, page: int, num_pages: int) -> int:
        """The CP rank that owns logical page ``page`` (``owners`` for one page, in integers)."""
        _check_num_pages(num_pages)
        if not 0 <= page < num_pages:
            raise LayoutError(f"logical page {page} outside a request of {num_pages} pages", field="logical_pages")
        if self.rule == INTERLEAVED:
            return int(page) % self.cp_size
        if self.rule == CONTIGUOUS:
            return int(page) // max(self.chunk_pages(num_pages), 1)
        if self.rule == BALANCED:
            base, rem = divmod(num_pages, self.cp_size)
            long_pages = rem * (base + 1)
            return int(page) // (base + 1) if page < long_pages else rem + (int(page) - long_pages) // max(base, 1)
        return 0

    def lane_major(self, num_pages: int) -> np.ndarray:
        """Positions for a block of ``num_pages`` destination pages in which every
        CP rank's pages sit next to each other, in its local order:

            interleaved, cp 2, 6 pages     logical  0 1 2 3 4 5
                                           owner    0 1 0 1 0 1
                                           position 0 3 1 4 2 5   (cp0 -> 0..2, cp1 -> 3..5)

        A decode rank that maps logical page ``l`` to ``block[lane_major(n)[l]]`` of
        a contiguous block gets one run per CP rank instead of one slice per page.
        """
        _check_num_pages(num_pages)
        owner, local = self.owners(np.arange(num_pages, dtype=np.int64), num_pages)
        counts = np.bincount(owner, minlength=self.cp_size)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        return starts[owner] + local

    def to_dict(self) -> dict[str, Any]:
        return {"cp_size": int(self.cp_size), "rule": self.rule}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OwnerLanes:
        if not isinstance(d, Mapping) or set(d) != {"cp_size", "rule"}:
            raise LayoutError(f"owner lanes need exactly the keys cp_size and rule, got {d!r}", field="owner_lanes")
        return cls(cp_size=d["cp_size"], rule=d["rule"])

    def _check_rank(self, cp_rank: int) -> None:
        if not 0 <= cp_rank < self.cp_size:
            raise LayoutError(f"cp rank {cp_rank} outside cp_size {self.cp_size}", rank=cp_rank, field="cp_rank")


def has_repeats(values: np.ndarray) -> bool:
    """True when a value occurs twice in the 1-D ``values``. A sort and one comparison: not
    ``np.unique``, whose first call imports ``numpy.ma`` (98 ms measured on a GPU host's first room)."""
    if values.size < 2:
        return False
    ordered = np.sort(values, kind="stable")
    return bool((ordered[1:] == ordered[:-1]).any())


def _check_num_pages(num_pages: int) -> None:
    if num_pages < 0:
        raise LayoutError(f"num_pages must be non-negative, got {num_pages}", field="num_pages")

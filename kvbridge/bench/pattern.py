"""Bench KV content computed on the pool's own device, so a decode rank checks every room.

Word ``w`` of logical page ``l`` of a (pool, layer) buffer is ``hash(seed, pool,
layer, w) ^ hash(seed, pool, layer, l)`` (torch, CPU or CUDA): a page in the wrong
slot, layer or pool, a missing or a flipped byte all read wrong.

    prefill  fill(buf, local[i] <- page l_i)             the whole page, padding rows too
    decode   check(buf, page_ids[l] == page l)            valid bytes only; the partial last page's
                                                          padding rows must still hold SENTINEL

Bytes depend on the logical page, not on where a side keeps it: decode needs
neither the prefill's bytes nor its page ids. (The worker's ``synthetic`` module
is the per-token reference used by tests; this one is cheap enough for 6 GB rooms.)
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

from kvbridge.layout import PoolSpec
from kvbridge.transfer.digest import valid_mask
from kvbridge.worker.synthetic import SENTINEL_BYTE

PAGES_PER_STEP = 64  # bounds the int64 temporaries: 64 x 41,984 B pages -> 21 MB
_M1, _M2, _M3 = 0x9E3779B1, 0x85EBCA77, 0x27D4EB2F165667C5


def _key(seed: int, pool: str, layer: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(pool.encode()) * 10_007 + layer) % (1 << 62)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 29)
    x = x * _M3
    return x ^ (x >> 32)


def page_bytes(seed: int, pool: str, layer: int, logical: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``(len(logical), nbytes)`` uint8 content of those logical pages, on ``logical``'s device:
    a per-(pool, layer) word pattern XOR a per-page word (one int32 pass per page)."""
    words = -(-nbytes // 4)
    key = _key(seed, pool, layer)
    w = torch.arange(words, dtype=torch.int64, device=logical.device)
    per_word = _mix(w * _M1 + key).to(torch.int32)
    per_page = _mix(logical.to(torch.int64) * _M2 + key).to(torch.int32)
    return (per_word[None, :] ^ per_page[:, None]).view(torch.uint8)[:, :nbytes]


def as_pages(buf: torch.Tensor) -> torch.Tensor:
    """``(pages, bytes_per_page)`` uint8 view of a pool buffer."""
    return buf.view(torch.uint8).reshape(buf.shape[0], -1)


def fill(spec: PoolSpec, buf: torch.Tensor, seed: int, layer: int, logical: np.ndarray, local: np.ndarray) -> None:
    """Prefill side: page ``logical[i]``'s content into local page ``local[i]``."""
    pages = as_pages(buf)
    dev = pages.device
    for a in range(0, len(logical), PAGES_PER_STEP):
        lg = torch.as_tensor(np.asarray(logical[a:a + PAGES_PER_STEP]), dtype=torch.int64, device=dev)
        lc = torch.as_tensor(np.asarray(local[a:a + PAGES_PER_STEP]), dtype=torch.int64, device=dev)
        pages.index_copy_(0, lc, page_bytes(seed, spec.name, layer, lg, spec.bytes_per_page))


def poison(buf: torch.Tensor, page_ids: np.ndarray) -> None:
    """Decode side, before a room: its pages hold SENTINEL_BYTE."""
    idx = torch.as_tensor(np.asarray(page_ids), dtype=torch.int64, device=buf.device)
    as_pages(buf).index_fill_(0, idx, SENTINEL_BYTE)


def check(spec: PoolSpec, buf: torch.Tensor, seed: int, layer: int, page_ids: np.ndarray,
          num_tokens: int) -> tuple[int, str]:
    """Decode side: ``(valid bytes checked, first error or "")`` over every page of the room."""
    pages = as_pages(buf)
    dev = pages.device
    num_pages = len(page_ids)
    partial = num_tokens % spec.page_size
    full = num_pages - (1 if partial else 0)
    for a in range(0, full, PAGES_PER_STEP):
        b = min(full, a + PAGES_PER_STEP)
        got = pages.index_select(0, torch.as_tensor(np.asarray(page_ids[a:b]), dtype=torch.int64, device=dev))
        want = page_bytes(seed, spec.name, layer, torch.arange(a, b, device=dev), spec.bytes_per_page)
        if not torch.equal(got, want):
            return 0, _first_error(spec, layer, got != want, a, page_ids)
    checked = full * spec.bytes_per_page
    if partial:
        last = num_pages - 1
        mask = torch.as_tensor(valid_mask(spec, np.array([partial]))[0], device=dev)
        got = pages[int(page_ids[last])]
        want = page_bytes(seed, spec.name, layer, torch.tensor([last], device=dev), spec.bytes_per_page)[0]
        wrong = torch.where(mask, got != want, got != SENTINEL_BYTE)
        if bool(wrong.any()):
            return 0, _first_error(spec, layer, wrong[None], last, page_ids)
        checked += int(mask.sum())
    return checked, ""


def _first_error(spec: PoolSpec, layer: int, wrong: torch.Tensor, first_logical: int, page_ids: Any) -> str:
    row, col = (int(v) for v in torch.nonzero(wrong)[0].tolist())
    logical = first_logical + row
    return (f"pool {spec.name} layer {layer}: logical page {logical} (decode page {int(page_ids[logical])}) "
            f"byte {col}: {int(wrong.sum())} bytes wrong in this step")

"""Optional per-page digests (off by default) to hunt corruption.

A page's digest covers the *valid* bytes of that logical page in every pool and
layer of the room, in (pool name, layer id) order, so prefill (over its source
pages) and decode (over its destination pages) compute the same value from
different physical pages. It is a vectorised 64-bit weighted word sum, not a
cryptographic hash: it catches flipped, missing and misplaced bytes.

Window, compressed and state pools are digested per unit (``kind_unit_digests``: a window page,
a compressed entry page, a state slot, a ring row) over exactly the bytes the rooms move of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kvbridge.layout import BufferDesc, PoolSpec, RawBuffer
from kvbridge.layout.kinds import needed_extent, plan_kind
from kvbridge.layout.pools import STATE, WINDOW

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _weights(nwords: int, salt: int) -> np.ndarray:
    # Odd 64-bit weights from a fixed LCG: deterministic on every host.
    idx = np.arange(nwords, dtype=np.uint64) + np.uint64(salt * 1_000_003 + 1)
    with np.errstate(over="ignore"):
        return (idx * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)) | np.uint64(1)


def host_bytes(buf: Any) -> np.ndarray:
    """A [pages, bytes_per_page] uint8 host view (CUDA tensors are copied)."""
    if hasattr(buf, "detach"):  # torch tensor
        t = buf.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        arr = t.contiguous().view(-1).view(__import__("torch").uint8).numpy()
    else:
        arr = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
    return arr.reshape(buf.shape[0], -1)


def page_bytes(buf: Any, pages: np.ndarray) -> np.ndarray:
    """[len(pages), bytes_per_page] uint8 host copy of the physical ``pages`` of ``buf``.

    A CUDA tensor is indexed on its device first, so only those pages cross to
    the host (never the whole pool buffer). Device memory given as a ``RawBuffer``
    cannot be read: BufferSpecError."""
    if isinstance(buf, RawBuffer):
        buf.host_view()  # raises for device memory, naming it
    if hasattr(buf, "detach") and buf.device.type != "cpu":
        import torch

        idx = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=buf.device)
        return buf.detach().index_select(0, idx).flatten(1).contiguous().view(torch.uint8).cpu().numpy()
    return host_bytes(buf)[pages]


def valid_mask(spec: PoolSpec, num_valid_rows: np.ndarray) -> np.ndarray:
    """[pages, bytes_per_page] bool: which bytes of each page hold valid rows."""
    mask = np.zeros((num_valid_rows.size, spec.bytes_per_page), dtype=bool)
    rows = np.arange(spec.page_size)
    row_ok = rows[None, :] < num_valid_rows[:, None]  # [pages, page_size]
    if spec.layout == "rows":
        mask[:] = np.repeat(row_ok, spec.bytes_per_token, axis=1)
    else:
        v, s = spec.value_bytes_per_token, spec.scale_bytes_per_token
        mask[:, : spec.scale_offset] = np.repeat(row_ok, v, axis=1)
        mask[:, spec.scale_offset :] = np.repeat(row_ok, s, axis=1)
    return mask


def page_digests(
    specs: Mapping[str, PoolSpec],
    buffers: Mapping[tuple[str, int], Any],
    pools: Sequence[str],
    logical_pages: np.ndarray,
    physical_pages: np.ndarray,
    num_tokens: int,
    layers: Mapping[str, Sequence[int]] | None = None,
) -> np.ndarray:
    """uint64 digest per logical page over the valid bytes of every (pool, layer); ``layers``:
    only these layer ids of each pool (a pipeline stage's share: what that stage digested)."""
    logical = np.asarray(logical_pages, dtype=np.int64)
    physical = np.asarray(physical_pages, dtype=np.int64)
    out = _weights(1, 0)[0] * (logical.astype(np.uint64) + np.uint64(1))  # an all-zero page still has a digest
    for salt, pool in enumerate(sorted(pools)):
        spec = specs[pool]
        valid = np.clip(num_tokens - logical * spec.page_size, 0, spec.page_size)
        mask = valid_mask(spec, valid)
        nbytes = spec.bytes_per_page + (-spec.bytes_per_page) % 8
        for layer in sorted(spec.layer_ids if layers is None else layers[pool]):
            pages = page_bytes(buffers[(pool, layer)], physical)
            data = np.zeros((logical.size, nbytes), dtype=np.uint8)
            data[:, : spec.bytes_per_page] = np.where(mask, pages, 0)
            words = data.view(np.uint64)
            with np.errstate(over="ignore"):
                out += (words * _weights(words.shape[1], salt * 4096 + layer)).sum(axis=1, dtype=np.uint64)
                out = out * np.uint64(1099511628211) & _MASK
    return out


def _unit_view(buf: Any, bytes_per_page: int) -> Any:
    """``buf`` seen as [units, bytes_per_page] bytes (no copy): a kind pool's buffer may be flat."""
    if hasattr(buf, "detach"):
        import torch

        return buf.detach().reshape(-1).view(torch.uint8).view(-1, bytes_per_page)
    if isinstance(buf, RawBuffer):
        return buf
    return np.ascontiguousarray(buf).view(np.uint8).reshape(-1, bytes_per_page)


def kind_unit_digests(
    spec: PoolSpec,
    buffers: Mapping[tuple[str, int], Any],
    logical: np.ndarray,
    units: np.ndarray,
    num_tokens: int,
    layers: Sequence[int] | None = None,
) -> np.ndarray:
    """uint64 digest per logical unit of window, compressed or state pool ``spec`` (its
    ``logical`` units held in our ``units``: pages, entry pages; a state or ring pool: its one
    slot or row, every logical unit given then shares it) over exactly the bytes the rooms move of
    it for a request of ``num_tokens`` (``plan_kind`` over the needed extent: the window's rows,
    a complete entry's pages, a tail slot's first rows), in every layer of ``layers`` (None: the
    pool's; a pipeline stage's share). Prefill over its source units and decode over its
    destination units compute the same value; pages are read through ``page_bytes`` (a CUDA
    buffer: only those pages cross to the host)."""
    logical = np.asarray(logical, dtype=np.int64).reshape(-1)
    units = np.asarray(units, dtype=np.int64).reshape(-1)
    bpp = spec.bytes_per_page
    ext = needed_extent(spec, num_tokens)
    one = spec.kind == STATE or (spec.kind == WINDOW and bool(spec.ring_stride))  # a slot or ring row
    out = _weights(1, 0)[0] * (logical.astype(np.uint64) + np.uint64(1))
    if not logical.size or not ext.count:
        return out
    order = np.argsort(logical, kind="stable")
    for layer in sorted(spec.layer_ids if layers is None else layers):
        view = _unit_view(buffers[(spec.name, layer)], bpp)
        desc = BufferDesc(pool=spec.name, layer_id=layer, base=0, capacity_pages=int(view.shape[0]),
                          bytes_per_page=bpp)
        cut = spec if spec.layer_ids == (layer,) else _one_layer(spec, layer)
        if one:  # (a rank's cut of a sharded slot: every group's part of it, as between equal TP ranks)
            tp = (spec.tp_size, 0, spec.tp_size, 0) if spec.kind == STATE and spec.shard_units else (1, 0, 1, 0)
            plan = plan_kind(cut, [desc], [desc], ext, units[:1], units[:1], tp=tp)
        else:
            plan = plan_kind(cut, [desc], [desc], ext, units[order], units[order], logical=logical[order])
        off, length = plan.src.astype(np.int64), plan.length.astype(np.int64)
        total = int(length.sum())
        # every byte's offset in the buffer, ascending (the ranges are disjoint): the same order on both sides
        starts = np.repeat(off - np.concatenate(([0], np.cumsum(length)[:-1])), length)
        where = np.sort(starts + np.arange(total, dtype=np.int64))
        page = where // bpp
        pages = np.unique(page)
        data = page_bytes(view, pages).reshape(-1)
        values = data[np.searchsorted(pages, page) * bpp + where % bpp].astype(np.uint64)
        if one:
            idx = np.zeros(total, dtype=np.int64)
        else:  # the unit a byte belongs to: its page's place among ``units``
            by_page = np.argsort(units, kind="stable")
            idx = by_page[np.searchsorted(units[by_page], page)]
        grouped = np.argsort(idx, kind="stable")  # per unit, its bytes in ascending offset
        idx, values = idx[grouped], values[grouped]
        first = np.searchsorted(idx, np.arange(units.size if not one else 1))
        ordinal = np.arange(total, dtype=np.int64) - first[idx]
        sums = np.zeros(units.size if not one else 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            np.add.at(sums, idx, values * _weights(max(total, 1), 7 * 4096 + layer)[ordinal])
            per = sums if not one else np.repeat(sums, logical.size)
            out = (out + per) * np.uint64(1099511628211) & _MASK
    return out


def _one_layer(spec: PoolSpec, layer: int) -> PoolSpec:
    return replace(spec, layer_ids=(layer,))

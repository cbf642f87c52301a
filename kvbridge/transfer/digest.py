"""Optional per-page digests (off by default) to hunt corruption.

A page's digest covers the *valid* bytes of that logical page in every pool and
layer of the room, in (pool name, layer id) order, so prefill (over its source
pages) and decode (over its destination pages) compute the same value from
different physical pages. It is a vectorised 64-bit weighted word sum, not a
cryptographic hash: it catches flipped, missing and misplaced bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvbridge.layout import PoolSpec, RawBuffer

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

"""The checks that matter, per request: the received pages hold exactly the
bytes of the colocated cache; every byte of the decode pools that no valid row
owns still holds the poison (partial-page tails, pages of nobody); logits are
bit-equal; greedy tokens are equal. Each check says where it failed first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvbridge.integrations.transformers.geometry import CacheGeometry, layer_rows
from kvbridge.integrations.transformers.paged import PagedKV, slots_of
from kvbridge.integrations.transformers.runner import Decoded, Prefilled


def colocated_rows(geom: CacheGeometry, pre: Prefilled, pools: Sequence[str]) -> dict[str, torch.Tensor]:
    """Rows ``[layers, num_tokens, row_elems]`` per pool of the colocated cache
    (the heads of ``geom``'s rank), taken from the model's own cache objects."""
    n = pre.num_tokens
    layers = [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in pre.cache.layers]
    if pre.draft_cache is not None:
        layers += [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in pre.draft_cache.layers]
    per_pool: dict[str, list[torch.Tensor]] = {p: [] for p in pools}
    for lid, (k, v) in enumerate(layers):
        for pool, rows in layer_rows(geom, lid, k, v).items():
            if pool in per_pool:
                per_pool[pool].append(rows)
    return {p: torch.stack(rows) for p, rows in per_pool.items() if rows}


def compare_pages(geom: CacheGeometry, paged: PagedKV, page_table: np.ndarray, pre: Prefilled) -> str | None:
    """``None`` when every valid row of every pool and layer on the request's
    pages equals the colocated cache byte for byte; else the first difference."""
    page_size = next(iter(paged.specs.values())).page_size
    slots = slots_of(page_table, np.arange(pre.num_tokens), page_size)
    expected = colocated_rows(geom, pre, list(paged.specs))
    for pool, spec in paged.specs.items():
        if pool not in expected:
            return f"pool {pool!r}: the colocated cache has no rows for it"
        got = paged.byte_view(pool)[:, slots.to(paged.byte_view(pool).device)].cpu()
        want = expected[pool].contiguous().view(torch.uint8).cpu()
        if got.shape != want.shape:
            return f"pool {pool!r}: pages hold rows {tuple(got.shape)}, the colocated cache {tuple(want.shape)}"
        diff = (got != want).nonzero()
        if len(diff):
            layer, token, byte = (int(x) for x in diff[0])
            return (
                f"pool {pool!r} layer {spec.layer_ids[layer]} token {token} (logical page {token // page_size}, "
                f"row {token % page_size}) byte {byte}: {int(got[layer, token, byte]):#04x} received, "
                f"{int(want[layer, token, byte]):#04x} colocated"
            )
    return None


def rows_diff(expected: dict[str, torch.Tensor], received: dict[str, torch.Tensor], page_size: int) -> str | None:
    """``None`` when ``received`` rows (``[layers, tokens, row]`` per pool, read back from a
    decode rank's pages) are byte for byte the ``expected`` (``colocated_rows``); else the first
    difference, by pool, layer index, token and byte."""
    for pool, want in expected.items():
        got = received.get(pool)
        if got is None:
            return f"pool {pool!r}: no rows received"
        w, g = want.contiguous().view(torch.uint8).cpu(), got.contiguous().view(torch.uint8).cpu()
        if w.shape != g.shape:
            return f"pool {pool!r}: received rows {tuple(g.shape)}, the colocated cache {tuple(w.shape)}"
        diff = (w != g).nonzero()
        if len(diff):
            layer, token, byte = (int(x) for x in diff[0])
            return (f"pool {pool!r} layer index {layer} token {token} (logical page {token // page_size}, row "
                    f"{token % page_size}) byte {byte}: {int(g[layer, token, byte]):#04x} received, "
                    f"{int(w[layer, token, byte]):#04x} colocated")
    return None


def untouched_bytes(paged: PagedKV, tables: Sequence[np.ndarray], num_tokens: Sequence[int], fill: int) -> str | None:
    """``None`` when every byte outside the valid rows of the given requests
    still holds ``fill`` (partial-page tails, unused pages); else the first that does not."""
    for pool, spec in paged.specs.items():
        view = paged.byte_view(pool)
        valid = torch.zeros(view.shape[1], dtype=torch.bool)
        for table, n in zip(tables, num_tokens):
            valid[slots_of(table, np.arange(n), spec.page_size)] = True
        rest = view[:, ~valid.to(view.device)].cpu()
        bad = (rest != fill).nonzero()
        if len(bad):
            layer, k, byte = (int(x) for x in bad[0])
            slot = int(torch.nonzero(~valid).flatten()[k])
            return (
                f"pool {pool!r} layer {spec.layer_ids[layer]} page {slot // spec.page_size} row "
                f"{slot % spec.page_size} byte {byte} is {int(rest[layer, k, byte]):#04x}, "
                f"expected untouched {fill:#04x}"
            )
    return None


def bits_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same dtype, shape and bytes (so -0.0 != 0.0 and NaN payloads count)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu()))


@dataclass(frozen=True)
class RequestCheck:
    """One request's verdict, colocated vs disaggregated."""

    index: int
    num_tokens: int
    bytes_equal: bool
    poison_intact: bool
    logits_equal: bool
    tokens_equal: bool
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.bytes_equal and self.poison_intact and self.logits_equal and self.tokens_equal

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "ok": self.ok}


def check_request(
    pre: Prefilled,
    colocated: Decoded,
    disaggregated: Decoded,
    *,
    pages_diff: str | None,
    poison_diff: str | None,
) -> RequestCheck:
    """Combine the page checks (``compare_pages`` / ``untouched_bytes``) with the
    decode comparison (logits of every step, target and draft; tokens)."""
    target_equal = bits_equal(colocated.logits, disaggregated.logits)
    logits_equal = target_equal and bits_equal(colocated.draft_logits, disaggregated.draft_logits)
    tokens_equal = colocated.tokens == disaggregated.tokens
    details = [d for d in (pages_diff, poison_diff) if d]
    if not logits_equal:
        details.append("logits differ" + ("" if target_equal else " (target)"))
    # equal NaNs prove nothing: a model that yields them (uninitialised weights) fails the check
    finite = all(t is None or bool(t.isfinite().all()) for t in (colocated.logits, colocated.draft_logits))
    if not finite:
        logits_equal = False
        details.append("the colocated logits are not finite")
    if not tokens_equal:
        details.append(f"tokens {disaggregated.tokens} != colocated {colocated.tokens}")
    return RequestCheck(
        index=pre.index,
        num_tokens=pre.num_tokens,
        bytes_equal=pages_diff is None,
        poison_intact=poison_diff is None,
        logits_equal=logits_equal,
        tokens_equal=tokens_equal,
        detail="; ".join(details),
    )

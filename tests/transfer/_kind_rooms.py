"""Rooms of window, compressed and state pools: the models (a tiny DeepSeek-V4 and a hybrid of a
paged window and Mamba state), seeded pool buffers, the units each side uses, a prefill rank's
chunked sends, and the decode buffers expected afterwards (``plan_kind`` into a mirror by
memcpy: exactly what decode needs, every other byte untouched)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

import kvbridge as kvb
from kvbridge.layout import BufferDesc

CAP = 48  # units (pages, entry pages, slots) per (pool, layer) on both sides
PAGE = 4
AUX = kvb.AuxSchema.standard(8)


def model_specs(name: str) -> dict[str, kvb.PoolSpec]:
    if name == "v4":  # both layer types, indexer, draft; HCA ratio 32 so short prompts complete entries
        return kvb.deepseek_v4_pools(4, PAGE, sliding_window=16, hca_ratio=32, head_dim=16, index_head_dim=8,
                                     draft_layers=1)
    if name == "hybrid":  # a paged sliding window on attention layers, Mamba conv + SSM state on the others
        swa = kvb.window_pool("swa", [0, 2], 32, window=6, page_size=PAGE)
        return {"swa": swa, **kvb.mamba_pools([1, 3], conv_groups=(4, 2, 2), conv_kernel=4, num_heads=2, head_dim=4,
                                              state_size=8)}
    raise ValueError(name)


def contract(specs: dict[str, kvb.PoolSpec], lane_rule: str = "interleaved") -> kvb.RuntimeContract:
    return kvb.contract_for(specs, model="kind-rooms-test", aux=AUX, lane_rule=lane_rule)


def buffers(specs: dict[str, kvb.PoolSpec], seed: int | None) -> dict[tuple[str, int], torch.Tensor]:
    """One buffer per (pool, layer): seeded random bytes (prefill), or zeros (decode, mirror)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, spec in specs.items():
        for lid in spec.layer_ids:
            n = CAP * spec.bytes_per_page
            raw = rng.integers(0, 256, n, dtype=np.uint8) if seed is not None else np.zeros(n, np.uint8)
            out[(name, lid)] = torch.from_numpy(raw).view(getattr(torch, spec.abi))
    return out


def descs(specs: dict[str, kvb.PoolSpec], bufs: dict) -> list[BufferDesc]:
    return [kvb.describe_buffer(specs[name], lid, buf) for (name, lid), buf in sorted(bufs.items())]


def own_pools(specs: dict[str, kvb.PoolSpec]) -> list[str]:
    return sorted(n for n, s in specs.items() if s.kind in ("compressed", "state"))


def prefill_units(specs: dict[str, kvb.PoolSpec]) -> dict[str, np.ndarray]:
    """Prefill: entry pages 0.. in order (state: slot 1)."""
    return {n: np.array([1]) if specs[n].kind == "state" else np.arange(CAP) for n in own_pools(specs)}


def decode_units(specs: dict[str, kvb.PoolSpec], n: int, slot: int = 3) -> dict[str, np.ndarray]:
    """Decode: what it needs, reversed from unit 5 (state: ``slot``)."""
    out = {}
    for name in own_pools(specs):
        ext = kvb.needed_extent(specs[name], n)
        out[name] = np.array([slot]) if specs[name].kind == "state" else np.arange(ext.count)[::-1] + 5
    return out


def token_pages(n: int) -> int:
    return -(-n // PAGE)


def decode_pages(n: int) -> np.ndarray:
    return np.arange(token_pages(n))[::-1] + 2  # logical page l -> decode page


def prefill_pages(logical: np.ndarray) -> np.ndarray:
    return logical + 1  # logical page l -> prefill page


def send_room(sender, n: int, cuts: tuple[int, ...], lanes: kvb.OwnerLanes, cp_rank: int, room: int,
              specs: dict[str, kvb.PoolSpec], last_stage: bool = True) -> None:
    """One prefill CP rank's chunked sends of ``room``: its owned pages, complete ones as the
    chunks end at ``cuts`` (and n), the aux row with the last from the owner of the last token
    (in the last pipeline stage)."""
    sender.init(n, kind_units={k: v for k, v in prefill_units(specs).items()} or None)
    num_pages = token_pages(n)
    owned = lanes.owned_pages(cp_rank, num_pages)
    owns_last = last_stage and lanes.owner_of_token(n - 1, PAGE, num_pages) == cp_rank
    sent = 0
    for end in (*cuts, n):
        last = end == n
        upto = num_pages if last else end // PAGE + (1 if end % PAGE else 0)
        chunk = owned[(owned >= sent) & (owned < upto)]
        row = kvb_aux(room, n) if last and owns_last else None
        sender.send(chunk, prefill_pages(chunk), num_tokens_ready=end, is_last=last, aux=row)
        sent = upto


def send_room_layers(sender, n: int, cuts: tuple[int, ...], lanes: kvb.OwnerLanes, cp_rank: int, room: int,
                     specs: dict[str, kvb.PoolSpec], ranges: list[tuple[int, int]], last_stage: bool = True) -> None:
    """One prefill rank's layer-wise sends of ``room`` (``specs``: its stage's): per chunk ending
    at ``cuts`` (and n), its owned pages complete by then, once per layer range of ``ranges`` (as
    a forward pass writes them); then the last send, no pages, the aux row from the owner of the
    last token in the last stage."""
    sender.init(n, kind_units=prefill_units(specs) or None)
    num_pages = token_pages(n)
    owned = lanes.owned_pages(cp_rank, num_pages)
    sent = 0
    for end in (*cuts, n):
        upto = num_pages if end == n else end // PAGE  # complete pages only: a layer range carries no partial page
        chunk = owned[(owned >= sent) & (owned < upto)]
        for layers in ranges:
            sender.send(chunk, prefill_pages(chunk), num_tokens_ready=end, layers=layers)
        sent = max(sent, upto)
    owns_last = last_stage and lanes.owner_of_token(n - 1, PAGE, num_pages) == cp_rank
    sender.send(np.zeros(0, np.int64), np.zeros(0, np.int64), num_tokens_ready=n, is_last=True,
                aux=kvb_aux(room, n) if owns_last else None)


def kvb_aux(room: int, n: int) -> np.ndarray:
    from kvbridge.worker.synthetic import make_aux

    return make_aux(AUX, room, n)


def _memmove(plan) -> None:
    for s, d, k in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
        ctypes.memmove(d, s, k)


def expected(specs: dict[str, kvb.PoolSpec], src_bufs: dict, n: int, slot: int = 3) -> dict:
    """Decode's buffers after the room: zeros, and what decode needs of every pool copied from
    prefill's buffers by ``plan_kind`` (window pages on the page mappings, the rest on units)."""
    mirror = buffers(specs, None)
    src_d, dst_d = descs(specs, src_bufs), descs(specs, mirror)
    dunits = decode_units(specs, n, slot)
    punits = prefill_units(specs)
    dpages = decode_pages(n)
    moved = 0
    for name, spec in specs.items():
        ext = kvb.needed_extent(spec, n)
        if not ext.count:
            continue
        logical = np.arange(ext.first, ext.stop)
        if spec.kind == "state":
            plan = kvb.plan_kind(spec, src_d, dst_d, ext, punits[name], dunits[name])
        elif spec.kind == "compressed":
            plan = kvb.plan_kind(spec, src_d, dst_d, ext, punits[name][logical], dunits[name])
        else:
            plan = kvb.plan_kind(spec, src_d, dst_d, ext, prefill_pages(logical), dpages[logical])
        _memmove(plan)
        moved += plan.num_bytes
    assert moved == sum(kvb.needed_bytes(s, n) for s in specs.values())
    return mirror


def differing(specs: dict[str, kvb.PoolSpec], got: dict, want: dict) -> list[str]:
    """The (pool, layer)s whose bytes differ, with the first differing byte."""
    bad = []
    for key in sorted(want):
        a = got[key].view(torch.uint8).numpy() if isinstance(got[key], torch.Tensor) else got[key]
        b = want[key].view(torch.uint8).numpy()
        if not np.array_equal(a, b):
            at = int(np.flatnonzero(a != b)[0])
            bad.append(f"{key} byte {at} (unit {at // specs[key[0]].bytes_per_page})")
    return bad

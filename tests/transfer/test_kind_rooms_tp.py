"""Request-state slots across TP sizes, through the rooms in one process (the local engine, a real
bootstrap daemon): a hybrid of a paged sliding window and Mamba state (conv: three channel groups
each sharded across TP, SGLang's ``state_conv_shard_groups``; SSM: sharded by heads), prefill TP 2
-> decode TP 1 and TP 1 -> TP 2. Each decode rank's slot must equal its cut of the whole slot
(``state_slices``: every group's overlap from every prefill TP rank that holds part of it), the
window whole from the first source, nothing else written, and the bytes posted equal what the
decode ranks need plus their aux rows."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import kvbridge as kvb
from _kind_rooms import AUX, CAP, PAGE, buffers, decode_pages, decode_units, differing, expected, send_room
from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
from kvbridge.transfer.engine.local import LocalFabric
from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint

FINAL = (kvb.KVPoll.Success, kvb.KVPoll.Failed)
GROUPS = (4, 2, 2)  # conv channel groups (x, B, C), each split across TP


def rank_specs(tp: int) -> dict[str, kvb.PoolSpec]:
    """A TP rank's pools: the window whole (replicated), its part of each state shard group."""
    swa = kvb.window_pool("swa", [0, 2], 32, window=6, page_size=PAGE)
    return {"swa": swa, **kvb.mamba_pools([1, 3], conv_groups=GROUPS, conv_kernel=4, num_heads=2, head_dim=4,
                                          state_size=8, tp_size=tp)}


def rank_slot(spec: kvb.PoolSpec, whole: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """TP rank ``rank``'s slot of a sharded state slot whose unsharded bytes are ``whole``: its
    part of every group, group after group."""
    full = spec.full()
    parts, at = [], 0
    for units in full.shard_units:
        part = units // tp * full.unit_bytes
        parts.append(whole[at + rank * part: at + (rank + 1) * part])
        at += units * full.unit_bytes
    return np.concatenate(parts)


def state_bytes(seed: int = 5) -> dict[tuple[str, int], np.ndarray]:
    """The request's unsharded state, per (pool, layer)."""
    rng = np.random.default_rng(seed)
    return {(name, lid): rng.integers(0, 256, spec.full().bytes_per_token, dtype=np.uint8)
            for name, spec in rank_specs(1).items() if spec.kind == "state" for lid in spec.layer_ids}


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2)])
def test_state_slots_are_cut_for_the_decode_tp_size(daemon, src_tp, dst_tp):
    name, n, room = f"ktp-{src_tp}{dst_tp}", 22, 1200 + 10 * src_tp + dst_tp
    full = rank_specs(1)
    contract = kvb.contract_for(full, model="kind-rooms-tp", aux=AUX)
    whole = state_bytes()
    fabric, clients, prefill, decode = LocalFabric(), [], [], []

    def client() -> BootstrapClient:
        clients.append(BootstrapClient(daemon.url))
        return clients[-1]

    try:
        window = buffers({"swa": full["swa"]}, seed=11)  # the same window on every prefill TP rank
        for r in range(src_tp):
            specs = rank_specs(src_tp)
            bufs = {**{k: v.clone() for k, v in window.items()},
                    **{k: v for k, v in buffers({p: s for p, s in specs.items() if p != "swa"}, seed=20 + r).items()}}
            for (pool, lid), raw in whole.items():  # slot 1 holds this rank's part of the request's state
                view = bufs[(pool, lid)].view(torch.uint8).numpy().reshape(CAP, -1)
                view[1] = rank_slot(specs[pool], raw, src_tp, r)
            cfg = PrefillConfig(instance=f"{name}-p", tp_rank=r, tp_size=src_tp, staging="never", lease_ttl=5.0)
            ep = PrefillEndpoint(cfg, kvb.create_engine("local", fabric=fabric), specs, bufs, contract, client(), AUX)
            ep.start()
            prefill.append(ep)
        dst = []
        for d in range(dst_tp):
            specs = rank_specs(dst_tp)
            dst.append(buffers(specs, seed=None))
            cfg = DecodeConfig(instance=f"{name}-d", tp_rank=d, tp_size=dst_tp, staging="never", lease_ttl=5.0,
                               peer_timeout=5.0, ping_interval=0.2)
            ep = DecodeEndpoint(cfg, kvb.create_engine("local", fabric=fabric), specs, dst[d], contract, client(),
                                torch.zeros((4, AUX.row_bytes), dtype=torch.uint8), AUX)
            ep.start()
            decode.append(ep)
        rxs = []
        for d, ep in enumerate(decode):
            rx = ep.receiver(room, f"{name}-p")
            rx.init(decode_pages(n), 0, n, kind_units=decode_units(rank_specs(dst_tp), n, slot=3))
            rxs.append(rx)
        txs = []
        for ep in prefill:
            tx = ep.sender(room)
            send_room(tx, n, (9,), kvb.OwnerLanes(1, "interleaved"), 0, room, ep.specs)
            txs.append(tx)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(h.poll() in FINAL for h in rxs + txs):
            time.sleep(0.02)
        assert [rx.poll() for rx in rxs] == [kvb.KVPoll.Success] * dst_tp, [rx.failure_reason for rx in rxs]
        assert [tx.poll() for tx in txs] == [kvb.KVPoll.Success] * src_tp, [tx.failure_reason for tx in txs]
        for d in range(dst_tp):
            specs = rank_specs(dst_tp)
            want = expected({"swa": specs["swa"]}, window, n)
            for (pool, lid), raw in whole.items():
                want[(pool, lid)] = torch.zeros(CAP * specs[pool].bytes_per_page, dtype=torch.uint8)
                want[(pool, lid)].view(CAP, -1)[3] = torch.from_numpy(rank_slot(specs[pool], raw, dst_tp, d))
            assert differing(specs, dst[d], want) == [], f"decode tp rank {d}"
        needed = sum(kvb.needed_bytes(s, n) for s in rank_specs(dst_tp).values())
        row = 0 if decode[0].aux_inline else AUX.row_bytes  # (inline: the aux row in its report, no byte posted)
        assert sum(tx.stats["bytes"] for tx in txs) == dst_tp * (needed + row)
    finally:
        for ep in decode + prefill:
            ep.close(timeout=2)
            ep.engine.close()  # (the engines are ours to close)
        for c in clients:
            c.close()

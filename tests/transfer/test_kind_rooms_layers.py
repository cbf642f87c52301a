"""Window, compressed and state pools over layer ranges, through the rooms in one process (the
local engine, a real bootstrap daemon): layer-wise sends (``send(..., layers=)``) and pipeline
stages (``pp_layers``), each stage registering and sending only its layers of every kind pool
(V4: the CSA pools live on the last layer only, HCA on the others, the window on all, the draft
window with the last stage). Every byte of decode's pools is compared with the expected buffers,
and the bytes posted equal ``needed_bytes`` plus the aux row: each layer of each unit once."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import kvbridge as kvb
from _kind_rooms import (AUX, buffers, contract, decode_pages, decode_units, differing, expected, model_specs,
                         send_room, send_room_layers)
from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.layout import stage_specs
from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
from kvbridge.transfer.engine.local import LocalFabric
from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint

FINAL = (kvb.KVPoll.Success, kvb.KVPoll.Failed)


class StageKindCluster:
    """pp x cp prefill ranks of a kind-pool model (``_kind_rooms.py``) and one decode rank holding
    every layer, on one LocalFabric. ``split``: each stage's target layers."""

    def __init__(self, url: str, model: str, name: str, split: list[tuple[int, int]], cp: int = 1,
                 staging: str = "never", verify_digest: bool = False) -> None:
        self.specs = model_specs(model)
        self.contract = contract(self.specs)
        self.num_layers = self.contract.model.target_layers
        self.fabric = LocalFabric()
        self.lanes = kvb.OwnerLanes(cp, "interleaved")
        self.split, self.name = split, name
        self.clients, self.prefill = [], {}
        self.src = buffers(self.specs, seed=11)  # every rank holds the same bytes of its layers
        pp = len(split)
        self.decode = None
        try:
            for c in range(cp):
                for s, layers in enumerate(split):
                    staged = pp > 1
                    cfg = PrefillConfig(instance=f"{name}-p", cp_rank=c, cp_size=cp, staging=staging, lease_ttl=5.0,
                                        **(dict(pp_rank=s, pp_size=pp, pp_layers=layers) if staged else {}))
                    mine = stage_specs(self.specs, layers, self.num_layers)
                    bufs = {k: v.clone() for k, v in self.src.items() if k[0] in mine and k[1] in mine[k[0]].layer_ids}
                    ep = PrefillEndpoint(cfg, kvb.create_engine("local", fabric=self.fabric), self.specs, bufs,
                                         self.contract, self._client(url), AUX)
                    ep.start()
                    self.prefill[(c, s)] = (ep, mine)
            self.dst = buffers(self.specs, seed=None)
            self.aux = torch.zeros((4, AUX.row_bytes), dtype=torch.uint8)
            cfg = DecodeConfig(instance=f"{name}-d", staging=staging, lease_ttl=5.0, peer_timeout=5.0,
                               ping_interval=0.2, verify_digest=verify_digest)
            self.decode = DecodeEndpoint(cfg, kvb.create_engine("local", fabric=self.fabric), self.specs, self.dst,
                                         self.contract, self._client(url), self.aux, AUX)
            self.decode.start()
        except BaseException:
            self.close()
            raise

    def _client(self, url: str) -> BootstrapClient:
        c = BootstrapClient(url)
        self.clients.append(c)
        return c

    def room(self, room: int, n: int, cuts: tuple[int, ...], width: int | None, slot: int = 3):
        """Every rank sends its share of ``room``: layer ranges of ``width`` target layers across
        its stage (None: whole chunks)."""
        rx = self.decode.receiver(room, f"{self.name}-p")
        rx.init(decode_pages(n), 0, n, kind_units=decode_units(self.specs, n, slot) or None)
        txs = []
        for (c, s), (ep, mine) in self.prefill.items():
            tx = ep.sender(room)
            if width is None:
                send_room(tx, n, cuts, self.lanes, c, room, mine, last_stage=s == len(self.split) - 1)
            else:
                a, b = self.split[s]
                ranges = [(x, min(x + width, b)) for x in range(a, b, width)]
                send_room_layers(tx, n, cuts, self.lanes, c, room, mine, ranges, last_stage=s == len(self.split) - 1)
            txs.append(tx)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (rx.poll() in FINAL and all(t.poll() in FINAL for t in txs)):
            time.sleep(0.02)
        return rx, txs

    def close(self) -> None:
        if self.decode is not None:
            self.decode.close(timeout=2)
        for ep, _ in self.prefill.values():
            ep.close(timeout=2)
        for ep in [self.decode] + [ep for ep, _ in self.prefill.values()]:  # (the engines are ours to close)
            if ep is not None:
                ep.engine.close()
        for c in self.clients:
            c.close()


@pytest.mark.parametrize("model, split, cp, width, n, cuts, staging", [
    # layer-wise sends, one stage: ranges of 2 layers (the draft window with the range ending at 5)
    ("v4", [(0, 5)], 1, 2, 131, (40, 96), "never"),
    # two stages, whole chunks: HCA on both, CSA and the draft on pp1
    ("v4", [(0, 2), (2, 5)], 1, None, 131, (40, 96), "never"),
    # two stages, one layer a range; CP 2 (window pages from their lanes, state from the last token's owner)
    ("hybrid", [(0, 2), (2, 4)], 2, 1, 30, (13, 21), "never"),
    # two stages, layer-wise, staged only: every layer range of every kind through decode's slots
    ("v4", [(0, 2), (2, 5)], 1, 1, 131, (40, 96), "always"),
])
def test_layer_ranges_and_stages_move_every_kind_exactly_once(daemon, request, model, split, cp, width, n, cuts,
                                                               staging):
    c = StageKindCluster(daemon.url, model, f"kl-{request.node.callspec.id[:24]}", split, cp, staging)
    try:
        rx, txs = c.room(900 + n, n, cuts, width)
        assert rx.poll() == kvb.KVPoll.Success, rx.failure_reason
        assert all(t.poll() == kvb.KVPoll.Success for t in txs), [t.failure_reason for t in txs]
        assert differing(c.specs, c.dst, expected(c.specs, c.src, n)) == []
        needed = sum(kvb.needed_bytes(s, n) for s in c.specs.values())
        row = 0 if c.decode.aux_inline else AUX.row_bytes  # (inline: the aux row in its report, no byte posted)
        assert sum(t.stats["bytes"] for t in txs) == needed + row
        assert rx.stats["bytes"] == needed
        if staging == "always":  # every byte through a slot
            assert sum(t.stats["bytes_staged"] for t in txs) == needed + row, [t.stats for t in txs]
    finally:
        c.close()


@pytest.mark.parametrize("model, split, width, pool, layer, unit, stage", [
    # two stages, a layer a range: an HCA entry page of stage 0's layer 0 (HCA on layers 0-2)
    ("v4", [(0, 2), (2, 5)], 1, "hca", 0, 0, 0),
    # two stages, a layer a range: a window page of stage 1's draft layer
    ("v4", [(0, 2), (2, 5)], 1, "draft", 4, 32, 1),
])
def test_stages_digest_their_own_layers_of_every_kind_unit(daemon, request, model, split, width, pool, layer, unit,
                                                           stage):
    """verify_digest over layer ranges and pipeline stages: each stage digests its own layers of
    each kind unit it reports and decode reads back the same layers; a clean room commits, a byte
    of one unit's layer flipped on decode before the commit's read fails the room naming the pool,
    the unit and the stage that sent it."""
    c = StageKindCluster(daemon.url, model, f"kg-{request.node.callspec.id[:24]}", split, 1, "never",
                         verify_digest=True)
    ep, spec = c.decode, c.specs[pool]
    real, flip = ep._read_for_commit, []

    def corrupt_then_read(a):
        for off in flip:
            c.dst[(pool, layer)].view(-1).view(torch.uint8)[off] ^= 0xFF
        flip.clear()
        real(a)

    ep._read_for_commit = corrupt_then_read
    try:
        rx, txs = c.room(700, 131, (40, 96), width)
        assert rx.poll() == kvb.KVPoll.Success, rx.failure_reason
        assert differing(c.specs, c.dst, expected(c.specs, c.src, 131)) == []
        ext = kvb.needed_extent(spec, 131)
        where = decode_units(c.specs, 131)[pool][unit - ext.first] if pool in decode_units(c.specs, 131) \
            else decode_pages(131)[unit]
        flip.append(int(where) * spec.bytes_per_page)  # (the unit's first row travels)
        rx, txs = c.room(701, 131, (40, 96), width, slot=4)
        assert rx.poll() == kvb.KVPoll.Failed
        assert f"digest mismatch in pool {pool!r} ({spec.kind}), unit {unit} (from cp0/tp0/pp{stage})" \
            in rx.failure_reason, rx.failure_reason
    finally:
        ep._read_for_commit = real
        c.close()

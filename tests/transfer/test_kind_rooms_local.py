"""Window, compressed and state pools through the rooms (prefill and decode endpoints, one
process, the local engine, a real bootstrap daemon): a tiny DeepSeek-V4 and a hybrid (paged
window + Mamba state), chunked, CP 1 and (hybrid) CP 2. Every byte of decode's pools is
compared with the expected buffers: what decode needs arrived, nothing else was written (no page
outside the window, no entry of an incomplete window, no padding row), and the bytes the
prefill ranks posted equal ``needed_bytes`` plus the aux row."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import kvbridge as kvb
from _kind_rooms import (AUX, CAP, buffers, contract, decode_pages, decode_units, differing, expected, model_specs,
                         send_room)
from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.errors import ConfigError, LayoutError
from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
from kvbridge.transfer.engine.local import LocalFabric
from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint


class KindCluster:
    """CP prefill ranks and one decode rank of one model, on one LocalFabric."""

    def __init__(self, url: str, model: str, name: str, cp: int = 1, staging: tuple[str, str] = ("never", "never"),
                 slot_bytes: int = 0, verify_digest: bool = False, aux_inline: bool = True) -> None:
        """``staging``: prefill's and decode's setting; ``slot_bytes``: both sides' staging slots;
        ``verify_digest``: decode checks page and unit digests; ``aux_inline``: decode takes the aux
        row in the report (False: as a write, the row's bytes then posted with the last write)."""
        self.specs = model_specs(model)
        self.contract = contract(self.specs)
        self.fabric = LocalFabric()
        self.lanes = kvb.OwnerLanes(cp, "interleaved")
        self.clients, self.prefill = [], []
        self.src = buffers(self.specs, seed=11)  # every CP rank holds the same bytes: it sends its own share
        for rank in range(cp):
            cfg = PrefillConfig(instance=f"{name}-p", cp_rank=rank, cp_size=cp, staging=staging[0], lease_ttl=5.0,
                                staging_slot_bytes=slot_bytes)
            ep = PrefillEndpoint(cfg, kvb.create_engine("local", fabric=self.fabric), self.specs,
                                 {k: v.clone() for k, v in self.src.items()}, self.contract, self._client(url), AUX)
            ep.start()
            self.prefill.append(ep)
        self.dst = buffers(self.specs, seed=None)
        self.aux = torch.zeros((4, AUX.row_bytes), dtype=torch.uint8)
        cfg = DecodeConfig(instance=f"{name}-d", staging=staging[1], lease_ttl=5.0, peer_timeout=5.0, ping_interval=0.2,
                           staging_slot_bytes=slot_bytes, verify_digest=verify_digest, aux_inline=aux_inline)
        self.decode = DecodeEndpoint(cfg, kvb.create_engine("local", fabric=self.fabric), self.specs, self.dst,
                                     self.contract, self._client(url), self.aux, AUX)
        self.decode.start()

    def _client(self, url: str) -> BootstrapClient:
        c = BootstrapClient(url)
        self.clients.append(c)
        return c

    def room(self, room: int, n: int, cuts: tuple[int, ...], slot: int = 3):
        rx = self.decode.receiver(room, self.prefill[0].config.instance)
        rx.init(decode_pages(n), 0, n, kind_units=decode_units(self.specs, n, slot) or None)
        txs = []
        for rank, ep in enumerate(self.prefill):
            tx = ep.sender(room)
            send_room(tx, n, cuts, self.lanes, rank, room, self.specs)
            txs.append(tx)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (rx.poll() in (kvb.KVPoll.Success, kvb.KVPoll.Failed)
                                                    and all(t.poll() in (kvb.KVPoll.Success, kvb.KVPoll.Failed)
                                                            for t in txs)):
            time.sleep(0.02)
        return rx, txs

    def close(self) -> None:
        self.decode.close(timeout=2)
        for ep in self.prefill:
            ep.close(timeout=2)
        for ep in (self.decode, *self.prefill):  # (an endpoint leaves its engine to whoever made it)
            ep.engine.close()
        for c in self.clients:
            c.close()


@pytest.mark.parametrize("model, cp, n, cuts", [
    ("v4", 1, 131, (40, 96)),  # entries of both ratios complete, tails, a window across chunks
    ("v4", 1, 45, ()),  # one chunk: one HCA entry, a CSA tail
    ("hybrid", 1, 22, (9,)),  # window of 6 tokens: pages 4 and 5 only; state with the last chunk
    ("hybrid", 2, 30, (13, 21)),  # CP 2: window pages from their owner lanes, state from the last token's owner
    ("hybrid", 2, 3, ()),  # CP 2, one page: cp1 owns nothing and sends nothing, yet completes
])
def test_kind_pools_move_exactly_what_decode_needs(daemon, request, model, cp, n, cuts):
    c = KindCluster(daemon.url, model, f"kr-{request.node.callspec.id[:20]}", cp)
    try:
        rx, txs = c.room(500 + n, n, cuts)
        assert rx.poll() == kvb.KVPoll.Success, rx.failure_reason
        assert all(t.poll() == kvb.KVPoll.Success for t in txs)
        assert differing(c.specs, c.dst, expected(c.specs, c.src, n)) == []
        needed = sum(kvb.needed_bytes(s, n) for s in c.specs.values())
        assert c.decode.aux_inline  # the aux row travels in its report: no byte of it is posted
        assert sum(t.stats["bytes"] for t in txs) == needed
        assert rx.stats["bytes"] == needed  # what decode counts it received
    finally:
        c.close()


@pytest.mark.parametrize("model, cp, n, cuts, staging, inline", [
    ("v4", 1, 131, (40, 96), ("always", "always"), False),  # staged only, many 4 KiB chunks per write
    ("v4", 1, 45, (), ("always", "auto"), True),  # prefill stages what decode's area takes under auto
    ("hybrid", 2, 30, (13, 21), ("auto", "always"), False),  # CP 2, window pages from their lanes, state last
    ("hybrid", 2, 3, (), ("auto", "always"), True),  # cp1 owns nothing: no slot asked, yet the room completes
])
def test_staged_kind_pools_move_exactly_what_decode_needs(daemon, request, model, cp, n, cuts, staging, inline):
    """The same rooms through staging slots: every byte of decode's pools as the direct path
    writes them, the bytes staged equal to ``needed_bytes`` (plus the aux row where decode takes
    it as a write: it then rides in the last write's chunks, beside the state slot; inline, in
    its report), and every target staged."""
    c = KindCluster(daemon.url, model, f"ks-{request.node.callspec.id[:20]}", cp, staging, slot_bytes=4096,
                    aux_inline=inline)
    try:
        rx, txs = c.room(800 + n, n, cuts)
        assert rx.poll() == kvb.KVPoll.Success, rx.failure_reason
        assert all(t.poll() == kvb.KVPoll.Success for t in txs), [(t.poll(), t.stats) for t in txs]
        assert differing(c.specs, c.dst, expected(c.specs, c.src, n)) == []
        needed = sum(kvb.needed_bytes(s, n) for s in c.specs.values())
        stats = [t.stats for t in txs]
        row = 0 if inline else AUX.row_bytes
        assert c.decode.aux_inline == inline
        assert sum(s["bytes"] for s in stats) == needed + row
        assert sum(s["bytes_staged"] for s in stats) == needed + row  # nothing went direct
        assert all(set(s["paths"].values()) <= {"staged"} for s in stats), stats
        assert rx.stats["bytes"] == needed
        if model == "v4" and n > 100:
            assert sum(s["chunks"] for s in stats) > 3  # several slots per write
    finally:
        c.close()


@pytest.mark.parametrize("model, cp, n, cuts, pool, staging", [
    ("v4", 1, 131, (40, 96), "csa", ("never", "never")),  # a compressed entry page, direct
    ("v4", 1, 131, (40, 96), "hca_tail", ("always", "always")),  # a tail state slot, staged
    ("hybrid", 2, 30, (13, 21), "swa", ("never", "never")),  # a paged window's page, CP 2 (from its owner lane)
    ("hybrid", 1, 22, (9,), "mamba_ssm", ("always", "always")),  # a Mamba state slot, staged
])
def test_a_corrupted_kind_unit_fails_the_room_by_pool_and_unit(daemon, request, model, cp, n, cuts, pool, staging):
    """verify_digest with window, compressed and state pools: a clean room commits; a byte of one
    kind unit flipped on decode after it landed (before the commit reads the units back) fails
    the room naming the pool and the unit; prefill's bytes are untouched."""
    c = KindCluster(daemon.url, model, f"kd-{request.node.callspec.id[:20]}", cp, staging,
                    slot_bytes=4096 if staging[0] == "always" else 0, verify_digest=True)
    ep, spec = c.decode, c.specs[pool]
    real = ep._read_for_commit
    flip: list[int] = []  # byte offsets of (pool, last layer) to flip before the next commit read

    def corrupt_then_read(a):
        for off in flip:
            c.dst[(pool, spec.layer_ids[-1])].view(-1).view(torch.uint8)[off] ^= 0xFF
        flip.clear()
        real(a)

    ep._read_for_commit = corrupt_then_read
    try:
        rx, txs = c.room(900 + n, n, cuts)
        assert rx.poll() == kvb.KVPoll.Success, rx.failure_reason
        assert differing(c.specs, c.dst, expected(c.specs, c.src, n)) == []
        ext = kvb.needed_extent(spec, n)
        if spec.kind == "state":
            unit, where, name = 4, 0, "state slot"  # the second room's slot (its first byte always travels)
        elif spec.kind == "compressed":
            logical = ext.first + 1
            unit, where, name = decode_units(c.specs, n)[pool][1], 0, f"unit {logical}"
        else:  # the window's last page on the room's mapping: its first row travels
            logical = ext.stop - 1
            unit, where, name = decode_pages(n)[logical], 0, f"unit {logical}"
        flip.append(unit * spec.bytes_per_page + where)
        rx, txs = c.room(950 + n, n, cuts, slot=4)
        assert rx.poll() == kvb.KVPoll.Failed
        assert f"digest mismatch in pool {pool!r} ({spec.kind}), {name}" in rx.failure_reason, rx.failure_reason
    finally:
        ep._read_for_commit = real
        c.close()


def test_a_failed_rooms_state_slot_is_refused_until_no_write_can_reach_it(daemon):
    """Decode aborts a room whose prefill rank never sent: its state slot stays taken (a write may
    still land) until the prefill rank acknowledged the abort, like its pages; then a new room
    may use it."""
    c = KindCluster(daemon.url, "hybrid", "kr-slot")
    try:
        n = 22
        rx = c.decode.receiver(600, "kr-slot-p")
        rx.init(decode_pages(n), 0, n, kind_units=decode_units(c.specs, n, slot=7))
        tx = c.prefill[0].sender(600)  # the room exists on prefill: the request is taken, nothing sent
        deadline = time.monotonic() + 10
        while tx.poll() != kvb.KVPoll.WaitingForInput and time.monotonic() < deadline:
            time.sleep(0.02)
        rx.abort("test")
        other = c.decode.receiver(601, "kr-slot-p")
        try:
            other.init(decode_pages(n), 0, n, kind_units=decode_units(c.specs, n, slot=7))
        except kvb.KVBridgeError as exc:
            assert "state slot 7" in str(exc)
            deadline = time.monotonic() + 10
            while not rx.pages_releasable and time.monotonic() < deadline:
                time.sleep(0.02)
            assert rx.pages_releasable
            other.close()
            other = c.decode.receiver(602, "kr-slot-p")
            other.init(decode_pages(n), 0, n, kind_units=decode_units(c.specs, n, slot=7))  # free with the pages
        else:
            assert rx.pages_releasable  # the ack came first (read after: it came before the slot was taken)
        other.abort("done")
        tx.close()
    finally:
        c.close()


def test_what_the_rooms_do_not_carry_is_refused_at_construction_by_name(daemon):
    specs = model_specs("v4")
    bufs = buffers(specs, None)
    ct = contract(specs)
    client = BootstrapClient(daemon.url)
    eng = kvb.create_engine("local", fabric=LocalFabric())
    try:
        cases = [
            (PrefillConfig(instance="kr-r2", cp_size=2, staging="never"), "cp_size"),  # compressed under CP lanes
        ]
        for cfg, field in cases:
            with pytest.raises(ConfigError) as err:
                PrefillEndpoint(cfg, eng, specs, bufs, ct, client, AUX)
            assert err.value.field == field, err.value
    finally:
        eng.close()
        client.close()


def test_kind_units_outside_the_registered_slots_are_refused(daemon):
    c = KindCluster(daemon.url, "hybrid", "kr-units")
    try:
        tx = c.prefill[0].sender(700)
        tx.init(22, kind_units={k: np.array([1]) for k in ("mamba_conv", "mamba_ssm")})
        with pytest.raises(LayoutError, match="kind_units"):  # a unit outside our registered slots
            tx.send(np.arange(6), np.arange(6) + 1, num_tokens_ready=22, is_last=True,
                    kind_units={"mamba_conv": np.array([CAP])})
        tx.close()
    finally:
        c.close()


def test_digests_over_padded_pages_given_as_an_address_are_refused_at_construction(daemon):
    """vLLM's Mamba states are cut out of larger blocks: host pages padded to a stride, given as an
    address whose last page ends with its payload. kvbridge cannot read such a region back as
    pages, so decode with ``verify_digest`` refuses it when built, naming the field and the pool,
    instead of failing the first room deep in the digest code; without digests it is accepted."""
    import dataclasses

    from kvbridge.layout import RawBuffer

    plain = model_specs("hybrid")
    specs = {n: dataclasses.replace(s, page_stride=s.bytes_per_page + 64, num_heads=0, shard_units=(),
                                     unit_bytes=0, tp_size=1)  # replicated
             if s.kind == "state" else s for n, s in plain.items()}
    bufs, keep = buffers(plain, None), []
    for (name, lid) in list(bufs):
        spec = specs[name]
        if spec.kind == "state":
            region = np.zeros(CAP * spec.page_stride, np.uint8)
            keep.append(region)
            bufs[(name, lid)] = RawBuffer(region.ctypes.data, (CAP - 1) * spec.page_stride + spec.payload_bytes_per_page)
    client = BootstrapClient(daemon.url)
    eng = kvb.create_engine("local", fabric=LocalFabric())
    aux = torch.zeros((8, AUX.row_bytes), dtype=torch.uint8)
    try:
        with pytest.raises(ConfigError, match=r"verify_digest is on.*pool 'mamba_conv' layer 1: host pages padded") as err:
            DecodeEndpoint(DecodeConfig(instance="kr-pad-d", verify_digest=True), eng, specs, bufs, contract(specs),
                           client, aux, AUX)
        assert err.value.field == "verify_digest"
        ep = DecodeEndpoint(DecodeConfig(instance="kr-pad-d"), eng, specs, bufs, contract(specs), client, aux, AUX)
        assert not ep.buffers.readable
        ep.close(timeout=2)
    finally:
        eng.close()
        client.close()

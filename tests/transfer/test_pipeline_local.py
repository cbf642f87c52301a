"""Pipeline-parallel prefill end to end in one process: pp 2 and pp 3 prefill stages (CP 1
and CP 2) on the local engine, one pp-1 decode rank holding every layer, a real bootstrap
daemon. Every stage registers and sends only its layers (target and index-K by the split,
the draft layer and the aux row by the last stage); decode commits once every stage's
range arrived, bytes equal per (pool, layer). A stage that never sends fails the room
naming it; a stage that aborts fails the room on every side."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _cluster import wait_until
from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.errors import ConfigError, TopologyError
from kvbridge.layout import OwnerLanes, stage_specs
from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
from kvbridge.transfer.engine import create_engine
from kvbridge.transfer.engine.local import LocalFabric
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint
from kvbridge.worker.resources import allocate_buffers, aux_schema_of, build_contract, build_specs
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes, fill_pages, make_aux, verify_aux, verify_pages

PAGE, LAYERS, PAGES = 4, 6, 64
FINAL = (KVPoll.Success, KVPoll.Failed)


def split(pp: int) -> list[tuple[int, int]]:
    """Uneven on purpose: the first stage holds one layer, the rest share the others."""
    cuts = [0, 1] + [1 + (LAYERS - 1) * s // (pp - 1) for s in range(1, pp)]
    return [(cuts[s], cuts[s + 1]) for s in range(pp)]


class Stages:
    """pp x cp prefill ranks and one decode rank, one LocalFabric."""

    def __init__(self, url: str, name: str, pp: int, cp: int, layers: list[tuple[int, int]] | None = None,
                 prefill_cfg: dict | None = None, **decode_cfg) -> None:
        self.specs = build_specs("deepseek-v3.2-fp8", LAYERS, PAGE, 1)
        self.contract = build_contract("deepseek-v3.2-fp8", LAYERS, PAGE, 1, "interleaved")
        self.schema = aux_schema_of(self.contract)
        self.fabric = LocalFabric()
        self.lanes = OwnerLanes(cp, "interleaved")
        self.pp, self.cp, self.name = pp, cp, name
        self.layers = layers or split(pp)
        self.clients: list[BootstrapClient] = []
        self.prefill: dict[tuple[int, int], PrefillEndpoint] = {}
        self.rng = np.random.default_rng(7)
        try:
            for c in range(cp):
                for s in range(pp):
                    cfg = PrefillConfig(instance=f"{name}-p", cp_rank=c, cp_size=cp, pp_rank=s, pp_size=pp,
                                        pp_layers=self.layers[s], lease_ttl=5.0, target_timeout=20.0,
                                        housekeeping_interval=0.1, **(prefill_cfg or {}))
                    bufs = allocate_buffers(stage_specs(self.specs, self.layers[s], LAYERS), PAGES)
                    ep = PrefillEndpoint(cfg, create_engine("local", fabric=self.fabric), self.specs, bufs,
                                         self.contract, self._client(url), self.schema)
                    self.prefill[(c, s)] = ep
                    ep.start()
            self.dbufs = allocate_buffers(self.specs, PAGES)
            for b in self.dbufs.values():
                as_bytes(b)[:] = SENTINEL_BYTE
            self.aux = torch.zeros((8, self.schema.row_bytes), dtype=torch.uint8)
            # generous liveness bounds: seven endpoint loops share a loaded 2-core machine here
            decode_cfg.setdefault("peer_timeout", 5.0)
            decode_cfg.setdefault("ping_interval", 0.2)
            self.decode = DecodeEndpoint(DecodeConfig(instance=f"{name}-d", lease_ttl=5.0, **decode_cfg),
                                         create_engine("local", fabric=self.fabric), self.specs, self.dbufs,
                                         self.contract, self._client(url), self.aux, self.schema)
            self.decode.start()
        except BaseException:
            self.close()
            raise

    def _client(self, url: str) -> BootstrapClient:
        c = BootstrapClient(url)
        self.clients.append(c)
        return c

    def open(self, room: int, n: int, stages=None):
        """Every rank (of ``stages``) fills its owned pages of its layers at random local pages and
        opens its sender; returns the senders with what each sends."""
        num_pages = -(-n // PAGE)
        out = {}
        for (c, s), ep in self.prefill.items():
            if stages is not None and s not in stages:
                continue
            owned = self.lanes.owned_pages(c, num_pages)
            local = self.rng.choice(PAGES, owned.size, replace=False)
            for (pool, layer), buf in ep.buffers.tensors.items():
                fill_pages(self.specs[pool], buf, room, layer, owned, local, n)
            sender = ep.sender(room)
            sender.init(n)
            out[(c, s)] = (sender, owned, local)
        return out

    def send(self, room: int, n: int, opened) -> None:
        num_pages = -(-n // PAGE)
        for (c, s), (sender, owned, local) in opened.items():
            last = s == self.pp - 1 and self.lanes.owner_of_token(n - 1, PAGE, num_pages) == c
            sender.send(owned, local, is_last=True, aux=make_aux(self.schema, room, n) if last else None)

    def receive(self, room: int, n: int, slot: int):
        num_pages = -(-n // PAGE)
        pages = self.rng.choice(PAGES, num_pages, replace=False)
        r = self.decode.receiver(room, f"{self.name}-p")
        r.init(pages, slot, n)
        return r, pages

    def verify(self, room: int, n: int, pages: np.ndarray, r) -> list[str]:
        errors = [v.first_error for (p, layer), b in self.dbufs.items()
                  if not (v := verify_pages(self.specs[p], b, room, layer, pages, n)).ok]
        err = verify_aux(self.schema, r.aux_regions, room, n)
        return errors + ([err] if err else [])

    def close(self) -> None:
        if getattr(self, "decode", None) is not None:
            self.decode.close(timeout=2)
        for ep in self.prefill.values():
            ep.close(timeout=2)
        for ep in [getattr(self, "decode", None), *self.prefill.values()]:  # (the engines are ours to close)
            if ep is not None:
                ep.engine.close()
        for c in self.clients:
            c.close()


def final(*handles, timeout: float = 30) -> bool:
    return wait_until(lambda: all(h.poll() in FINAL for h in handles), timeout)


@pytest.mark.parametrize("pp, cp, digest", [(2, 1, False), (2, 2, True), (3, 1, True), (3, 2, False)])
def test_stages_send_their_layers_and_decode_commits_every_byte(daemon, pp, cp, digest) -> None:
    """``digest``: decode checks each stage's page digests over that stage's layers too."""
    st = Stages(daemon.url, f"pp{pp}cp{cp}", pp, cp, verify_digest=digest)
    try:
        # each stage registered its own layers only: the draft (id LAYERS) with the last stage
        held = {s: sorted({(d.pool, d.layer_id) for d in st.prefill[(0, s)].buffers.descs}) for s in range(pp)}
        assert all(("draft", LAYERS) in held[s] for s in [pp - 1]) and not any(
            p == "draft" for s in range(pp - 1) for p, _ in held[s])
        assert sorted(x for s in range(pp) for x in held[s]) == sorted(
            (p, lid) for p, spec in st.specs.items() for lid in spec.layer_ids)
        for i, n in enumerate((1, 13, 37, 4 * 11)):
            room = 100 + i
            r, pages = st.receive(room, n, slot=i % 8)
            opened = st.open(room, n)
            st.send(room, n, opened)
            assert final(r, *(s for s, _, _ in opened.values())), (r.poll(), r.failure_reason)
            assert r.poll() == KVPoll.Success, r.failure_reason
            assert all(s.poll() == KVPoll.Success for s, _, _ in opened.values()), \
                {k: (s.poll(), s.failure_reason) for k, (s, _, _) in opened.items()}
            assert st.verify(room, n, pages, r) == []
            assert set(r.stats["pages_by_stage"]) == set(range(pp))  # the stats name each stage
            r.close()
            for s, _, _ in opened.values():
                s.close()
    finally:
        st.close()


SLOT = 4096  # a few pages per chunk: every room streams through several staging slots


def test_staged_writes_from_every_stage_land_through_decode_staging_slots(daemon) -> None:
    """Staging "always": each stage's chunks go through decode's staging slots (their keys carry
    the stage), scattered into the pages; every byte checked."""
    st = Stages(daemon.url, "staged", 3, 2, staging="always", staging_bytes=4 * SLOT, staging_slot_bytes=SLOT,
                prefill_cfg=dict(staging="always", staging_bytes=2 * SLOT, staging_slot_bytes=SLOT))
    try:
        for i, n in enumerate((9, 61)):
            room = 300 + i
            r, pages = st.receive(room, n, slot=i)
            opened = st.open(room, n)
            st.send(room, n, opened)
            assert final(r, *(s for s, _, _ in opened.values()))
            assert r.poll() == KVPoll.Success, r.failure_reason
            assert st.verify(room, n, pages, r) == []
            for key, (s, owned, _) in opened.items():  # every stage with pages staged them
                if owned.size:
                    assert set(s.stats["paths"].values()) == {"staged"} and s.stats["chunks"] >= 1, (key, s.stats)
    finally:
        st.close()


def test_a_stage_that_never_sends_fails_the_room_naming_it(daemon) -> None:
    st = Stages(daemon.url, "silent", 3, 1, transfer_timeout=1.5)
    try:
        r, _ = st.receive(7, 21, slot=0)
        opened = st.open(7, 21, stages={0, 2})  # stage 1 never opens its sender
        st.send(7, 21, opened)
        assert final(r)
        assert r.poll() == KVPoll.Failed
        reason = r.failure_reason or ""
        assert "transfer timeout" in reason and "target@pp1" in reason and "from pipeline stage(s) pp1" in reason, reason
        assert "pp0" not in reason.split("missing")[1] and "pp2" not in reason.split("missing")[1], reason
    finally:
        st.close()


def test_one_stage_aborting_fails_the_room_on_every_side(daemon) -> None:
    st = Stages(daemon.url, "abort", 2, 2)
    try:
        r, _ = st.receive(9, 30, slot=1)
        opened = st.open(9, 30)
        opened[(1, 0)][0].abort("stage 0 of cp 1 gave up")
        assert final(r, *(s for s, _, _ in opened.values()))
        assert r.poll() == KVPoll.Failed and "stage 0 of cp 1 gave up" in (r.failure_reason or "")
        assert "cp rank 1/pp0" in r.failure_reason, r.failure_reason
        for key, (s, _, _) in opened.items():
            assert s.poll() == KVPoll.Failed, (key, s.failure_reason)
        assert wait_until(lambda: r.pages_releasable, 10)  # every stage acknowledged (hard rule 6)
    finally:
        st.close()


def test_a_stage_without_layers_or_with_the_wrong_end_is_refused_at_construction(daemon) -> None:
    with pytest.raises(ConfigError, match="needs pp_layers"):
        PrefillConfig(instance="x", pp_rank=1, pp_size=2)
    specs = build_specs("deepseek-v3.2-fp8", LAYERS, PAGE, 1)
    contract = build_contract("deepseek-v3.2-fp8", LAYERS, PAGE, 1, "interleaved")
    client = BootstrapClient(daemon.url)
    engine = create_engine("local", fabric=LocalFabric())
    try:
        cfg = PrefillConfig(instance="x", pp_rank=1, pp_size=2, pp_layers=(3, 5))
        with pytest.raises(ConfigError, match="the last stage's layers end at the model's last target layer"):
            PrefillEndpoint(cfg, engine, specs, {}, contract, client, aux_schema_of(contract))
    finally:
        engine.close()
        client.close()


def test_overlapping_stages_are_refused_at_registration(daemon) -> None:
    """The second stage's registration is refused by the daemon, naming both stages."""
    with pytest.raises(TopologyError, match=r"pp0 \[0, 3\) and pp1 \[2, 6\) overlap at layers \[2, 3\)"):
        Stages(daemon.url, "overlap", 2, 1, layers=[(0, 3), (2, 6)])  # (it closes what it started)

"""Endpoints in one process over the local engine (fault injection): CP prefill ranks
and one decode rank on one LocalFabric, against a real bootstrap daemon."""

from __future__ import annotations

import threading

import numpy as np
import torch

from _cluster import wait_until
from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.bootstrap.contract import fingerprint
from kvbridge.layout import OwnerLanes
from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel import PeerSet
from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
from kvbridge.transfer.engine import create_engine
from kvbridge.transfer.engine.local import LocalFabric
from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint
from kvbridge.worker.resources import allocate_buffers, aux_schema_of, build_contract, build_specs
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes, fill_pages, make_aux, verify_pages

PAGE, LAYERS = 4, 2


class HostEvent:
    """Stands in for a CUDA event (``after=`` / ``ready_event=``): ``query()`` and
    ``synchronize()``, completed by ``set()``."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        assert self._done.wait(30), "event never completed"

    def set(self) -> None:
        self._done.set()


class Cluster:
    """CP prefill ranks + one decode rank, one LocalFabric, all in this process."""

    def __init__(self, url: str, name: str, cp: int = 2, *, prefill_secret: bytes | None = None,
                 decode_secret: bytes | None = None, lane_rule: str = "interleaved", prefill_cfg: dict | None = None,
                 engine: str = "local", **decode_cfg) -> None:
        self.specs = build_specs("deepseek-v3.2-fp8", LAYERS, PAGE, 1)
        self.contract = build_contract("deepseek-v3.2-fp8", LAYERS, PAGE, 1, lane_rule)
        self.aux_schema = aux_schema_of(self.contract)
        self.fabric = LocalFabric()
        self.lanes = OwnerLanes(cp, lane_rule)
        self.name = name
        self.clients = []
        self.engines = []  # closed after the endpoints (an endpoint never closes the engine it was handed)
        self.prefill = []
        self.engine_kind = engine  # "ipc": the same-host engine, host memory in one process
        for rank in range(cp):
            eng = self._engine()
            cfg = PrefillConfig(instance=f"{name}-p", cp_rank=rank, cp_size=cp, lease_ttl=2.0,
                                secret=prefill_secret, lane_rule=lane_rule, housekeeping_interval=0.1,
                                **{"target_timeout": 2.0, **(prefill_cfg or {})})
            ep = PrefillEndpoint(cfg, eng, self.specs, allocate_buffers(self.specs, 64), self.contract,
                                 self._client(url), self.aux_schema)
            ep.start()
            self.prefill.append(ep)
        self.dbufs = allocate_buffers(self.specs, 64)
        for b in self.dbufs.values():
            as_bytes(b)[:] = SENTINEL_BYTE
        self.aux = torch.zeros((8, self.aux_schema.row_bytes), dtype=torch.uint8)
        decode_cfg.setdefault("peer_timeout", 2.0)
        decode_cfg.setdefault("ping_interval", 0.1)
        dcfg = DecodeConfig(instance=f"{name}-d", lease_ttl=2.0, secret=decode_secret, **decode_cfg)
        self.decode = DecodeEndpoint(dcfg, self._engine(), self.specs, self.dbufs,
                                     self.contract, self._client(url), self.aux, self.aux_schema)
        self.decode.start()

    def _engine(self):
        kwargs = {"fabric": self.fabric} if self.engine_kind == "local" else {}
        engine = create_engine(self.engine_kind, **kwargs)
        self.engines.append(engine)
        return engine

    def _client(self, url: str) -> BootstrapClient:
        c = BootstrapClient(url)
        self.clients.append(c)
        return c

    def send(self, room: int, n: int, ranks=None, corrupt_room: int | None = None, aux=None, binding: bytes = b""):
        """Fill and send every rank's owned pages of ``room``; returns the senders. ``aux``: the
        row the owner of the last token sends (default: a good one)."""
        num_pages = -(-n // PAGE)
        senders = []
        for rank, ep in enumerate(self.prefill):
            if ranks is not None and rank not in ranks:
                continue
            owned = self.lanes.owned_pages(rank, num_pages)
            local = np.arange(owned.size) + 10
            for (pool, layer), buf in ep.buffers.tensors.items():
                fill_pages(self.specs[pool], buf, room, layer, owned, local, n)
            s = ep.sender(room)
            s.init(n, binding=binding)
            owns_last = self.lanes.owner_of_token(n - 1, PAGE, num_pages) == rank
            row = make_aux(self.aux_schema, corrupt_room or room, n) if aux is None else aux
            if corrupt_room is not None:
                row["room"] = room  # echo ok at send time; the engine corrupts it in flight
            s.send(owned, local, is_last=True, aux=row if owns_last else None)
            senders.append(s)
        return senders

    def verified(self, room: int, n: int, pages: np.ndarray) -> bool:
        return all(verify_pages(self.specs[p], b, room, layer, pages, n).ok for (p, layer), b in self.dbufs.items())

    def close(self, engines: bool = True) -> None:
        """The endpoints and clients, then the engines (``engines=False``: left open, as an
        embedder's engine outlives an endpoint; the caller closes ``self.engines``)."""
        self.decode.close(timeout=2)
        for ep in self.prefill:
            ep.close(timeout=2)
        for c in self.clients:
            c.close()
        for engine in self.engines if engines else ():
            engine.close()


def rogue_request(c: Cluster, room: int, n: int, rank_id: str, aux_slot: int = 0) -> wire.TransferRequest:
    """A TransferRequest crafted by hand (pages 0.. of the decode pools), naming registration ``rank_id``."""
    return wire.TransferRequest(
        room=room, decode_rank="rogue/dp0/tp0", decode_rank_id=rank_id,
        page_ids=wire.pack_pages(np.arange(-(-n // PAGE))), first_page=0, pools=sorted(c.specs), aux_slot=aux_slot,
        num_tokens=n, deadline_ms=10_000, want_digest=False, fingerprint=fingerprint(c.decode.contract), num_decode_ranks=1)


class ProvingPeers(PeerSet):
    """A hand-driven decode connection for ``endpoint``'s registration (named in its Hello, or
    ``rank_id``) that answers prefill's ownership proof as the decode rank itself does: its
    KeyChallenge with ``endpoint``'s proof key, its Challenge by writing its memory proof into
    ``endpoint``'s scratch region (or, by write, echoing the nonce there; this process holds both). Challenges are answered inside ``recv_ready`` and never returned."""

    def __init__(self, endpoint, *, secret: bytes | None = None, rank_id: str | None = None) -> None:
        super().__init__(secret=secret, name=rank_id or endpoint.rank_id)
        self.scratch = endpoint.scratch
        self.proof_key = endpoint.proof_key

    def recv_ready(self, timeout_ms: int) -> list:
        out = []
        for where, msg in super().recv_ready(timeout_ms):
            if isinstance(msg, wire.KeyChallenge):
                self.send(where, wire.KeyProof(signature=self.proof_key.sign(self.name, where, msg.nonce)))
            elif isinstance(msg, wire.Challenge) and msg.nonce:  # proof by read: write ours, say so
                proof = self.proof_key.sign_memory(self.name, where, msg.nonce, msg.offset)
                self.scratch.write(msg.offset, proof)
                self.send(where, wire.ChallengeEcho(nonce=bytes(wire.NONCE_BYTES)))
            elif isinstance(msg, wire.Challenge):
                self.send(where, wire.ChallengeEcho(nonce=self.scratch.read(msg.offset)))
            else:
                out.append((where, msg))
        return out


def replies(peers: PeerSet, count: int, timeout: float = 10) -> list:
    """Messages that arrive on ``peers`` (up to ``count``, within ``timeout``)."""
    got: list = []
    wait_until(lambda: got.extend(m for _, m in peers.recv_ready(50)) or len(got) >= count, timeout)
    return got


class RecordingCopier:
    """Stands in for the GPU copier of a ``CudaStager``: what went to the kernel (``launches``) and
    what by plain copies (``copies``)."""

    def __init__(self) -> None:
        self.launches, self.copies = [], []

    def launch(self, src, dst, length):
        self.launches.append((src.tolist(), dst.tolist(), length.tolist()))

    def copy_async(self, dst, src, nbytes):
        self.copies.append((src, dst, nbytes))

    def record(self):
        return None  # (the event a gather or scatter returns)

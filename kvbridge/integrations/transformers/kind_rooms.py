"""Model mode through the rooms for any model whose cache is kvbridge pools of every kind
(paged, window, compressed, state): ``cp_size`` prefill endpoints (CP ranks) and one decode
endpoint in one process, a bootstrap daemon, a room per request.

    decode      receiver(room).init(the room's token pages, aux slot, n,
                                    kind_units={entry pages, state slots})
    prefill r   sender(room).init(n, kind_units={its entry pages, its state slot})
                per chunk [done, end): write_cache(cache after end)
                  -> send(the token pages it owns of [done, end), its local pages, num_tokens_ready=end,
                          is_last, aux = first token with the last chunk if it owns the last token)
    decode      Success -> read_cache -> greedy steps from the aux row's first token

Which CP rank sends what is the rule of docs/concepts.md ("Who owns what"), applied by the
rooms (``kvbridge.lane_units``): a token page (paged, or a window's page) from its owner lane,
a state slot from the owner of the last valid token (with the aux row), compressed entries only
at CP 1 or under ``replicated`` lanes (an entry needs its R tokens on one rank; interleaved,
contiguous and balanced lanes are refused at construction, field ``cp_size``).

CP attention is simulated, as everywhere in model mode: the prompt is prefilled once and every
CP rank's pools are written from that one cache (each rank would compute the same), so the
page split, which rank sends which unit, the aux row's rank and decode's ledger are real, CP
attention is not. Only kvbridge's public API is used.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

import kvbridge as kvb
from kvbridge.integrations.transformers.kinds import KindPools
from kvbridge.integrations.transformers.v4 import greedy_decode, prefill_chunks

__all__ = ["KindRooms"]

TOKEN_PAGED = ("paged", "window")


class KindRooms:
    """``cp_size`` prefill endpoints and a decode endpoint of ``model``'s pools (``specs``,
    ``capacity`` units each, buffers of ``pools_cls``), for one request at a time (``run``);
    ``close()`` them. ``engine``: "mooncake" or "local"; ``lane_rule``: the CP layout rule."""

    def __init__(self, model: Any, specs: Mapping[str, kvb.PoolSpec], pools_cls: type[KindPools], bootstrap_url: str,
                 *, token: str | None = None, engine: str = "mooncake", cp_size: int = 1,
                 lane_rule: str = "interleaved", capacity: int = 128, instance: str = "tiny-model") -> None:
        self.model = model
        self.specs = dict(specs)
        paged = {s.page_size for s in self.specs.values() if s.kind in TOKEN_PAGED}
        if len(paged) != 1:
            raise kvb.ConfigError(f"the room's token-paged pools need one page size, got {sorted(paged)}",
                                  field="page_size")
        self.page_size = paged.pop()
        self.lanes = kvb.OwnerLanes(cp_size, lane_rule)
        self.capacity = capacity
        self.aux = kvb.AuxSchema.standard(int(model.config.hidden_size), "float32", 0)
        contract = kvb.contract_for(self.specs, model=instance, aux=self.aux, lane_rule=lane_rule)
        self.src = [pools_cls(self.specs, capacity) for _ in range(cp_size)]
        self.dst = pools_cls(self.specs, capacity, fill=0xEE)
        first = kvb.create_engine(engine)
        engines = [first] + [kvb.create_engine(engine, fabric=first.fabric) if engine == "local"
                             else kvb.create_engine(engine) for _ in range(cp_size)]
        self._engines = engines  # ours: the endpoints do not close the engines they are handed
        self.clients = [kvb.BootstrapClient(bootstrap_url, token=token) for _ in range(cp_size + 1)]
        self.instance = f"{instance}-prefill"
        self.prefill, self.decode = [], None
        try:
            for r in range(cp_size):
                cfg = kvb.PrefillConfig(instance=self.instance, cp_rank=r, cp_size=cp_size, lane_rule=lane_rule,
                                        staging="never")
                ep = kvb.PrefillEndpoint(cfg, engines[r], self.specs, self._typed(self.src[r]), contract,
                                         self.clients[r], self.aux)
                self.prefill.append(ep)
                ep.start()
            self.aux_rows = torch.zeros((4, self.aux.row_bytes), dtype=torch.uint8)
            self.decode = kvb.DecodeEndpoint(kvb.DecodeConfig(instance=f"{instance}-decode", staging="never"),
                                             engines[cp_size], self.specs, self._typed(self.dst), contract,
                                             self.clients[cp_size], self.aux_rows, self.aux)
            self.decode.start()
        except BaseException:
            self.close()
            raise
        self.next_room = 1

    def _typed(self, pools: KindPools) -> dict[tuple[str, int], torch.Tensor]:
        return {key: buf.view(getattr(torch, self.specs[key[0]].abi)) for key, buf in pools.buffers.items()}

    def _kind_units(self, pools: KindPools) -> dict[str, np.ndarray] | None:
        return {name: pools.units[name] for name, spec in self.specs.items()
                if spec.kind in ("compressed", "state")} or None

    def _share_pages(self, pools: KindPools, pages: np.ndarray, n: int, needed: bool) -> None:
        """Token-paged pools share the room's one page mapping: each takes its part of ``pages``
        (decode, ``needed``: a window pool from its window's first page)."""
        for name, spec in self.specs.items():
            if spec.kind in TOKEN_PAGED:
                first = kvb.needed_extent(spec, n).first if needed and spec.kind == "window" else 0
                pools.units[name], pools.first[name] = pages[first:], first

    # -- what a model adds ----------------------------------------------------------------------------------

    def write_cache(self, pools: KindPools, cache: Any, num_tokens: int, last: bool) -> None:
        pools.write_cache(cache, num_tokens, last)  # type: ignore[attr-defined]

    def read_cache(self, pools: KindPools, num_tokens: int) -> Any:
        return pools.read_cache(self.model.config, num_tokens)  # type: ignore[attr-defined]

    # -- a request ------------------------------------------------------------------------------------------

    def run(self, ids: torch.Tensor, cuts: list[int], steps: int = 4, timeout: float = 60.0) -> dict[str, Any]:
        """One request colocated and through a room; the bytes every prefill rank posted (less the
        aux row) beside the bytes decode needs, per CP rank, logits and tokens compared."""
        n = int(ids.shape[1])
        for cache, *_, logits in prefill_chunks(self.model, ids, cuts):
            pass
        want, want_tokens = greedy_decode(self.model, cache, logits[0].argmax(), steps)
        room, self.next_room = self.next_room, self.next_room + 1
        num_pages = -(-n // self.page_size)
        if num_pages + len(self.src) > self.capacity:
            raise kvb.ConfigError(f"{n} tokens need {num_pages} pages; the pools hold {self.capacity - len(self.src)}",
                                  field="num_tokens")
        # decode: the pages of what it needs (pages before every pool's window stay 0, a spare page
        # never written), reversed; every CP rank: every page of the request (it ran the whole prompt)
        firsts = [kvb.needed_extent(s, n).first if s.kind == "window" else 0
                  for s in self.specs.values() if s.kind in TOKEN_PAGED]
        lo = min(firsts)
        page_ids = np.zeros(num_pages, np.int64)
        page_ids[lo:] = np.arange(num_pages - lo, dtype=np.int64)[::-1] + 1
        self.dst.allocate(n, needed=True, order="reversed", base=1)
        self._share_pages(self.dst, page_ids, n, needed=True)
        for r, pools in enumerate(self.src):
            pools.allocate(n, needed=False, base=1 + r)
            self._share_pages(pools, np.arange(num_pages, dtype=np.int64) + 1 + r, n, needed=False)
        owns_last = [self.lanes.owner_of_token(n - 1, self.page_size, num_pages) == r for r in range(len(self.src))]
        owned = [self.lanes.owned_pages(r, num_pages) for r in range(len(self.src))]
        rx = self.decode.receiver(room, self.instance)
        txs = []
        try:
            rx.init(page_ids, room % len(self.aux_rows), n, kind_units=self._kind_units(self.dst))
            for pools in self.src:
                txs.append(self.prefill[len(txs)].sender(room))
                txs[-1].init(n, kind_units=self._kind_units(pools))
            sent = 0
            paged = next(k for k, s in self.specs.items() if s.kind in TOKEN_PAGED)
            for cache, _, end, last, logits in prefill_chunks(self.model, ids, cuts):
                upto = num_pages if last else -(-end // self.page_size)
                for r, (pools, tx) in enumerate(zip(self.src, txs)):
                    self.write_cache(pools, cache, end, last)
                    mine = owned[r][(owned[r] >= sent) & (owned[r] < upto)]
                    aux = None
                    if last and owns_last[r]:
                        aux = dict(first_token=int(logits[0].argmax()), num_cached_tokens=n, hidden_is_cp_local=True,
                                   hidden=np.zeros(self.aux.region("hidden").count, np.float32),
                                   topk_ids=np.zeros(0, np.int32), topk_probs=np.zeros(0, np.float32))
                    tx.send(mine, pools.units[paged][mine], num_tokens_ready=end, is_last=last, aux=aux)
                sent = upto
            deadline = time.monotonic() + timeout
            final = (kvb.KVPoll.Success, kvb.KVPoll.Failed)
            while (rx.poll() not in final or any(t.poll() not in final for t in txs)) \
                    and time.monotonic() < deadline:
                time.sleep(0.005)
            if rx.poll() != kvb.KVPoll.Success:
                raise kvb.KVBridgeError(f"room {room} did not succeed: {rx.failure_reason or rx.poll().name}",
                                        room=room)
            first = torch.tensor(int(rx.aux.first_token))
            row = 0 if self.decode.aux_inline else self.aux.row_bytes  # (a row in the report is no posted byte)
            per_rank = [int(t.stats["bytes"]) - (row if o else 0) for t, o in zip(txs, owns_last)]
        finally:
            for t in txs:
                t.close()
            rx.close()
        got, got_tokens = greedy_decode(self.model, self.read_cache(self.dst, n), first, steps)
        return {"tokens": n, "cp": len(self.src), "bytes_moved": sum(per_rank), "bytes_per_rank": per_rank,
                "bytes_needed": sum(kvb.needed_bytes(s, n) for s in self.specs.values()),
                "logits_equal": bool(torch.equal(got, want)), "tokens_equal": got_tokens == want_tokens,
                "generated": got_tokens}

    def close(self) -> None:
        if self.decode is not None:
            self.decode.close(timeout=2)
        for ep in self.prefill:
            ep.close(timeout=2)
        for c in self.clients:
            c.close()
        for e in self._engines:  # after their endpoints (each withdrew its memory from its engine)
            e.close()
        self._engines = []

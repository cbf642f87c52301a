"""DeepSeek-V4 in model mode through the rooms: a prefill endpoint and a decode endpoint (one
process, a bootstrap daemon, two transfer engines) move a tiny ``DeepseekV4ForCausalLM``'s window,
compressed and state pools room by room, and decode rebuilds its cache from what arrived.

    decode    receiver(room).init(page ids of the token pages, aux slot, n,
                                  kind_units={entry pages, state slots})   (V4Pools.allocate(needed=True))
    prefill   sender(room).init(n, kind_units={entry pages, state slots})
              per chunk [done, end): write_cache(cache after end) -> send(token pages, their local pages,
                                     num_tokens_ready=end, is_last, aux=first token with the last)
    decode    Success -> read_cache -> greedy steps, from the aux row's first token

The window pool rides on the room's page mapping (only the window's pages travel), the
compressed pools on their entry pages, the compressor state once, with the last chunk. Only
kvbridge's public API is used.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

import kvbridge as kvb
from kvbridge.integrations.transformers.v4 import V4Pools, greedy_decode, prefill_chunks, v4_specs

__all__ = ["V4Rooms"]


class V4Rooms:
    """A prefill and a decode endpoint of ``model``'s V4 pools (``capacity`` units each), for one
    request at a time (``run``); ``close()`` them. ``engine``: "mooncake" or "local"."""

    def __init__(self, model: Any, bootstrap_url: str, *, token: str | None = None, engine: str = "mooncake",
                 page_size: int = 4, capacity: int = 128, instance: str = "tiny-deepseek-v4") -> None:
        self.model = model
        self.specs = v4_specs(model.config, page_size=page_size)
        self.page_size = page_size
        self.aux = kvb.AuxSchema.standard(int(model.config.hidden_size), "float32", 0)
        contract = kvb.contract_for(self.specs, model=instance, aux=self.aux)
        self.src, self.dst = V4Pools(self.specs, capacity), V4Pools(self.specs, capacity, fill=0xEE)
        engines = [kvb.create_engine(engine)]
        # two local engines talk on one fabric: the second joins the first's
        engines.append(kvb.create_engine(engine, fabric=engines[0].fabric) if engine == "local"
                       else kvb.create_engine(engine))
        self.clients = [kvb.BootstrapClient(bootstrap_url, token=token) for _ in "pd"]
        self.instance = f"{instance}-prefill"
        self.prefill = kvb.PrefillEndpoint(kvb.PrefillConfig(instance=self.instance, staging="never"), engines[0],
                                           self.specs, self._typed(self.src), contract, self.clients[0], self.aux)
        self.aux_rows = torch.zeros((4, self.aux.row_bytes), dtype=torch.uint8)
        self.decode = kvb.DecodeEndpoint(kvb.DecodeConfig(instance=f"{instance}-decode", staging="never"),
                                         engines[1], self.specs, self._typed(self.dst), contract, self.clients[1],
                                         self.aux_rows, self.aux)
        self.prefill.start()
        self.decode.start()
        self.next_room = 1

    def _typed(self, pools: V4Pools) -> dict[tuple[str, int], torch.Tensor]:
        return {key: buf.view(getattr(torch, self.specs[key[0]].abi)) for key, buf in pools.buffers.items()}

    def _kind_units(self, pools: V4Pools) -> dict[str, np.ndarray]:
        return {name: pools.units[name] for name, spec in self.specs.items() if spec.kind in ("compressed", "state")}

    def run(self, ids: torch.Tensor, cuts: list[int], steps: int = 4, timeout: float = 60.0) -> dict[str, Any]:
        """One request colocated and through a room; the bytes the prefill rank posted beside the
        bytes decode needs, logits and tokens compared, decode's tokens."""
        n = int(ids.shape[1])
        for cache, *_, logits in prefill_chunks(self.model, ids, cuts):
            pass
        want, want_tokens = greedy_decode(self.model, cache, logits[0].argmax(), steps)
        room, self.next_room = self.next_room, self.next_room + 1
        self.src.allocate(n, needed=False, base=1)
        self.dst.allocate(n, needed=True, order="reversed", base=2)
        num_pages = -(-n // self.page_size)
        window = self.dst.units["swa"]
        page_ids = np.zeros(num_pages, np.int64)  # pages before the window: never written (page 0 is spare)
        page_ids[self.dst.first["swa"]:] = window
        with self.decode.receiver(room, self.instance) as rx, self.prefill.sender(room) as tx:
            rx.init(page_ids, room % 4, n, kind_units=self._kind_units(self.dst))
            tx.init(n, kind_units=self._kind_units(self.src))
            sent = 0
            for cache, _, end, last, logits in prefill_chunks(self.model, ids, cuts):
                self.src.write_cache(cache, end, last)
                upto = num_pages if last else -(-end // self.page_size)
                logical = np.arange(sent, upto)
                aux = None
                if last:
                    aux = dict(first_token=int(logits[0].argmax()), num_cached_tokens=n, hidden_is_cp_local=True,
                               hidden=np.zeros(self.aux.region("hidden").count, np.float32),
                               topk_ids=np.zeros(0, np.int32), topk_probs=np.zeros(0, np.float32))
                tx.send(logical, self.src.units["swa"][logical], num_tokens_ready=end, is_last=last, aux=aux)
                sent = upto
            deadline = time.monotonic() + timeout
            final = (kvb.KVPoll.Success, kvb.KVPoll.Failed)
            while (rx.poll() not in final or tx.poll() not in final) and time.monotonic() < deadline:
                time.sleep(0.005)
            if rx.poll() != kvb.KVPoll.Success:
                raise kvb.KVBridgeError(f"room {room} did not succeed: {rx.failure_reason or rx.poll().name}",
                                        room=room)
            first = torch.tensor(int(rx.aux.first_token))
            moved = int(tx.stats["bytes"]) - self.aux.row_bytes
        got, got_tokens = greedy_decode(self.model, self.dst.read_cache(self.model.config, n), first, steps)
        return {"tokens": n, "bytes_moved": moved,
                "bytes_needed": sum(kvb.needed_bytes(s, n) for s in self.specs.values()),
                "logits_equal": bool(torch.equal(got, want)), "tokens_equal": got_tokens == want_tokens,
                "generated": got_tokens}

    def close(self) -> None:
        self.decode.close(timeout=2)
        self.prefill.close(timeout=2)
        for c in self.clients:
            c.close()

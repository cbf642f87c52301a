"""DeepSeek-V4 in model mode through the rooms: prefill endpoints (one per CP rank) and a decode
endpoint (one process, a bootstrap daemon, transfer engines) move a tiny ``DeepseekV4ForCausalLM``'s
window, compressed and state pools room by room, and decode rebuilds its cache from what arrived.

    decode    receiver(room).init(page ids of the token pages, aux slot, n,
                                  kind_units={entry pages, state slots})   (V4Pools.allocate(needed=True))
    prefill   sender(room).init(n, kind_units={entry pages, state slots})
              per chunk [done, end): write_cache(cache after end) -> send(token pages, their local pages,
                                     num_tokens_ready=end, is_last, aux=first token with the last)
    decode    Success -> read_cache -> greedy steps, from the aux row's first token

The window pool rides on the room's page mapping (only the window's pages travel), the
compressed pools on their entry pages, the compressor state once, with the last chunk.
Prefill CP 2 (``cp_size``, CP attention simulated: ``kind_rooms.py``) follows the rule of
docs/concepts.md: V4's compressed pools need ``lane_rule="replicated"`` (an entry needs its
window's tokens on one rank), so rank 0 sends every page, entry and slot and the other ranks
take part in the room and send nothing; interleaved lanes are refused at construction by name
(``cp_size``). Only kvbridge's public API is used.
"""

from __future__ import annotations

from typing import Any

from kvbridge.integrations.transformers.kind_rooms import KindRooms
from kvbridge.integrations.transformers.v4 import V4Pools, v4_specs

__all__ = ["V4Rooms"]


class V4Rooms(KindRooms):
    """Prefill endpoints (``cp_size``) and a decode endpoint of ``model``'s V4 pools (``capacity``
    units each), for one request at a time (``run``); ``close()`` them. ``engine``: "mooncake" or
    "local"."""

    def __init__(self, model: Any, bootstrap_url: str, *, token: str | None = None, engine: str = "mooncake",
                 page_size: int = 4, capacity: int = 128, instance: str = "tiny-deepseek-v4", cp_size: int = 1,
                 lane_rule: str | None = None) -> None:
        lane_rule = lane_rule or ("replicated" if cp_size > 1 else "interleaved")
        super().__init__(model, v4_specs(model.config, page_size=page_size), V4Pools, bootstrap_url, token=token,
                         engine=engine, cp_size=cp_size, lane_rule=lane_rule, capacity=capacity, instance=instance)

"""The connector's counters in vLLM's connector stats (``get_kv_connector_stats``): what fell
back, failed or was refused, by reason, since the last interval. vLLM aggregates the worker
sides' and the scheduler side's and its stats logger reduces them (``KV Transfer metrics``).

    room_refused            prefill: a router's room id bad, unsigned or expired under room_key
    room_in_use             prefill: the room id already open on this engine
    fallback_<reason>       prefill: answered with fallback params, no room (room_refused,
                            room_in_use, open_failed, send_failed): decode computes the prompt
    refused_after_answer    prefill: a worker's refusal that came after the params left
    decode_params_refused   decode: params of another prompt (token count, binding), forged or
                            expired: the request fails, nothing loaded
    local_compute_prompt_logprobs   decode: vLLM computes the prompt here (the room is released)
    local_compute_window    decode, hybrid groups: vLLM holds no sliding-window block for token n - W,
                            which the recomputed last prompt token attends: decode computes the prompt
                            (the room is released; hybrid.py)
    local_compute_hybrid_prefix     decode, hybrid groups: a local prefix hit (window rooms start at
                            page 0): decode computes the prompt (the room is released)
    rooms_released, release_failed  decode: releases sent (or not); prefill: rooms a release ended
    rooms_sent, rooms_received      rooms that reached Success
    send_failed, load_failed        rooms that failed (the reason is in the log)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class KVBridgeStats(KVConnectorStats):
    def count(self, reason: str, n: int = 1) -> None:
        self.data[reason] = self.data.get(reason, 0) + n

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVBridgeStats:
        for reason, n in (other.data or {}).items():
            self.count(reason, int(n))
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> KVBridgeStats | None:
        """What was counted since the last take (None: nothing), and start again."""
        if self.is_empty():
            return None
        out, self.data = KVBridgeStats(data=dict(self.data)), {}
        return out


def build_stats(data: dict[str, Any] | None) -> KVBridgeStats:
    return KVBridgeStats(data={k: int(v) for k, v in (data or {}).items()})

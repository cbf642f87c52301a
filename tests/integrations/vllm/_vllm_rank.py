"""One vLLM worker rank in a process of its own: vLLM's real KV cache tensors (vLLM's
``allocate_kv_cache`` in the chosen layout, on the CPU), the worker side of
``KVBridgeConnector`` built by vLLM's constructor, and a pipe to the test, which plays
vLLM's model runner: per step it hands the scheduler's metadata, the tokens the step's
forward pass "computes" (written here as known bytes), and the finished request ids.

Every byte is a function of (layer, global KV head, token position, byte of the cell,
seed), in [1, 200]; decode's blocks start as SENTINEL (0xEE), which that function never
yields, so a check tells written from untouched.
"""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np

SENTINEL = 0xEE


def expected(layer: int, heads: np.ndarray, positions: np.ndarray, cell: int, seed: int) -> np.ndarray:
    """uint8 [len(positions), len(heads), cell] of the KV a prefill computes."""
    p = positions.astype(np.int64)[:, None, None]
    h = heads.astype(np.int64)[None, :, None]
    c = np.arange(cell, dtype=np.int64)[None, None, :]
    return ((p * 7 + layer * 13 + h * 29 + c * 3 + seed) % 200 + 1).astype(np.uint8)


def state_bytes(layer: int, nbytes: int, seed: int, num_tokens: int) -> np.ndarray:
    """uint8 [nbytes]: a Mamba layer's conv then SSM state after ``num_tokens`` tokens."""
    c = np.arange(nbytes, dtype=np.int64)
    return ((c * 5 + layer * 11 + seed * 3 + num_tokens * 7) % 200 + 1).astype(np.uint8)


class Rank:
    def __init__(self, cfg: dict[str, Any]) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        import _vllm_config as C
        from kvbridge.integrations.vllm import KVBridgeConnector, KVBridgeHMAConnector

        self.cfg = cfg
        vc = C.vllm_config(cfg["model"], cfg["role"], cfg["extra"], block_size=cfg["block_size"], tp=cfg["tp"],
                           layout=cfg["layout"], dtype=cfg.get("dtype", "bfloat16"), window=cfg.get("window", 0),
                           mamba=cfg.get("mamba", False))
        self.kvcc = C.kv_cache_config(vc, cfg["num_blocks"])
        self.caches = allocate_kv_cache(self.kvcc, torch.device("cpu"), KVCacheLayout[cfg["layout"]])
        self.u8 = {name: t.view(torch.uint8) for name, t in self.caches.items()}  # [B, H, N, cell bytes]
        for t in self.u8.values():
            t.fill_(SENTINEL if cfg["role"] == "kv_consumer" else 0)
        self.block_size = cfg["block_size"]
        self.is_mla = vc.model_config.use_mla
        cls = KVBridgeHMAConnector if cfg.get("window") or cfg.get("mamba") else KVBridgeConnector
        self.connector = cls(vc, KVConnectorRole.WORKER, self.kvcc)
        self.group_of = {name: g for g, group in enumerate(self.kvcc.kv_cache_groups) for name in group.layer_names}
        from vllm.v1.kv_cache_interface import MambaSpec

        self.mamba = {name for name, g in self.group_of.items()  # Mamba layers: raw [B, 1, 1, C] state pages
                      if isinstance(self.kvcc.kv_cache_groups[g].kv_cache_spec, MambaSpec)}
        any_cache = next(t for name, t in self.u8.items() if name not in self.mamba)
        self.local_heads = int(any_cache.shape[1])
        self.h0 = 0 if self.is_mla else cfg["tp_rank"] * self.local_heads  # vLLM's split of the KV heads
        self.connector.register_kv_caches(self.caches)

    def _layers(self) -> list[tuple[int, Any]]:
        from kvbridge.integrations.vllm.cache import layer_id

        return [(layer_id(name), t) for name, t in self.u8.items()]

    def write(self, block_ids: list[int], start: int, stop: int, seed: int, only: int | None = None) -> None:
        """The forward pass of tokens [start, stop) of a request with block table ``block_ids``
        (``only``: of that layer alone)."""
        import torch

        from kvbridge.integrations.vllm.cache import layer_id

        pos = np.arange(start, stop)
        offs = torch.as_tensor(pos % self.block_size)
        heads = np.arange(self.h0, self.h0 + self.local_heads)
        for name, t in self.u8.items():
            layer = layer_id(name)
            if name in self.mamba and (only is None or layer == only):  # the state after token stop - 1
                (slot,) = [b for b in block_ids[self.group_of[name]] if b != 0]  # (0: vLLM's null block)
                t[slot, 0, 0, :] = torch.from_numpy(state_bytes(layer, t.shape[3], seed, stop))
            elif only is None or layer == only:
                table = block_ids[self.group_of[name]] if isinstance(block_ids, tuple) else block_ids  # hybrid: per group
                blocks = torch.as_tensor(np.asarray(table, dtype=np.int64)[pos // self.block_size])
                t[blocks, :, offs, :] = torch.from_numpy(expected(layer, heads, pos, t.shape[3], seed))

    def step(self, meta: Any, finished: set[str], writes: list[tuple]) -> dict[str, Any]:
        """One engine step as vLLM's model runner drives the connector: the forward pass layer by
        layer, ``save_kv_layer`` after each layer is written (on every step, decode steps too),
        then ``wait_for_save``."""
        c = self.connector
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)
        from kvbridge.integrations.vllm.cache import layer_id

        for layer, name in sorted((layer_id(n), n) for n in self.caches):
            for w in writes:
                self.write(*w, only=layer)
            c.save_kv_layer(name, self.caches[name], None)
        c.wait_for_save()
        res = c.get_transfer_results(set(finished))
        errors = c.get_block_ids_with_load_errors()
        worker_meta = c.build_connector_worker_meta()
        stats = c.get_kv_connector_stats()
        c.clear_connector_metadata()
        return {"sending": res.finished_sending, "recving": res.finished_recving, "failed": res.failed_recving,
                "invalid": errors, "worker_meta": worker_meta, "stats": None if stats is None else stats.data}

    def check(self, block_ids: list[int], first_page: int, num_tokens: int, seed: int, whole_blocks: bool) -> dict:
        """Decode: the request's pages [first_page, ..) hold prefill's bytes for tokens
        [first_page * bs, num_tokens); its prefix pages, the tail rows of its last page (unless
        whole blocks move) and every other block are untouched."""
        bs = self.block_size
        pos = np.arange(first_page * bs, num_tokens)
        mine = np.asarray(block_ids, dtype=np.int64)
        heads = np.arange(self.h0, self.h0 + self.local_heads)
        wrong = stray = 0
        for layer, t in self._layers():
            arr = t.numpy()
            got = arr[mine[pos // bs], :, pos % bs, :]
            wrong += int(np.count_nonzero(got != expected(layer, heads, pos, arr.shape[3], seed)))
            touched = np.ones(arr.shape[:3], dtype=bool)  # [B, H, N]: False where a write belongs
            last = -(-num_tokens // bs)
            for page in range(first_page, last):
                rows = slice(0, bs) if whole_blocks or page < last - 1 else slice(0, num_tokens - page * bs)
                touched[mine[page], :, rows] = False
            stray += int(np.count_nonzero(arr[touched] != SENTINEL))
        return {"wrong": wrong, "stray": stray}

    def check_groups(self, group_ids: tuple[list[int], ...], num_tokens: int, window: int, seed: int) -> dict:
        """Decode, hybrid: full-attention layers hold prefill's bytes for tokens [0, n) in the
        request's blocks of their group, window layers for tokens [n - W, n) in theirs, and every
        other byte of every tensor (other rows of those blocks, other blocks, vLLM's null block) is
        untouched. vLLM backs a layer of each group with one tensor, so untouched is decided per
        tensor, over the writes of every layer sharing it."""
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        from kvbridge.integrations.vllm.cache import layer_id

        bs, wrong, touched = self.block_size, 0, {}
        heads = np.arange(self.h0, self.h0 + self.local_heads)
        for name, t in self.u8.items():
            g = self.group_of[name]
            is_window = isinstance(self.kvcc.kv_cache_groups[g].kv_cache_spec, SlidingWindowSpec)
            pos = np.arange(max(0, num_tokens - window) if is_window else 0, num_tokens)
            table = np.asarray(group_ids[g], dtype=np.int64)
            arr = t.numpy()
            got = arr[table[pos // bs], :, pos % bs, :]
            wrong += int(np.count_nonzero(got != expected(layer_id(name), heads, pos, arr.shape[3], seed)))
            key = t.data_ptr()
            mask = touched.setdefault(key, (arr, np.ones(arr.shape[:3], dtype=bool)))[1]
            mask[table[pos // bs], :, pos % bs] = False
        stray = sum(int(np.count_nonzero(arr[mask] != SENTINEL)) for arr, mask in touched.values())
        return {"wrong": wrong, "stray": stray, "tensors": len(touched)}

    def check_mamba(self, group_ids: tuple[list[int], ...], num_tokens: int, seed: int) -> dict:
        """Decode, Mamba hybrid: full-attention layers hold prefill's rows of tokens [0, n) in the
        request's blocks, Mamba layers the state after n tokens in the request's slot; then those
        bytes are overwritten with SENTINEL and every byte of the one allocation must be SENTINEL
        (nothing else written: other rows and blocks, other slots, the Mamba pages' padding).
        Destructive: the last check of a test."""
        import ctypes

        import torch

        bs, wrong = self.block_size, 0
        heads = np.arange(self.h0, self.h0 + self.local_heads)
        pos = np.arange(num_tokens)
        for name, t in self.u8.items():
            layer, table = layer_id_of(name), np.asarray(group_ids[self.group_of[name]], dtype=np.int64)
            if name in self.mamba:
                (slot,) = [b for b in table if b != 0]
                got = t[int(slot), 0, 0, :].numpy()
                wrong += int(np.count_nonzero(got != state_bytes(layer, t.shape[3], seed, num_tokens)))
                t[int(slot), 0, 0, :] = SENTINEL
                continue
            arr = t.numpy()
            got = arr[table[pos // bs], :, pos % bs, :]
            wrong += int(np.count_nonzero(got != expected(layer, heads, pos, arr.shape[3], seed)))
            t[torch.as_tensor(table[pos // bs]), :, torch.as_tensor(pos % bs), :] = SENTINEL
        storage = next(iter(self.u8.values())).untyped_storage()
        backing = np.ctypeslib.as_array((ctypes.c_uint8 * storage.nbytes()).from_address(storage.data_ptr()))
        return {"wrong": wrong, "stray": int(np.count_nonzero(backing != SENTINEL)), "mamba_layers": len(self.mamba)}

    def hooks_only(self, meta: Any) -> dict:
        """``save_kv_layer`` for every layer and ``wait_for_save`` under ``meta`` (a decode step's,
        say), nothing written: what the endpoint posted and the rooms it opened meanwhile."""
        side = self.connector.worker_side
        before = dict(side.endpoint.counters), len(side._senders)
        self.connector.bind_connector_metadata(meta)
        for name, t in self.caches.items():
            self.connector.save_kv_layer(name, t, None)
        self.connector.clear_connector_metadata()
        return {"before": before, "after": (dict(side.endpoint.counters), len(side._senders))}

    def hold_room(self, room: int) -> None:
        """Open room ``room`` on this rank's endpoint and keep it (what the worker side meets as
        RoomInUse when vLLM's scheduler hands it a request of that room)."""
        self.held = getattr(self, "held", [])
        self.held.append(self.connector.worker_side.endpoint.sender(room))

    def failures(self) -> dict:
        """Prefill: request id -> the failure reason of each of its rooms still held (for messages)."""
        side = self.connector.worker_side
        return {rid: str(s.failure_reason) for rid, s in side._senders.items() if s.failure_reason}

    def counters(self) -> dict:
        return dict(self.connector.worker_side.endpoint.counters)

    def stats(self, req_id: str) -> dict:
        return self.connector.worker_side.room_stats.get(req_id, {})

    def digest(self) -> str:
        """A hash of every byte of every layer: two equal digests mean nothing was written between."""
        import hashlib

        h = hashlib.sha256()
        for name in sorted(self.u8):
            h.update(self.u8[name].contiguous().numpy().tobytes())
        return h.hexdigest()

    def reset(self) -> None:
        for t in self.u8.values():
            t.fill_(SENTINEL if self.cfg["role"] == "kv_consumer" else 0)


def layer_id_of(name: str) -> int:
    from kvbridge.integrations.vllm.cache import layer_id

    return layer_id(name)


def main(conn: Any, cfg: dict[str, Any]) -> None:
    import sys

    sys.path[:0] = cfg["paths"]
    try:
        rank = Rank(cfg)
    except Exception as exc:  # the start-up refusal is what some tests look at
        conn.send(("error", type(exc).__name__, str(exc), getattr(exc, "field", None)))
        return
    side = rank.connector.worker_side
    conn.send(("ready", {"local_heads": rank.local_heads, "layout": side.cache.layout if side.cache else None,
                         "endpoint": side.endpoint is not None}))
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "stop":
                rank.connector.shutdown()
                conn.send(("ok", None))
                return
            conn.send(("ok", getattr(rank, cmd)(*args)))
        except Exception:
            conn.send(("raise", traceback.format_exc()))

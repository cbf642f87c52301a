"""``kvbridge bench --preset deepseek-v4``: what a DeepSeek-V4 room moves against what decode
needs, beside DeepSeek-V3.2 at the same token counts, and GB/s of both through the rooms.

Bytes, at full size (V4: 43 layers + 1 draft, V3.2: 61 + 1, bf16, pages of 64; and fp8: V4 in
SGLang's FlashMLA fp8 layout, padded pages, beside V3.2-fp8): for each
length the plans of every pool are built (``plan_kind`` for V4's window, compressed and state
pools; ``plan_transfer`` for V3.2's paged pools) over descriptor-only buffers (planning touches
no memory), and their bytes are set beside ``needed_bytes`` (what decode needs: window +
complete compressed entries + state) and V3.2's. ``layout_row`` gives the same figures from
the layout alone (``needed_bytes``), for lengths too long to plan (1M tokens).

GB/s through the rooms (``room_rows``; ``--layers`` layers of each model, host memory, lengths
up to ``--max-move-tokens``): a prefill and a decode endpoint in one process, two engines, a
bootstrap daemon; per length ``reps`` rooms of each model, one chunk, prefill pages ascending,
decode pages and entry pages shuffled, the two models' rooms alternating (same load for both);
the bytes each room posted (less the aux row) are
checked against ``needed_bytes`` and timed from the first write posted to the prefill room's
success (``KVSender.stats``), median. ``speed_rows``: the same plans written between two
engines without the rooms (the data path alone).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvbridge.layout import BufferDesc, deepseek_v4_pools, needed_bytes, needed_extent, plan_kind, plan_transfer
from kvbridge.layout.plan import TransferPlan
from kvbridge.layout.pools import PoolSpec, preset_pools

__all__ = ["byte_rows", "format_bytes", "format_rooms", "format_speed", "layout_row", "room_rows", "speed_rows"]

V32_PRESET = "deepseek-v3.2"


def _v4(layers: int, draft: int, kv_dtype: str = "bfloat16") -> dict[str, PoolSpec]:
    return deepseek_v4_pools(layers, 64, draft_layers=draft, kv_dtype=kv_dtype)


def _v32(layers: int, draft: int) -> dict[str, PoolSpec]:
    return preset_pools(V32_PRESET, num_layers=layers, page_size=64, draft_layers=draft)


def _descs(specs: Mapping[str, PoolSpec], capacity: int, base: int, bases: dict | None = None) -> list[BufferDesc]:
    out, at = [], base
    for name, spec in specs.items():
        for lid in spec.layer_ids:
            addr = bases[(name, lid)] if bases is not None else at
            out.append(BufferDesc(name, lid, addr, capacity, spec.bytes_per_page))
            at += capacity * spec.bytes_per_page
    return out


def _units(spec: PoolSpec, n: int, *, decode: bool, rng: np.random.Generator | None) -> np.ndarray:
    ext = needed_extent(spec, n)
    if spec.kind == "state" or not decode:
        ids = np.arange(ext.first, ext.stop) if spec.kind != "state" else np.zeros(ext.count, np.int64)
    else:
        ids = np.arange(ext.count)
    return rng.permutation(ids) if rng is not None and spec.kind != "state" else ids


def v4_plan(specs: Mapping[str, PoolSpec], n: int, src: Sequence[BufferDesc], dst: Sequence[BufferDesc],
            rng: np.random.Generator | None = None) -> TransferPlan:
    """Every V4 pool's writes of a room of ``n`` tokens (one prefill rank, the whole request)."""
    plans = [plan_kind(spec, src, dst, needed_extent(spec, n), _units(spec, n, decode=False, rng=None),
                       _units(spec, n, decode=True, rng=rng)) for spec in specs.values()]
    return TransferPlan.concat(plans)


def v32_plan(specs: Mapping[str, PoolSpec], n: int, src: Sequence[BufferDesc], dst: Sequence[BufferDesc],
             rng: np.random.Generator | None = None) -> TransferPlan:
    pages = -(-n // 64)
    logical = np.arange(pages)
    dst_pages = rng.permutation(pages) if rng is not None else logical
    return plan_transfer(specs, src, dst, logical, logical, dst_pages, n)


def byte_rows(tokens: Sequence[int]) -> list[dict[str, Any]]:
    """Per length: V4 bytes planned and needed (by kind), V3.2 bytes planned, the ratio; and the
    same in fp8 (V4 in SGLang's FlashMLA fp8 layout, padded pages, against V3.2-fp8)."""
    v4, v32 = _v4(43, 1), _v32(61, 1)
    v4f, v32f = _v4(43, 1, "fp8"), preset_pools(V32_PRESET + "-fp8", num_layers=61, page_size=64, draft_layers=1)
    rows = []
    for n in tokens:
        cap4 = max(-(-n // 64), 1)
        plan4 = v4_plan(v4, n, _descs(v4, cap4, 1 << 40), _descs(v4, cap4, 1 << 50))
        plan4f = v4_plan(v4f, n, _descs(v4f, cap4, 1 << 40), _descs(v4f, cap4, 1 << 50))
        plan32 = v32_plan(v32, n, _descs(v32, cap4, 1 << 40), _descs(v32, cap4, 1 << 50))
        need32f = sum(needed_bytes(s, n) for s in v32f.values())
        by_kind: dict[str, int] = {}
        for spec in v4.values():
            by_kind[spec.kind] = by_kind.get(spec.kind, 0) + needed_bytes(spec, n)
        need4 = sum(by_kind.values())
        rows.append({"tokens": n, "v4_moved": plan4.num_bytes, "v4_needed": need4, "v4_window": by_kind["window"],
                     "v4_compressed": by_kind["compressed"], "v4_state": by_kind["state"],
                     "v32_moved": plan32.num_bytes, "v32_needed": sum(needed_bytes(s, n) for s in v32.values()),
                     "ratio": plan4.num_bytes / plan32.num_bytes, "v4_slices": plan4.num_slices,
                     "v32_slices": plan32.num_slices, "v4_fp8_moved": plan4f.num_bytes,
                     "v4_fp8_needed": sum(needed_bytes(s, n) for s in v4f.values()), "v32_fp8_needed": need32f,
                     "ratio_fp8": plan4f.num_bytes / need32f})
    return rows


def layout_row(n: int) -> dict[str, Any]:
    """The bytes decode needs at ``n`` tokens from the layout alone (no plans): V4, V3.2, ratio."""
    v4, v32 = _v4(43, 1), _v32(61, 1)
    v4f, v32f = _v4(43, 1, "fp8"), preset_pools(V32_PRESET + "-fp8", num_layers=61, page_size=64, draft_layers=1)
    need4 = sum(needed_bytes(s, n) for s in v4.values())
    need32 = sum(needed_bytes(s, n) for s in v32.values())
    need4f = sum(needed_bytes(s, n) for s in v4f.values())
    need32f = sum(needed_bytes(s, n) for s in v32f.values())
    return {"tokens": n, "v4_needed": need4, "v32_needed": need32, "ratio": need4 / need32,
            "v4_fp8_needed": need4f, "v32_fp8_needed": need32f, "ratio_fp8": need4f / need32f}


def _room_specs(model: str, layers: int) -> dict[str, PoolSpec]:
    if model == "deepseek-v4":
        return _v4(layers, 1)
    return preset_pools(model, num_layers=layers, page_size=64, draft_layers=1)


class _RoomRig:
    """A prefill and a decode endpoint of one model's pools (``specs``) sized for ``n`` tokens,
    one room at a time (``room``); ``close()`` it."""

    def __init__(self, model: str, specs: Mapping[str, PoolSpec], n: int, engine: str, url: str,
                 token: str | None, device: str = "cpu", protocol: str = "tcp") -> None:
        import torch

        import kvbridge as kvb

        self.kvb, self.model, self.specs, self.n = kvb, model, dict(specs), n
        self.aux = aux = kvb.AuxSchema.standard(16, "float32", 0)
        self.cap = {name: 2 if s.kind == "state" else
                    -(-((n // s.ratio) if s.kind == "compressed" else n) // s.page_size) + 1
                    for name, s in self.specs.items()}

        def bufs() -> dict:
            return {(name, lid): torch.zeros(self.cap[name] * s.bytes_per_page, dtype=torch.uint8, device=device)
                    .view(getattr(torch, s.abi)) for name, s in self.specs.items() for lid in s.layer_ids}

        self.instance = instance = f"bench-{model}-{n}"
        contract = kvb.contract_for(self.specs, model=instance, aux=aux)
        engines = [kvb.create_engine(engine) if engine == "local" else kvb.create_engine(engine, protocol=protocol)]
        engines.append(kvb.create_engine(engine, fabric=engines[0].fabric) if engine == "local"
                       else kvb.create_engine(engine, protocol=protocol))
        self.clients = [kvb.BootstrapClient(url, token=token) for _ in "pd"]
        self.p = kvb.PrefillEndpoint(kvb.PrefillConfig(instance=f"{instance}-p", staging="never",
                                                       aux_device=device if protocol != "tcp" else "cpu"), engines[0],
                                     self.specs, bufs(), contract, self.clients[0], aux)
        self.d = kvb.DecodeEndpoint(kvb.DecodeConfig(instance=f"{instance}-d", staging="never",
                                                     transfer_timeout=300.0),
                                    engines[1], self.specs, bufs(), contract, self.clients[1],
                                    torch.zeros((2, aux.row_bytes), dtype=torch.uint8,
                                                device=device if protocol != "tcp" else "cpu"), aux)
        self.p.start()
        self.d.start()
        self.rng = np.random.default_rng(n)
        self.needed = sum(needed_bytes(s, n) for s in self.specs.values())
        self.own = {name: s for name, s in self.specs.items() if s.kind in ("compressed", "state")}
        self.next_room = 1

    def room(self) -> dict[str, Any]:
        """One room of the whole request in one chunk: decode's pages and entry pages shuffled."""
        kvb, n, rng = self.kvb, self.n, self.rng
        room, self.next_room = self.next_room, self.next_room + 1
        num_pages = -(-n // 64)
        dunits = {name: np.array([1]) if s.kind == "state" else rng.permutation(needed_extent(s, n).count)
                  for name, s in self.own.items()}
        punits = {name: np.array([0]) if s.kind == "state" else np.arange(self.cap[name])
                  for name, s in self.own.items()}
        with self.d.receiver(room, f"{self.instance}-p") as rx, self.p.sender(room) as tx:
            rx.init(rng.permutation(num_pages), 0, n, kind_units=dunits or None)
            tx.init(n, kind_units=punits or None)
            row = dict(first_token=1, num_cached_tokens=n, hidden_is_cp_local=True, hidden=np.zeros(16, np.float32),
                       topk_ids=np.zeros(0, np.int32), topk_probs=np.zeros(0, np.float32))
            tx.send(np.arange(num_pages), np.arange(num_pages), num_tokens_ready=n, is_last=True, aux=row)
            deadline = time.monotonic() + 300
            while (rx.poll() != kvb.KVPoll.Success or tx.poll() != kvb.KVPoll.Success) \
                    and time.monotonic() < deadline:
                if kvb.KVPoll.Failed in (rx.poll(), tx.poll()):
                    raise kvb.KVBridgeError(f"{self.model} room of {n} tokens failed: "
                                            f"{rx.failure_reason or tx.failure_reason}", field="room")
                time.sleep(0.0005)
            if rx.poll() != kvb.KVPoll.Success:
                raise kvb.KVBridgeError(f"{self.model} room of {n} tokens timed out", field="room")
            st = tx.stats
            return {"bytes": int(st["bytes"]) - self.aux.row_bytes, "slices": int(st["slices"]),
                    "s": float(st["transfer_s"]), "needed": self.needed}

    def close(self) -> None:
        self.d.close(timeout=2)
        self.p.close(timeout=2)
        for c in self.clients:
            c.close()


def room_rows(engine: str, tokens: Sequence[int], layers: int, reps: int, url: str, token: str | None = None,
              v32: str = "deepseek-v3.2-fp8", reps_over: tuple[int, int] = (65536, 2), device: str = "cpu",
              protocol: str = "tcp") -> list[dict[str, Any]]:
    """GB/s of V4 rooms and V3.2 rooms (``v32``, the preset) of ``layers`` layers each through
    the room endpoints (``engine``), per length: bytes posted per room (less the aux row) and
    needed, slices, median time, GB/s, and V4's GB/s over V3.2's (``per_byte``). Both models'
    endpoints are up together and their rooms alternate (a V4 room, a V3.2 room, ...) so that
    both see the same load; one warm-up room each is not timed. Lengths of ``reps_over[0]``
    tokens or more run ``reps_over[1]`` timed rooms (at most ``reps``). ``device``: where the pools
    are (cpu, or cuda:N with Mooncake's ``protocol`` "rdma" and MC_INTRANODE_NVLINK for NVLink)."""
    rows = []
    models = ("deepseek-v4", v32)
    for n in tokens:
        k = min(reps, reps_over[1]) if n >= reps_over[0] else reps
        rigs: list[_RoomRig] = []
        try:
            for model in models:
                rigs.append(_RoomRig(model, _room_specs(model, layers), n, engine, url, token, device, protocol))
            for rig in rigs:
                rig.room()  # warm-up: connections, page faults
            got: list[list[dict[str, Any]]] = [[], []]
            for _ in range(k):
                for i, rig in enumerate(rigs):
                    got[i].append(rig.room())
        finally:
            for rig in rigs:
                rig.close()
        pair = {}
        for model, mine in zip(models, got):
            med = float(np.median([r["s"] for r in mine]))
            pair[model] = {"model": model, "device": device, "protocol": protocol, "tokens": n, "layers": layers,
                           "reps": k, "bytes": mine[0]["bytes"],
                           "needed": mine[0]["needed"], "bytes_equal": all(r["bytes"] == r["needed"] for r in mine),
                           "slices": mine[0]["slices"], "p50_ms": round(med * 1e3, 3),
                           "gbps": round(mine[0]["bytes"] / med / 1e9, 4)}
        pair["deepseek-v4"]["per_byte"] = round(pair["deepseek-v4"]["gbps"] / pair[v32]["gbps"], 3)
        rows += list(pair.values())
    return rows


def format_rooms(rows: Sequence[dict[str, Any]], engine: str) -> str:
    where = "host memory" if not rows or rows[0].get("device", "cpu") == "cpu" else \
        f"pools on {rows[0]['device']}, protocol {rows[0]['protocol']}"
    lines = [f"GB/s through the rooms (a prefill and a decode endpoint, one process, {engine} engines, {where}; "
             "decode pages shuffled; median):",
             f"{'model':>18} {'tokens':>7} {'layers':>6} {'reps':>4} {'moved MB':>9} {'needed MB':>10} {'=':>2} "
             f"{'slices':>7} {'p50 ms':>9} {'GB/s':>7} {'V4/V3.2 per byte':>17}"]
    for r in rows:
        same = "=" if r["bytes_equal"] else "!"
        per = f"{r['per_byte']:.2f}x" if "per_byte" in r else ""
        lines.append(f"{r['model']:>18} {r['tokens']:>7} {r['layers']:>6} {r['reps']:>4} {_mb(r['bytes']):>9} "
                     f"{_mb(r['needed']):>10} {same:>2} {r['slices']:>7} {r['p50_ms']:>9} {r['gbps']:>7} {per:>17}")
    goal = [r["per_byte"] for r in rows if "per_byte" in r and r["tokens"] >= 8192]
    if goal:
        lines.append(f"goal V4 rooms >= 0.9x V3.2 rooms per byte at >= 8K tokens: worst {min(goal):.2f}x -> "
                     f"{'met' if min(goal) >= 0.9 else 'NOT met'}")
    return "\n".join(lines)


def speed_rows(engine_kind: str, tokens: Sequence[int], layers: int, reps: int) -> list[dict[str, Any]]:
    """GB/s of V4 and V3.2 rooms' plans through two engines of one process (host memory)."""
    from kvbridge.transfer.engine import LocalFabric, create_engine

    rows = []
    for model, build, plan in (("deepseek-v4", _v4, v4_plan), (V32_PRESET, _v32, v32_plan)):
        specs = build(layers, 1)
        for n in tokens:
            cap = max(-(-n // 64), 1)
            fabric = LocalFabric() if engine_kind == "local" else None
            src_e = create_engine(engine_kind, fabric=fabric) if fabric else create_engine(engine_kind)
            dst_e = create_engine(engine_kind, fabric=fabric) if fabric else create_engine(engine_kind)
            try:
                mem = {}
                for side, eng in (("src", src_e), ("dst", dst_e)):
                    bases = {}
                    for name, spec in specs.items():
                        for lid in spec.layer_ids:
                            buf = np.ones(cap * spec.bytes_per_page, np.uint8)
                            eng.register(buf.ctypes.data, buf.nbytes)
                            mem[(side, name, lid)] = buf
                            bases[(name, lid)] = buf.ctypes.data
                    mem[side] = _descs(specs, cap, 0, bases)
                rng = np.random.default_rng(n)
                p = plan(specs, n, mem["src"], mem["dst"], rng)
                src_e.write(dst_e.session_id, p.src, p.dst, p.length)  # warm-up: connect, first call
                times = []
                for _ in range(reps):
                    t = time.perf_counter()
                    dst_e_session = dst_e.session_id
                    src_e.write(dst_e_session, p.src, p.dst, p.length)
                    times.append(time.perf_counter() - t)
                med = float(np.median(times))
                rows.append({"model": model, "tokens": n, "layers": layers, "bytes": p.num_bytes,
                             "slices": p.num_slices, "p50_ms": round(med * 1e3, 3),
                             "gbps": round(p.num_bytes / med / 1e9, 3)})
            finally:
                src_e.close()
                dst_e.close()
    return rows


def _mb(x: int) -> str:
    return f"{x / 1e6:,.1f}"


def format_bytes(rows: Sequence[dict[str, Any]]) -> str:
    head = (f"{'tokens':>7} {'V4 moved MB':>12} {'V4 needed MB':>13} {'=':>2} {'window':>9} {'compressed':>11} "
            f"{'state':>8} {'V3.2 MB':>10} {'V4/V3.2':>8}")
    lines = ["bytes per room, full size (V4 43+1 layers, V3.2 61+1, bf16, pages of 64), from the plans:", head]
    for r in rows:
        same = "=" if r["v4_moved"] == r["v4_needed"] else "!"
        lines.append(f"{r['tokens']:>7} {_mb(r['v4_moved']):>12} {_mb(r['v4_needed']):>13} {same:>2} "
                     f"{_mb(r['v4_window']):>9} {_mb(r['v4_compressed']):>11} {_mb(r['v4_state']):>8} "
                     f"{_mb(r['v32_moved']):>10} {r['ratio']:>8.3f}")
    lines += ["fp8 (V4 in SGLang's FlashMLA fp8 layout: 584 B rows, pages padded to whole 576-byte rows, the "
              "padding not moved; V3.2-fp8: 656 B MLA + 132 B index K a token), from the plans:",
              f"{'tokens':>7} {'V4 moved MB':>12} {'V4 needed MB':>13} {'=':>2} {'V3.2-fp8 MB':>12} {'V4/V3.2':>8}"]
    for r in rows:
        same = "=" if r["v4_fp8_moved"] == r["v4_fp8_needed"] else "!"
        lines.append(f"{r['tokens']:>7} {_mb(r['v4_fp8_moved']):>12} {_mb(r['v4_fp8_needed']):>13} {same:>2} "
                     f"{_mb(r['v32_fp8_needed']):>12} {r['ratio_fp8']:>8.3f}")
    return "\n".join(lines)


def format_speed(rows: Sequence[dict[str, Any]], engine: str) -> str:
    lines = [f"GB/s through one {engine} engine pair in one process (host memory; no room protocol):",
             f"{'model':>14} {'tokens':>7} {'layers':>6} {'MB':>9} {'slices':>7} {'p50 ms':>8} {'GB/s':>7}"]
    for r in rows:
        lines.append(f"{r['model']:>14} {r['tokens']:>7} {r['layers']:>6} {_mb(r['bytes']):>9} {r['slices']:>7} "
                     f"{r['p50_ms']:>8} {r['gbps']:>7}")
    return "\n".join(lines)

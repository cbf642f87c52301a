"""``kvbridge bench --preset deepseek-v4``: what a DeepSeek-V4 room moves against what decode
needs, beside DeepSeek-V3.2 at the same token counts, and GB/s of both through the rooms.

Bytes, at full size (V4: 43 layers + 1 draft, V3.2: 61 + 1, bf16, pages of 64; and fp8: V4 in
SGLang's FlashMLA fp8 layout, padded pages, beside V3.2-fp8): for each
length the plans of every pool are built (``plan_kind`` for V4's window, compressed and state
pools; ``plan_transfer`` for V3.2's paged pools) over descriptor-only buffers (planning touches
no memory), and their bytes are set beside ``needed_bytes`` (what decode needs: window +
complete compressed entries + state) and V3.2's. ``layout_row`` gives the same figures from
the layout alone (``needed_bytes``), for lengths too long to plan (1M tokens).

GB/s through the rooms (``room_rows``; ``--layers`` layers of each model, lengths up to
``--max-move-tokens``): a prefill and a decode endpoint in one process (host memory), or with
``--split`` decode's in a process of its own (``DecodeProcess``; on by default with ``--device
cuda:N``, pools and aux rows on that GPU), two engines, a bootstrap daemon; per length ``reps``
rooms of each model, one chunk, prefill pages ascending,
decode pages and entry pages shuffled, the two models' rooms alternating (same load for both);
the bytes each room posted (less the aux row) are
checked against ``needed_bytes`` and timed from the first write posted to the prefill room's
success (``KVSender.stats``), median; split, decode's own room time too (its ``receiver()`` to
Success, prefill's sends queued first). ``speed_rows``: the same plans written between two
engines without the rooms (the data path alone).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.layout import BufferDesc, deepseek_v4_pools, needed_bytes, needed_extent, plan_kind, plan_transfer
from kvbridge.layout.plan import TransferPlan
from kvbridge.layout.pools import PoolSpec, preset_pools

__all__ = ["DecodeProcess", "aux_device", "byte_rows", "format_bytes", "format_rooms", "format_speed", "layout_row",
           "room_rows", "speed_rows"]

V32_PRESET = "deepseek-v3.2"


def _v4(layers: int, draft: int, kv_dtype: str = "bfloat16") -> dict[str, PoolSpec]:
    return deepseek_v4_pools(layers, 64, draft_layers=draft, kv_dtype=kv_dtype)


def _v32(layers: int, draft: int, kv_dtype: str = "bfloat16") -> dict[str, PoolSpec]:
    preset = V32_PRESET + ("-fp8" if kv_dtype == "fp8" else "")
    return preset_pools(preset, num_layers=layers, page_size=64, draft_layers=draft)


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
    v4f, v32f = _v4(43, 1, "fp8"), _v32(61, 1, "fp8")
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
    v4f, v32f = _v4(43, 1, "fp8"), _v32(61, 1, "fp8")
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


ROOM_TIMEOUT_S = 300.0


def _capacity(specs: Mapping[str, PoolSpec], n: int) -> dict[str, int]:
    """Pages (entry pages for compressed pools, slots for state) one side holds for ``n`` tokens."""
    return {name: 2 if s.kind == "state" else -(-((n // s.ratio) if s.kind == "compressed" else n) // s.page_size) + 1
            for name, s in specs.items()}


def _bufs(specs: Mapping[str, PoolSpec], cap: Mapping[str, int], device: str) -> dict:
    import torch

    return {(name, lid): torch.zeros(cap[name] * s.bytes_per_page, dtype=torch.uint8, device=device)
            .view(getattr(torch, s.abi)) for name, s in specs.items() for lid in s.layer_ids}


def _engine(engine: str, protocol: str, fabric: Any = None) -> Any:
    import kvbridge as kvb
    from kvbridge.transfer.engine.registry import engine_entry

    if fabric is not None:
        return kvb.create_engine(engine, fabric=fabric)
    return kvb.create_engine(engine, protocol=protocol) if "protocol" in engine_entry(engine).options \
        else kvb.create_engine(engine)


def aux_device(engine: str, protocol: str, device: str) -> str:
    """Where both aux rows live: on the pools' GPU when the engine moves GPU memory between
    processes (ipc, auto, Mooncake over rdma/NVLink), else in host memory."""
    gpu = str(device).startswith("cuda") and (engine in ("ipc", "auto") or protocol != "tcp")
    return str(device) if gpu else "cpu"


def _aux_schema() -> Any:
    import kvbridge as kvb

    return kvb.AuxSchema.standard(16, "float32", 0)


class _DecodeSide:
    """Decode's endpoint of one model's pools (``specs``) sized for rooms of ``n`` tokens; in the
    bench's process or in decode's own (``_serve_decode``). ``close()`` it."""

    def __init__(self, instance: str, specs: Mapping[str, PoolSpec], n: int, engine: str, url: str,
                 token: str | None, device: str, protocol: str, fabric: Any = None) -> None:
        import torch

        import kvbridge as kvb

        self.kvb, self.instance, self.specs, self.n = kvb, instance, dict(specs), n
        self.aux = aux = _aux_schema()
        aux_dev = aux_device(engine, protocol, device)
        self.engine = _engine(engine, protocol, fabric)
        self.client = kvb.BootstrapClient(url, token=token)
        self.d = kvb.DecodeEndpoint(kvb.DecodeConfig(instance=f"{instance}-d", staging="never",
                                                     transfer_timeout=ROOM_TIMEOUT_S, aux_inline=True),
                                    self.engine, self.specs, _bufs(self.specs, _capacity(self.specs, n), device),
                                    kvb.contract_for(self.specs, model=instance, aux=aux), self.client,
                                    torch.zeros((2, aux.row_bytes), dtype=torch.uint8, device=aux_dev), aux)
        self.d.start()
        self.rng = np.random.default_rng(n)

    def receiver(self, room: int) -> Any:
        """Decode's receiver of ``room``: its pages and entry pages shuffled, initialised."""
        n, rng = self.n, self.rng
        dunits = {name: np.array([1]) if s.kind == "state" else rng.permutation(needed_extent(s, n).count)
                  for name, s in self.specs.items() if s.kind in ("compressed", "state")}
        rx = self.d.receiver(room, f"{self.instance}-p")
        rx.init(rng.permutation(-(-n // 64)), 0, n, kind_units=dunits or None)
        return rx

    def room(self, room: int) -> dict[str, Any]:
        """One room, received here with prefill's sends already queued: decode's own verdict and
        time (its ``receiver()`` to Success)."""
        t0 = time.perf_counter()
        with self.receiver(room) as rx:
            state = rx.wait(ROOM_TIMEOUT_S)
            return {"room": room, "state": state.name, "reason": rx.failure_reason or "",
                    "s": time.perf_counter() - t0, "pid": os.getpid()}

    def close(self) -> None:
        self.d.close(timeout=2)
        self.client.close()
        self.engine.close()


class DecodeProcess:
    """Decode's endpoints in a process of their own (``python -m kvbridge.bench.kinds decode``),
    one per bench run, an endpoint per model and length opened and closed on command; ``stop()`` it.
    On one H200 Mooncake's NVLink transport could not read its own process's GPU memory: GPU
    pools run in this layout (production's: prefill and decode in processes of their own)."""

    def __init__(self, engine: str, protocol: str, device: str, url: str, token: str | None, layers: int) -> None:
        from kvbridge.bench.rig import Child, child_env

        fd, log = tempfile.mkstemp(prefix="kvbridge-v4-decode-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log)
        cfg = {"engine": engine, "protocol": protocol, "device": device, "url": url, "token": token,
               "layers": layers}
        self.child = Child("decode", cfg, child_env(), self.log_path, module="kvbridge.bench.kinds")
        try:
            self.pid = int(self.child.reply(timeout=180)["pid"])
        except BaseException:
            self.child.stop()
            raise

    def ask(self, **cmd: Any) -> dict[str, Any]:
        return self.child.ask(timeout=ROOM_TIMEOUT_S + 30, **cmd)

    def stop(self) -> None:
        self.child.stop()
        self.log_path.unlink(missing_ok=True)


def _serve_decode(cfg: dict[str, Any]) -> None:
    """Decode's process: ``open`` (model, n, instance), ``room`` (instance, room), ``close``
    (instance), ``quit``; a JSON line answers each."""
    from kvbridge.bench.procs import emit

    device = str(cfg["device"])
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(device)
    sides: dict[str, _DecodeSide] = {}
    emit({"ready": True, "pid": os.getpid()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "quit":
                break
            try:
                if op in ("room", "close") and cmd.get("instance") not in sides:
                    raise KeyError(f"no decode endpoint open for {cmd.get('instance')!r} (open it first)")
                if op == "open":
                    sides[cmd["instance"]] = _DecodeSide(cmd["instance"], _room_specs(cmd["model"], cfg["layers"]),
                                                         int(cmd["n"]), cfg["engine"], cfg["url"], cfg["token"],
                                                         device, cfg["protocol"])
                    emit({"opened": cmd["instance"]})
                elif op == "room":
                    emit(sides[cmd["instance"]].room(int(cmd["room"])))
                elif op == "close":
                    sides.pop(cmd["instance"]).close()
                    emit({"closed": cmd["instance"]})
                else:
                    emit({"error": f"decode: unknown op {op!r}"})
            except Exception as exc:  # the bench raises it, naming the op
                emit({"error": f"decode {op}: {type(exc).__name__}: {exc}"})
    finally:
        for side in sides.values():
            side.close()


class _RoomRig:
    """A prefill and a decode endpoint of one model's pools (``specs``) sized for ``n`` tokens,
    one room at a time (``room``); decode's in this process, or in ``decode`` (a ``DecodeProcess``).
    ``close()`` it."""

    def __init__(self, model: str, specs: Mapping[str, PoolSpec], n: int, engine: str, url: str,
                 token: str | None, device: str = "cpu", protocol: str = "tcp",
                 decode: DecodeProcess | None = None) -> None:
        import kvbridge as kvb

        self.kvb, self.model, self.specs, self.n = kvb, model, dict(specs), n
        self.aux = aux = _aux_schema()
        self.cap = _capacity(self.specs, n)
        self.instance = instance = f"bench-{model}-{n}"
        self.engine = _engine(engine, protocol)
        self.client = kvb.BootstrapClient(url, token=token)
        self.p = kvb.PrefillEndpoint(kvb.PrefillConfig(instance=f"{instance}-p", staging="never",
                                                       aux_device=aux_device(engine, protocol, device)),
                                     self.engine, self.specs, _bufs(self.specs, self.cap, device),
                                     kvb.contract_for(self.specs, model=instance, aux=aux), self.client, aux)
        self.p.start()
        self.decode, self.local = decode, None
        try:
            if decode is None:
                self.local = _DecodeSide(instance, self.specs, n, engine, url, token, device, protocol,
                                         fabric=getattr(self.engine, "fabric", None) if engine == "local" else None)
            else:
                decode.ask(op="open", model=model, n=n, instance=instance)
        except BaseException:
            self._close_prefill()
            raise
        self.decode_pid = os.getpid() if decode is None else decode.pid
        self.broken = False  # a room failed: decode's process may still wait on it (stop() ends it)
        self.needed = sum(needed_bytes(s, n) for s in self.specs.values())
        self.next_room = 1

    def _fail(self, what: str) -> Exception:
        return self.kvb.KVBridgeError(f"{self.model} room of {self.n} tokens {what}", field="room")

    def room(self) -> dict[str, Any]:
        """One room of the whole request in one chunk: decode's pages and entry pages shuffled."""
        try:
            return self._room()
        except BaseException:
            self.broken = True
            raise

    def _room(self) -> dict[str, Any]:
        kvb, n = self.kvb, self.n
        room, self.next_room = self.next_room, self.next_room + 1
        num_pages = -(-n // 64)
        punits = {name: np.array([0]) if s.kind == "state" else np.arange(self.cap[name])
                  for name, s in self.specs.items() if s.kind in ("compressed", "state")}
        row = dict(first_token=1, num_cached_tokens=n, hidden_is_cp_local=True, hidden=np.zeros(16, np.float32),
                   topk_ids=np.zeros(0, np.int32), topk_probs=np.zeros(0, np.float32))
        got: dict[str, Any] = {}
        with (self.local.receiver(room) if self.local else contextlib.nullcontext()) as rx, \
                self.p.sender(room) as tx:
            tx.init(n, kind_units=punits or None)
            tx.send(np.arange(num_pages), np.arange(num_pages), num_tokens_ready=n, is_last=True, aux=row)
            if rx is None:  # prefill's sends are queued: decode's process makes its receiver now
                self.decode.child.send(op="room", instance=self.instance, room=room)
            deadline = time.monotonic() + ROOM_TIMEOUT_S
            while time.monotonic() < deadline:
                states = (tx.poll(), rx.poll() if rx is not None else kvb.KVPoll.Success)
                if kvb.KVPoll.Failed in states:
                    raise self._fail(f"failed: {tx.failure_reason or (rx.failure_reason if rx else '')}")
                if states == (kvb.KVPoll.Success, kvb.KVPoll.Success):
                    break
                if rx is None and not self.decode.child.lines.empty():
                    got = self.decode.child.reply()  # decode's verdict came first (a failure, or a slow prefill)
                    if got["state"] != "Success":
                        raise self._fail(f"failed on decode: {got['reason'] or got['state']}")
                time.sleep(0.0005)
            else:
                raise self._fail("timed out")
            if rx is None and not got:
                got = self.decode.child.reply(ROOM_TIMEOUT_S)
                if got["state"] != "Success":
                    raise self._fail(f"failed on decode: {got['reason'] or got['state']}")
            st = tx.stats
            # (decode takes the aux row in the report, aux_inline: no byte of it is posted)
            return {"bytes": int(st["bytes"]), "slices": int(st["slices"]),
                    "s": float(st["transfer_s"]), "needed": self.needed, "decode_s": got.get("s"),
                    "decode_pid": got.get("pid", self.decode_pid)}

    def _close_prefill(self) -> None:
        self.p.close(timeout=2)
        self.client.close()
        self.engine.close()

    def close(self) -> None:
        try:
            if self.local is not None:
                self.local.close()
            elif not self.broken:
                self.decode.ask(op="close", instance=self.instance)
        finally:
            self._close_prefill()


def room_rows(engine: str, tokens: Sequence[int], layers: int, reps: int, url: str, token: str | None = None,
              v32: str = "deepseek-v3.2-fp8", reps_over: tuple[int, int] = (65536, 2), device: str = "cpu",
              protocol: str = "tcp", split: bool = False) -> list[dict[str, Any]]:
    """GB/s of V4 rooms and V3.2 rooms (``v32``, the preset) of ``layers`` layers each through
    the room endpoints (``engine``), per length: bytes posted per room (less the aux row) and
    needed, slices, median time, GB/s, and V4's GB/s over V3.2's (``per_byte``). Both models'
    endpoints are up together and their rooms alternate (a V4 room, a V3.2 room, ...) so that
    both see the same load; one warm-up room each is not timed. Lengths of ``reps_over[0]``
    tokens or more run ``reps_over[1]`` timed rooms (at most ``reps``). ``device``: where the pools
    are (cpu, or cuda:N: the ipc engine, or Mooncake with ``protocol`` "rdma" and
    MC_INTRANODE_NVLINK=true for NVLink). ``split``: decode's endpoints in a process of their own
    (``DecodeProcess``; needed on a GPU), whose own room time (its ``receiver()`` to Success,
    prefill's sends queued first) is added as ``decode_ms``, ``decode_gbps`` and V4's
    ``decode_per_byte``; every row names the process decode ran in (``decode_pid``)."""
    rows: list[dict[str, Any]] = []
    models = ("deepseek-v4", v32)
    decode = DecodeProcess(engine, protocol, device, url, token, layers) if split else None
    try:
        for n in tokens:
            k = min(reps, reps_over[1]) if n >= reps_over[0] else reps
            rigs: list[_RoomRig] = []
            try:
                for model in models:
                    rigs.append(_RoomRig(model, _room_specs(model, layers), n, engine, url, token, device, protocol,
                                         decode))
                for rig in rigs:
                    rig.room()  # warm-up: connections, page faults
                got: list[list[dict[str, Any]]] = [[], []]
                for _ in range(k):
                    for i, rig in enumerate(rigs):
                        got[i].append(rig.room())
            finally:
                for rig in rigs:
                    rig.close()
            rows += _pair(models, got, n, layers, k, device, protocol, split)
    finally:
        if decode is not None:
            decode.stop()
    return rows


def _pair(models: Sequence[str], got: Sequence[Sequence[dict[str, Any]]], n: int, layers: int, k: int, device: str,
          protocol: str, split: bool) -> list[dict[str, Any]]:
    pair = {}
    for model, mine in zip(models, got):
        med = float(np.median([r["s"] for r in mine]))
        row = {"model": model, "device": device, "protocol": protocol, "split": split, "tokens": n, "layers": layers,
               "reps": k, "bytes": mine[0]["bytes"], "needed": mine[0]["needed"],
               "bytes_equal": all(r["bytes"] == r["needed"] for r in mine), "slices": mine[0]["slices"],
               "p50_ms": round(med * 1e3, 3), "gbps": round(mine[0]["bytes"] / med / 1e9, 4),
               "decode_pid": mine[0]["decode_pid"]}
        if split:
            dmed = float(np.median([r["decode_s"] for r in mine]))
            row.update(decode_ms=round(dmed * 1e3, 3), decode_gbps=round(mine[0]["bytes"] / dmed / 1e9, 4))
        pair[model] = row
    v4, v3 = pair[models[0]], pair[models[1]]
    v4["per_byte"] = round(v4["gbps"] / v3["gbps"], 3)
    if split:
        v4["decode_per_byte"] = round(v4["decode_gbps"] / v3["decode_gbps"], 3)
    return list(pair.values())


def format_rooms(rows: Sequence[dict[str, Any]], engine: str) -> str:
    first = rows[0] if rows else {}
    split = bool(first.get("split"))
    where = "host memory" if first.get("device", "cpu") == "cpu" else \
        f"pools on {first['device']}, protocol {first['protocol']}"
    layout = "decode in a process of its own" if split else "one process"
    lines = [f"GB/s through the rooms (a prefill and a decode endpoint, {layout}, {engine} engines, {where}; "
             "decode pages shuffled; median; time from prefill's first write posted to its room's success"
             + ("; decode's: its receiver() to Success, prefill's sends queued first" if split else "") + "):",
             f"{'model':>18} {'tokens':>7} {'layers':>6} {'reps':>4} {'moved MB':>9} {'needed MB':>10} {'=':>2} "
             f"{'slices':>7} {'p50 ms':>9} {'GB/s':>7} {'V4/V3.2 per byte':>17}"
             + (f" {'decode ms':>10} {'GB/s':>7} {'per byte':>9}" if split else "")]
    for r in rows:
        same = "=" if r["bytes_equal"] else "!"
        per = f"{r['per_byte']:.2f}x" if "per_byte" in r else ""
        line = (f"{r['model']:>18} {r['tokens']:>7} {r['layers']:>6} {r['reps']:>4} {_mb(r['bytes']):>9} "
                f"{_mb(r['needed']):>10} {same:>2} {r['slices']:>7} {r['p50_ms']:>9} {r['gbps']:>7} {per:>17}")
        if split:
            dper = f"{r['decode_per_byte']:.2f}x" if "decode_per_byte" in r else ""
            line += f" {r['decode_ms']:>10} {r['decode_gbps']:>7} {dper:>9}"
        lines.append(line)
    goal = [r["per_byte"] for r in rows if "per_byte" in r and r["tokens"] >= 8192]
    if goal:
        lines.append(f"goal V4 rooms >= 0.9x V3.2 rooms per byte at >= 8K tokens: worst {min(goal):.2f}x -> "
                     f"{'met' if min(goal) >= 0.9 else 'NOT met'}")
    if split and rows:
        lines.append(f"decode ran in process {first['decode_pid']} (the bench: {os.getpid()})")
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


def main() -> None:
    """``python -m kvbridge.bench.kinds decode '<cfg JSON>'``: decode's process of a split run."""
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    if role != "decode":
        raise SystemExit(f"kvbridge.bench.kinds: unknown role {role!r} (decode)")
    _serve_decode(cfg)


if __name__ == "__main__":
    main()

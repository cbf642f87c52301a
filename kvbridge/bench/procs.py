"""The bench's ranks, each in its own process (as in production): one decode rank and one
process per prefill CP rank, driven by ``kvbridge.bench.rig`` over JSON lines.

    python -m kvbridge.bench.procs decode|prefill '<json settings>'
    -> {"ready": true, "session": ..., ...}          once the endpoint is registered
    <- {"op": ...}  -> one JSON line per command     (``quit`` ends the process)

prefill commands: fill, plan, staging, send, wait_sent, raw, copy, stats, cpu
decode commands:  staging, prepare, recv, recv_wait, recv_wait_all, check, stats, cpu

Each process has the engine kvbridge runs on (``engine``: mooncake, nixl, ipc or auto) and,
when ``raw_mooncake`` is set, a raw baseline over the same buffers: the Mooncake binding of
kvbridge's own engine (mooncake), the one inside auto, or a second one (ipc); on nixl, the NIXL
agent of kvbridge's engine, driven directly (prepared descriptor lists, one request per rank). With
``KVBRIDGE_TRACE=1`` the decode process adds ``trace room=R bench recv|final @T``
lines around each timed room (``kvbridge.bench.trace`` reads them). With ``KVBRIDGE_SECRET`` set
(as a production cluster sets it) every rank's control channel carries its MAC, the same secret on
both sides; unset, the frames are plain (the bench's default).
"""

from __future__ import annotations

import base64
import ctypes
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import numpy as np

log = logging.getLogger("kvbridge.bench")
CAP = 1024  # slices per Mooncake call


def staging_sizes(cfg: dict[str, Any], role: str) -> dict[str, int]:
    """The staging sizes the bench asked for (``staging_slot_bytes`` > 0), else the configs' own; on
    decode, the slots kept for grants sent with a room's request (``staging_granted_slots``)."""
    kept = {"staging_granted_slots": int(cfg["staging_granted_slots"])} if role == "decode" and cfg.get(
        "staging_granted_slots") else {}
    slot = int(cfg.get("staging_slot_bytes") or 0)
    if not slot:
        return kept
    slots = cfg.get("staging_slots") or [2, 8]
    return {"staging_slot_bytes": slot, "staging_bytes": slot * int(slots[0 if role == "prefill" else 1]), **kept}


def control_secret() -> bytes | None:
    """The cluster secret the ranks' control channel uses: ``KVBRIDGE_SECRET`` (None when unset)."""
    return os.environ.get("KVBRIDGE_SECRET", "").encode() or None


def thread_cpu_s(thread: threading.Thread | None) -> float | None:
    """CPU seconds a live thread of this process has used, from its own clock (None: not running, or
    no per-thread clock on this platform). Only a live thread's id is asked about: a finished one's
    may name another thread or freed memory."""
    if thread is None or thread.ident is None or not thread.is_alive() or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, OverflowError):
        return None


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class RankBase:
    """What both roles share: geometry, buffers on the device, the engines."""

    def __init__(self, cfg: dict[str, Any], capacity: int) -> None:
        import torch

        from kvbridge.layout import OwnerLanes
        from kvbridge.transfer.engine import create_engine
        from kvbridge.worker.resources import allocate_buffers, aux_schema_of, build_contract, build_specs

        self.cfg = cfg
        self.torch = torch
        self.commands = threading.current_thread()  # the thread that runs this rank's commands (send() on prefill)
        self.alone = False  # the only rank of its process (``main``): its process's CPU time is the rank's
        self.device = cfg["device"]
        if self.device.startswith("cuda"):
            torch.cuda.set_device(self.device)
        self.specs = build_specs(cfg["preset"], cfg["layers"], cfg["page_size"], cfg["draft_layers"])
        self.contract = build_contract(cfg["preset"], cfg["layers"], cfg["page_size"], cfg["draft_layers"],
                                       "interleaved")
        self.aux_schema = aux_schema_of(self.contract)
        self.lanes = OwnerLanes(cfg["cp"])
        self.buffers = allocate_buffers(self.specs, capacity, device=self.device)
        self.engine = create_engine(cfg["engine"], protocol=cfg["protocol"], max_slices_per_call=cfg.get("cap"))
        # raw Mooncake: the binding under kvbridge's engine (auto holds one), else a second engine
        self.raw_engine = {"mooncake": self.engine, "auto": getattr(self.engine, "_mc", None),
                           "nixl": self.engine}.get(cfg["engine"])
        if cfg.get("raw_mooncake") and self.raw_engine is None:
            self.raw_engine = create_engine("mooncake", protocol=cfg["protocol"], max_slices_per_call=CAP)
            from kvbridge.transfer.engine import tensor_region

            for buf in self.buffers.values():
                self.raw_engine.register(*tensor_region(buf))

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize(self.device)

    def engine_stats(self) -> dict[str, int]:
        return dict(getattr(self.engine, "stats", {}))

    def cpu(self, cmd: dict) -> dict:
        """CPU seconds used so far by this rank's threads: ``loop`` (the endpoint's), ``commands``
        (the thread that runs these commands: prefill's send()), ``pump`` (the engine's completion
        thread, where it has one); with the rank alone in its process also ``process`` (every
        thread: the engine's native ones, decode's waits) and ``other`` (process less the named)."""
        named = {"loop": thread_cpu_s(getattr(self.endpoint, "_thread", None)),
                 "commands": thread_cpu_s(self.commands),
                 "pump": thread_cpu_s(getattr(self.engine, "_pump", None))}
        out = {k: v for k, v in named.items() if v is not None}
        if self.alone:
            out["process"] = time.process_time()
            out["other"] = out["process"] - sum(out[k] for k in named if k in out)
        return {"cpu": out}

    def close(self) -> None:
        self.endpoint.close()
        for eng in {id(e): e for e in (self.engine, self.raw_engine) if e is not None}.values():
            eng.close()


class PrefillRank(RankBase):
    def __init__(self, cfg: dict[str, Any]) -> None:
        from kvbridge.bootstrap.client import BootstrapClient
        from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint

        super().__init__(cfg, cfg["src_capacity"])
        self.rank = cfg["cp_rank"]
        # staging "never" until a staged room asks (the ``staging`` command): kvbridge rows stay direct
        pcfg = PrefillConfig(instance=cfg["instance"], cp_rank=self.rank, cp_size=cfg["cp"],
                             max_slices_per_call=cfg.get("cap") or CAP, aux_device=cfg["aux_device"],
                             staging="always" if cfg.get("staged") else "never", secret=control_secret(),
                             **staging_sizes(cfg, "prefill"))
        self.endpoint = PrefillEndpoint(pcfg, self.engine, self.specs, self.buffers, self.contract,
                                        BootstrapClient(cfg["bootstrap"], token=cfg.get("token")), self.aux_schema)
        self.endpoint.start()
        if cfg.get("staged"):
            self.endpoint.set_staging("never")
        self.owned = self.local = np.zeros(0, np.int64)
        self.plan: Any = None
        self.senders: dict[int, Any] = {}
        self.forwards: dict[int, tuple[Any, float]] = {}  # room -> (its forward's tail or None, send() seconds)
        self._cycles_per_ms: float | None = None
        self.scratch: Any = None
        self.trace = os.environ.get("KVBRIDGE_TRACE") == "1"

    def ready(self) -> dict[str, Any]:
        return {"ready": True, "session": self.engine.session_id}

    def fill(self, cmd: dict) -> dict:
        from kvbridge.bench import pattern

        t0 = time.perf_counter()
        self.owned, self.local = np.asarray(cmd["owned"], np.int64), np.asarray(cmd["local"], np.int64)
        for (pool, layer), buf in self.buffers.items():
            pattern.fill(self.specs[pool], buf, cmd["seed"], layer, self.owned, self.local)
        self.sync()
        return {"seconds": time.perf_counter() - t0}

    def do_plan(self, cmd: dict) -> dict:
        from kvbridge.layout import BufferDesc, describe_buffer, plan_transfer

        dst = [BufferDesc.from_list(d) for d in cmd["dst"]]
        src = [describe_buffer(self.specs[p], lid, b) for (p, lid), b in self.buffers.items()]
        page_ids = np.asarray(cmd["page_ids"], np.int64)
        t0 = time.perf_counter()
        self.plan = plan_transfer(self.specs, src, dst, self.owned, self.local, page_ids[self.owned], cmd["tokens"])
        return {"slices": self.plan.num_slices, "bytes": self.plan.num_bytes, "ms": (time.perf_counter() - t0) * 1e3}

    def staging(self, cmd: dict) -> dict:
        """The path of the rooms sent from now on: "never" (kvbridge direct) or "always" (staged)."""
        self.endpoint.set_staging(cmd["mode"])
        return {"staging": cmd["mode"]}

    def send(self, cmd: dict) -> dict:
        """The room's one send(), every page and (on the aux owner) the aux row; at monotonic time
        ``at`` when given (every rank's forward ends together: the bench's engine order).
        ``early_ms``: the end of a forward still runs when send() is called, as in vLLM's
        wait_for_save (an event recorded after the forward's launches): ``early_ms`` of GPU work (a
        timer on the CPU, or with ``early_host``) is queued at ``at``, send() is called at once with
        its event as ``ready_event``, and ``wait_sent`` says when the work ended."""
        from kvbridge.worker.synthetic import make_aux

        room, n = cmd["room"], cmd["tokens"]
        aux = make_aux(self.aux_schema, room, n) if cmd["aux"] else None
        s = self.endpoint.sender(room)
        s.init(n)
        if cmd.get("at") is not None:
            _wait_until(cmd["at"])
        forward = self._forward_tail(cmd["early_ms"], cmd.get("early_host", False)) if cmd.get("early_ms") else None
        if self.trace:
            log.info("trace room=%d bench send @%.6f", room, time.monotonic())
        t0 = time.monotonic()
        s.send(self.owned, self.local, is_last=True, aux=aux, ready_event=None if forward is None else forward.ready)
        self.senders[room] = s
        self.forwards[room] = (forward, time.monotonic() - t0)
        return {"queued": room}

    def _forward_tail(self, ms: float, host: bool = False) -> Any:
        """``ms`` of work on the device's current stream from now (CUDA: a sleep kernel between two
        timing events; CPU, or ``host``: a timer), whose ``ready`` event completes when it ends."""
        if host or not self.device.startswith("cuda"):
            return TimerForward(time.monotonic() + ms / 1e3)
        if self._cycles_per_ms is None:
            self._cycles_per_ms = CudaForward.cycles_per_ms(self.torch)
        return CudaForward(self.torch, int(ms * self._cycles_per_ms))

    def wait_sent(self, cmd: dict) -> dict:
        from kvbridge.transfer.poll import KVPoll

        s = self.senders.pop(cmd["room"])
        deadline = time.monotonic() + cmd.get("timeout", 60)
        while s.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.0005)
        state = s.poll()
        st = s.stats
        forward, send_s = self.forwards.pop(cmd["room"], (None, 0.0))
        return {"state": state.name, "reason": s.failure_reason or "", "slices": int(st.get("slices", 0)),
                "chunks": int(st.get("chunks", 0)), "bytes_staged": int(st.get("bytes_staged", 0)),
                "paths": sorted(set(st.get("paths", {}).values())), "send_s": send_s,
                "forward_s": None if forward is None else forward.seconds()}

    def raw(self, cmd: dict) -> dict:
        """Post this rank's plan at monotonic time ``at``: ``mooncake`` straight to the binding
        (<= 1,024 slices per synchronous call), ``engine`` through kvbridge's engine adapter."""
        calls = []
        if cmd.get("metadata"):  # NIXL: the decode agent's metadata, as a registration carries it
            self.engine.add_peer(cmd["session"], base64.b64decode(cmd["metadata"]))
        if cmd["method"] == "mooncake":
            mc = self.raw_engine._mc  # the binding itself: no adapter in the way
            calls = [(b[0].tolist(), b[1].tolist(), b[2].tolist()) for b in self.plan.batches(CAP)]
        elif cmd["method"] == "nixl":
            zeros = np.zeros(self.plan.src.size, np.uint64)
            local = np.stack((self.plan.src.astype(np.uint64), self.plan.length.astype(np.uint64), zeros), 1)
            remote = np.stack((self.plan.dst.astype(np.uint64), self.plan.length.astype(np.uint64), zeros), 1)
        _wait_until(cmd["at"])
        failure = ""
        if cmd["method"] == "nixl":
            failure = self._raw_nixl(cmd["session"], local, remote)
        elif cmd["method"] == "mooncake":
            for s, d, n in calls:
                rc = mc.batch_transfer_sync_write(cmd["session"], s, d, n)
                if rc != 0:
                    failure = f"cp{self.rank}: batch_transfer_sync_write returned {rc}"
                    break
        else:
            try:
                self.engine.wait(self.engine.submit_write(cmd["session"], self.plan.src, self.plan.dst,
                                                          self.plan.length), 120)
            except Exception as exc:  # reported in the row
                failure = f"cp{self.rank}: {exc}"
        return {"end": time.monotonic(), "failure": failure}

    def _raw_nixl(self, session: str, local: np.ndarray, remote: np.ndarray) -> str:
        """The plan's slices straight through the NIXL agent under kvbridge's engine: both descriptor
        lists prepared, one request, posted and polled here (no pump, no job table)."""
        eng = self.engine
        agent, peer = eng._nixl, eng._peers[session].agent  # the binding itself: no adapter in the way
        # memory type and device of each side from the engine's tables (ours; the peer's published)
        at_local = eng._regions.locate(local[:, 0], local[:, 1])
        at_remote = eng._peers[session].regions.locate(remote[:, 0], remote[:, 1])
        local[:, 2], remote[:, 2] = eng._local_dev[at_local], eng._peers[session].dev[at_remote]
        names = ("DRAM", "VRAM")
        with eng._lock:
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, names[int(eng._local_mem[at_local[0]])])
            rh = agent.prep_xfer_dlist(peer, remote, names[int(eng._peers[session].mem[at_remote[0]])])
            idx = np.arange(local.shape[0], dtype=np.int32)
            req = agent.make_prepped_xfer("WRITE", lh, idx, rh, idx)
            state = agent.transfer(req)
            while state == "PROC":
                state = agent.check_xfer_state(req)
            for h in (req, rh, lh):
                h.release()
        return "" if state == "DONE" else f"cp{self.rank}: raw NIXL transfer ended {state}"

    def copy(self, cmd: dict) -> dict:
        """The same slices copied within this process into a scratch buffer (memcpy ceiling, host only)."""
        nbytes = self.plan.num_bytes
        if self.scratch is None or self.scratch.nbytes < nbytes:
            self.scratch = np.empty(nbytes, np.uint8)
        dst = self.scratch.ctypes.data + np.concatenate([[0], np.cumsum(self.plan.length)[:-1]]).astype(np.int64)
        move = ctypes.memmove
        _wait_until(cmd["at"])
        for s, d, n in zip(self.plan.src.tolist(), dst.tolist(), self.plan.length.tolist()):
            move(d, s, n)
        return {"end": time.monotonic(), "failure": ""}

    def stats(self, cmd: dict) -> dict:
        return {"counters": dict(self.endpoint.counters), "engine": self.engine_stats()}


class DecodeRank(RankBase):
    def __init__(self, cfg: dict[str, Any]) -> None:
        from kvbridge.bootstrap.client import BootstrapClient
        from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint

        super().__init__(cfg, cfg["dst_capacity"])
        torch = self.torch
        self.aux = torch.zeros((cfg.get("aux_rows", 4), self.aux_schema.row_bytes), dtype=torch.uint8,
                               device=cfg["aux_device"])
        # staging "always" makes the area (on GPU pages too); "never" until a staged room asks
        dcfg = DecodeConfig(instance=cfg["instance"], peer_timeout=30.0, transfer_timeout=120.0,
                            staging="always" if cfg.get("staged") else "never", aux_inline=cfg.get("aux_inline", True),
                            secret=control_secret(), **staging_sizes(cfg, "decode"))
        self.endpoint = DecodeEndpoint(dcfg, self.engine, self.specs, self.buffers, self.contract,
                                       BootstrapClient(cfg["bootstrap"], token=cfg.get("token")), self.aux,
                                       self.aux_schema)
        self.endpoint.start()
        if cfg.get("staged"):
            self.endpoint.set_staging("never")
        self.trace = os.environ.get("KVBRIDGE_TRACE") == "1"
        self.receivers: dict[int, Any] = {}  # rooms opened with ask_first, until recv_wait

    def staging(self, cmd: dict) -> dict:
        """What the rooms requested from now on offer: "never" (kvbridge direct) or "always" (staged only)."""
        self.endpoint.set_staging(cmd["mode"])
        return {"staging": cmd["mode"]}

    def ready(self) -> dict[str, Any]:
        return {"ready": True, "session": self.engine.session_id,
                "raw_session": self.raw_engine.session_id if self.raw_engine is not None else None,
                "metadata": base64.b64encode(self.engine.metadata).decode(),
                "buffers": [d.to_list() for d in self.endpoint.buffers.descs]}

    def prepare(self, cmd: dict) -> dict:
        from kvbridge.bench import pattern

        for buf in self.buffers.values():
            pattern.poison(buf, np.asarray(cmd["page_ids"], np.int64))
        self.sync()
        return {"ok": True}

    def recv(self, cmd: dict) -> dict:
        """Open the room's receiver (decode's request leaves) and wait for it; ``ask_first``: answer
        once the request left (``recv_wait`` waits), the order of an engine whose decode admits a
        request while prefill computes."""
        room, n = cmd["room"], cmd["tokens"]
        page_ids = np.asarray(cmd["page_ids"], np.int64)
        t0 = time.perf_counter()
        if self.trace:
            log.info("trace room=%d bench recv @%.6f", room, time.monotonic())
        r = self.endpoint.receiver(room, cmd["prefill"])
        r.init(page_ids, cmd.get("aux_slot", 0), n)
        if cmd.get("ask_first"):
            self.receivers[room] = r
            return {"opened": room}
        return self._wait(room, r, cmd, t0)

    def recv_wait(self, cmd: dict) -> dict:
        """Wait for a room ``recv`` opened with ``ask_first``; ``final_at``: the monotonic time its
        Success (or failure) was seen."""
        return self._wait(cmd["room"], self.receivers.pop(cmd["room"]), cmd, time.perf_counter())

    def recv_wait_all(self, cmd: dict) -> dict:
        """Wait for several rooms ``recv`` opened with ``ask_first``, a thread each, so that each
        room's ``final_at`` is when its own wait returned, whatever order the rooms end in."""
        t0, out = time.perf_counter(), {}
        waits = [(room, self.receivers.pop(room)) for room in cmd["rooms"]]

        def one(room: int, r: Any) -> None:
            out[room] = self._wait(room, r, cmd, t0)

        threads = [threading.Thread(target=one, args=w, name=f"bench-wait-{w[0]}", daemon=True) for w in waits]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {"results": [out.get(room) or {"room": room, "state": "Failed", "reason": "its wait raised",
                                              "final_at": time.monotonic(), "aux_room": None}
                            for room, _ in waits]}

    def _wait(self, room: int, r: Any, cmd: dict, t0: float) -> dict:
        from kvbridge.transfer.poll import KVPoll

        final = (KVPoll.Success, KVPoll.Failed)
        timeout, poll_s = cmd.get("timeout", 120), cmd.get("poll_s", 0.0)
        if poll_s > 0:  # like an engine's scheduler step
            deadline = time.monotonic() + timeout
            while (state := r.poll()) not in final and time.monotonic() < deadline:
                time.sleep(poll_s)
        else:
            state = r.wait(timeout)
        elapsed, final_at = time.perf_counter() - t0, time.monotonic()
        if self.trace:
            log.info("trace room=%d bench final %s @%.6f", room, state.name, final_at)
        if state not in final:
            r.abort("bench timeout")
        out = {"room": room, "state": r.poll().name, "reason": r.failure_reason or "", "seconds": elapsed,
               "final_at": final_at, "aux_room": None if r.aux is None else int(r.aux.room)}
        del r
        return out

    def check(self, cmd: dict) -> dict:
        from kvbridge.bench import pattern

        self.sync()
        page_ids = np.asarray(cmd["page_ids"], np.int64)
        checked, errors = 0, []
        for (pool, layer), buf in self.buffers.items():
            n, err = pattern.check(self.specs[pool], buf, cmd["seed"], layer, page_ids, cmd["tokens"])
            checked += n
            if err:
                errors.append(err)
        return {"checked": checked, "errors": errors[:3]}

    def stats(self, cmd: dict) -> dict:
        return {"engine": self.engine_stats()}


def rank_ops(rank: RankBase) -> dict[str, Any]:
    """The commands ``rank`` answers, by name (a role's missing ones map to None)."""
    return {"fill": getattr(rank, "fill", None), "plan": getattr(rank, "do_plan", None),
            "staging": getattr(rank, "staging", None), "send": getattr(rank, "send", None),
            "wait_sent": getattr(rank, "wait_sent", None), "raw": getattr(rank, "raw", None),
            "copy": getattr(rank, "copy", None), "prepare": getattr(rank, "prepare", None),
            "recv": getattr(rank, "recv", None), "recv_wait": getattr(rank, "recv_wait", None),
            "recv_wait_all": getattr(rank, "recv_wait_all", None),
            "check": getattr(rank, "check", None), "stats": rank.stats, "cpu": rank.cpu}


class TimerForward:
    """A forward's tail on the CPU: its ``ready`` event completes at monotonic time ``end``."""

    def __init__(self, end: float) -> None:
        self.end, self.start, self.ready = end, time.monotonic(), self

    def query(self) -> bool:
        return time.monotonic() >= self.end

    def synchronize(self) -> None:
        _wait_until(self.end)

    def seconds(self) -> float:
        return self.end - self.start


class CudaForward:
    """A forward's tail on the GPU: ``cycles`` of a sleep kernel on the current stream between two
    timing events; ``ready`` is the second. ``seconds()`` (once ready) is the GPU's time from the
    first to the second: a room's KV was whole that long after the tail began."""

    def __init__(self, torch: Any, cycles: int) -> None:
        self._start, self.ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._start.record()
        torch.cuda._sleep(cycles)
        self.ready.record()

    def seconds(self) -> float:
        self.ready.synchronize()
        return self._start.elapsed_time(self.ready) / 1e3

    @staticmethod
    def cycles_per_ms(torch: Any, cycles: int = 10_000_000) -> float:
        """The sleep kernel's clock: loaded first (a launch that loads it would count in the time),
        then the fastest of three runs (on one GPU other processes' kernels take turns with it and
        only ever lengthen a run)."""
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        rates = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rates.append(cycles / start.elapsed_time(end))
        return max(rates)


def _wait_until(t: float) -> None:
    """Sleep, then spin, until monotonic time ``t`` (all ranks start a raw run together)."""
    left = t - time.monotonic()
    if left > 0.002:
        time.sleep(left - 0.002)
    while time.monotonic() < t:
        pass


def _profile_threads(folder: str, role: str) -> Any:
    """``KVBRIDGE_PROFILE_DIR``: a cProfile of every thread of this rank (its endpoint loop, the
    engine's pump, the main thread; before Python 3.12 each enabled on the thread's first call, from
    3.12 one profiler of the whole interpreter); returns the
    function that writes them, merged, to ``<folder>/<role>-<pid>.txt`` (by own time, then kvbridge's transfer and layout functions by
    cumulative time) and ``.prof``."""
    import cProfile
    import pstats
    import threading

    profiles: list[Any] = []

    def start(*_: Any) -> None:  # threading's profile hook: replaced by the thread's own profiler
        prof = cProfile.Profile()
        profiles.append(prof)
        prof.enable()

    if sys.version_info < (3, 12):  # from 3.12 one profiler sees every thread (sys.monitoring), and only one may run
        threading.setprofile(start)
    main_prof = cProfile.Profile()
    profiles.append(main_prof)
    main_prof.enable()

    def dump() -> None:
        threading.setprofile(None)
        for prof in profiles:
            prof.disable()
        stats = pstats.Stats(*profiles) if profiles else None
        if stats is None:
            return
        path = os.path.join(folder, f"{role}-{os.getpid()}")
        stats.dump_stats(path + ".prof")
        with open(path + ".txt", "w") as out:
            pstats.Stats(path + ".prof", stream=out).sort_stats("tottime").print_stats(40)
            pstats.Stats(path + ".prof", stream=out).sort_stats("cumulative").print_stats(r"kvbridge/(transfer|layout)", 80)

    return dump


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    profile_dir = os.environ.get("KVBRIDGE_PROFILE_DIR")
    dump_profile = _profile_threads(profile_dir, role) if profile_dir else None
    logging.basicConfig(level=logging.INFO if os.environ.get("KVBRIDGE_TRACE") == "1" else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    rank = PrefillRank(cfg) if role == "prefill" else DecodeRank(cfg)
    rank.alone = True
    ops = rank_ops(rank)
    emit(rank.ready())
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            handler = ops.get(cmd["op"])
            if handler is None:
                emit({"error": f"{role}: unknown op {cmd['op']!r}"})
                continue
            try:
                emit(handler(cmd))
            except Exception as exc:  # the driver shows it in the row
                log.exception("%s: %s failed", role, cmd["op"])
                emit({"error": f"{role} {cmd['op']}: {type(exc).__name__}: {exc}"})
    finally:
        rank.close()
        if dump_profile is not None:
            dump_profile()


if __name__ == "__main__":
    main()

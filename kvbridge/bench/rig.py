"""One PD pair for the bench, every rank in its own process: ``cp`` prefill ranks and one
decode rank (``kvbridge.bench.procs``), a bootstrap daemon beside them. With
``RigSpec.in_process`` every rank runs instead as a thread of the caller's process (the same
rank classes and commands, one CUDA context for all of them): the process layout as the one
thing changed between two runs of the same rooms.

For each request length and allocation (``kvbridge.bench.alloc``) every method moves
exactly the same slices between the same buffers:

    kvbridge  decode: receiver(room) .. init .. Success, timed on the decode side; the
              prefill ranks queued their sends before (their KV is ready), as in serving
    raw       the plan's (src, dst, length) of every CP rank posted straight to the Mooncake
              binding, <= 1,024 slices per synchronous call, the ranks starting together
    staged    the kvbridge room through staging (prefill gathers into its gather buffer, writes
              large pieces into decode's staging slots, decode scatters): the same pages and
              checks, every rank switched to staging "always" for the room; the kvbridge
              rows are direct (staging "never" on every rank)
    engine    the same slices through kvbridge's engine (submit_write + wait): the data
              path without the control protocol
    load      (``rooms_in_flight`` K > 1) K kvbridge rooms at once, direct and (with ``staged``)
              staged: decode asks for every room first, each on its own decode pages and aux
              row, then every prefill rank sends all K at one instant, as a scheduler hands a
              batch's finished prefills over; timed from that instant to the last room's Success
    memcpy    (host memory) each rank copies the same slices into a scratch buffer

Every kvbridge room lands on poisoned pages and is checked (``pattern``); with
``verify_every`` off only the first room of each length is.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.bench.alloc import Allocation, allocate
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.layout import OwnerLanes
from kvbridge.layout.aux import owner_of_last_token
from kvbridge.layout.pools import preset_pools

START_S = 0.005  # raw runs start this long after the command is sent: every rank gets it first
ASK_FIRST_LEAD_S = 0.05  # ask_first: decode's request this long before prefill's sends
CHILD_START_S = 180.0


@dataclass(frozen=True)
class RigSpec:
    cp: int
    max_tokens: int
    bootstrap: str
    token: str | None = None
    preset: str = "deepseek-v3.2-fp8"
    layers: int = 4
    draft_layers: int = 1
    page_size: int = 64
    engine: str = "mooncake"  # what kvbridge runs on: mooncake or ipc
    protocol: str = "tcp"  # Mooncake's ("rdma" with MC_INTRANODE_NVLINK=true: NVLink intra-node)
    raw_mooncake: bool = True  # measure raw Mooncake too (a second engine when ``engine`` is not Mooncake)
    device: str = "cpu"  # prefill pools
    decode_device: str = "cpu"
    prefill_aux: str = "cpu"
    decode_aux: str = "cpu"
    dst_order: str = "lane-major"
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str = ""  # every rank's log (stderr) goes here; a fresh temporary folder when empty
    poll_s: float = 0.0  # decode's wait: 0 blocks in KVReceiver.wait(); > 0 polls that often, like an engine's step
    staged: bool = False  # give both sides their staging buffers (the staged method)
    staging_slot_bytes: int = 0  # both sides' staging slots (0: the configs' defaults)
    staging_slots: tuple[int, int] = (2, 8)  # prefill's gather slots, decode's staging slots (with a slot size)
    staging_granted_slots: int = 0  # of decode's slots, kept for grants sent with a room's request (DecodeConfig)
    in_process: bool = False  # every rank a thread of this process (one CUDA context), not its own process
    # decode takes each room's aux row in the report that carries it (DecodeConfig.aux_inline); False:
    # as a write into its aux rows, one slice more per room
    aux_inline: bool = True
    # decode asks first: its request (and at CP > 1 the room's ticket) reaches prefill before every
    # rank's send(), at one instant; a room's time runs from that instant to decode's Success (the
    # order of an engine whose decode admits a request while prefill computes). False: prefill's
    # sends queue first and the time runs from decode's receiver() (a request that comes last)
    ask_first: bool = False
    # with ask_first: the forward's last ``send_early_ms`` still run on the GPU (a timer on the CPU)
    # when every rank calls send(), with that work's event as ``ready_event`` (vLLM's wait_for_save:
    # its event follows the forward's launches); the room's time runs from the end of that work to
    # decode's Success. 0: the KV is whole at send()
    send_early_ms: float = 0.0
    send_early_host: bool = False  # that tail is a host timer, also on a GPU (no kernel beside the rooms' copies)
    # rooms moved at once by ``run_kvbridge_load``: decode's pools hold this many rooms' pages (each room on
    # its own block of ``max_pages``) and as many aux rows (at least 4)
    rooms_in_flight: int = 1

    @property
    def max_pages(self) -> int:
        return -(-self.max_tokens // self.page_size)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A bench child's environment: this one, ``extra``, Mooncake's log at errors only unless set,
    and this kvbridge first on ``PYTHONPATH`` (the child imports the same tree as its parent)."""
    env = dict(os.environ, **(extra or {}))
    env.setdefault("GLOG_minloglevel", "2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                    env.get("PYTHONPATH", "")) if p)
    return env


class Child:
    """A rank in its own process (``python -m <module> <role> '<cfg JSON>'``), spoken to in JSON
    lines; always ``stop()`` it."""

    def __init__(self, role: str, cfg: dict[str, Any], env: dict[str, str], log_path: Path,
                 module: str = "kvbridge.bench.procs") -> None:
        self.role = role
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", module, role,
                                      json.dumps(cfg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                pass
        self.lines.put({"eof": True})

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = 300) -> dict:
        try:
            msg = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise KVBridgeError(f"bench {self.role}: no answer within {timeout:.0f}s") from None
        if msg.get("eof"):
            tail = self.log_path.read_text(errors="replace").splitlines()[-12:]
            raise KVBridgeError(f"bench {self.role} exited with {self.proc.wait()}; its log ({self.log_path}) ends:\n"
                                + "\n".join(tail))
        if msg.get("error"):
            raise KVBridgeError(msg["error"])
        return msg

    def ask(self, timeout: float = 300, **cmd: Any) -> dict:
        self.send(**cmd)
        return self.reply(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


class ThreadChild(Child):
    """A rank run by a thread of this process, spoken to like ``Child`` (the same commands, the
    same replies). ``spec.env`` must already be in ``os.environ`` (``Rig`` sets what is missing)."""

    def __init__(self, role: str, cfg: dict[str, Any], log_path: Path) -> None:
        self.role = role
        self.log_path = log_path
        log_path.write_text(f"{role}: a thread of process {os.getpid()} (RigSpec.in_process)\n")
        self.commands: queue.Queue[dict | None] = queue.Queue()
        self.lines: queue.Queue[dict] = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(cfg,), name=f"bench-{role}", daemon=True)
        self.thread.start()

    def _run(self, cfg: dict[str, Any]) -> None:
        from kvbridge.bench import procs

        try:
            rank = procs.PrefillRank(cfg) if self.role == "prefill" else procs.DecodeRank(cfg)
        except Exception as exc:  # noqa: BLE001 - the driver raises it from reply()
            self.lines.put({"error": f"{self.role} start: {type(exc).__name__}: {exc}"})
            self.lines.put({"eof": True})
            return
        ops = procs.rank_ops(rank)
        self.lines.put(rank.ready())
        try:
            while (cmd := self.commands.get()) is not None and cmd["op"] != "quit":
                handler = ops.get(cmd["op"])
                try:
                    self.lines.put(handler(cmd) if handler else {"error": f"{self.role}: unknown op {cmd['op']!r}"})
                except Exception as exc:  # noqa: BLE001 - as procs.main: shown in the row
                    self.lines.put({"error": f"{self.role} {cmd['op']}: {type(exc).__name__}: {exc}"})
        finally:
            rank.close()
            self.lines.put({"eof": True})

    def send(self, **cmd: Any) -> None:
        self.commands.put(cmd)

    def reply(self, timeout: float = 300) -> dict:
        try:
            msg = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise KVBridgeError(f"bench {self.role} (thread): no answer within {timeout:.0f}s") from None
        if msg.get("eof"):
            raise KVBridgeError(f"bench {self.role} (thread) ended")
        if msg.get("error"):
            raise KVBridgeError(msg["error"])
        return msg

    def stop(self) -> None:
        self.commands.put(None)
        self.thread.join(30)


def _check_room(what: str, room: int, res: dict[str, Any], sent: list[dict[str, Any]], staging: str) -> None:
    """KVBridgeError naming ``what`` unless decode saw Success with the room's own aux row and every
    prefill rank ended in Success on the path ``staging`` asks for ("always": staged, else direct)."""
    problems = [f"cp{r}: {s['state']} {s['reason']}" for r, s in enumerate(sent) if s["state"] != "Success"]
    want = "staged" if staging == "always" else "direct"
    problems += [f"cp{r}: went {'/'.join(s['paths'])}, not {want}" for r, s in enumerate(sent)
                 if set(s["paths"]) - {want}]
    if res["state"] != "Success" or res["aux_room"] != room or problems:
        raise KVBridgeError(f"{what}: decode {res['state']} {res['reason']} (aux row of room {res['aux_room']}); "
                            f"prefill {'; '.join(problems) or 'ok'}", room=room)


class Rig:
    def __init__(self, spec: RigSpec) -> None:
        if spec.rooms_in_flight < 1:
            raise ConfigError(f"rooms_in_flight must be at least 1, got {spec.rooms_in_flight}", field="rooms_in_flight")
        if spec.send_early_ms < 0 or (spec.send_early_ms and not spec.ask_first):
            raise ConfigError(f"send_early_ms ({spec.send_early_ms:g}) is the tail of a forward that decode's request "
                              "came before: it needs ask_first and a non-negative value", field="send_early_ms")
        self.spec = spec
        self.lanes = OwnerLanes(spec.cp)
        self.specs = preset_pools(spec.preset, num_layers=spec.layers, page_size=spec.page_size,
                                  draft_layers=spec.draft_layers)
        self.num_layers = sum(s.num_layers for s in self.specs.values())
        self.src_capacity = max(1, len(self.lanes.owned_pages(0, spec.max_pages)))
        self.dst_capacity = spec.max_pages  # a room's decode pages are drawn from this many (room k: block k)
        tag = f"{spec.engine}-cp{spec.cp}-{os.getpid()}"
        self.prefill_instance = f"bench-prefill-{tag}"
        base = {"bootstrap": spec.bootstrap, "token": spec.token, "preset": spec.preset, "layers": spec.layers,
                "draft_layers": spec.draft_layers, "page_size": spec.page_size, "cp": spec.cp, "engine": spec.engine,
                "protocol": spec.protocol, "raw_mooncake": spec.raw_mooncake, "staged": spec.staged,
                "aux_inline": spec.aux_inline,
                "staging_slot_bytes": spec.staging_slot_bytes, "staging_slots": list(spec.staging_slots),
                "staging_granted_slots": spec.staging_granted_slots}
        env = child_env(spec.env)
        self._own_logs = not spec.log_dir  # a temporary folder, removed at close (errors quote the log tail)
        logs = Path(spec.log_dir or tempfile.mkdtemp(prefix="kvbridge-bench-"))
        logs.mkdir(parents=True, exist_ok=True)
        self.log_dir = logs
        self.decode: Child | None = None
        self.prefill: list[Child] = []
        self.staging_mode = "never"
        self.last_send_s = 0.0  # the slowest rank's send() of the last kvbridge room (seconds)
        self.last_forward_s = 0.0  # and the longest forward's tail of its ranks (send_early_ms; seconds)
        # CPU seconds each rank's threads used over the last run_kvbridge_load (by rank, as ``cpu``), from just before
        # the sends to just after every rank reported the rooms sent
        self.last_load_cpu: dict[str, dict[str, float]] = {}
        if spec.in_process:  # the ranks' settings read from this process's environment
            for key, value in spec.env.items():
                os.environ.setdefault(key, value)

        def child(role: str, cfg: dict[str, Any], log_path: Path) -> Child:
            return ThreadChild(role, cfg, log_path) if spec.in_process else Child(role, cfg, env, log_path)

        try:
            self.decode = child("decode", {**base, "device": spec.decode_device, "aux_device": spec.decode_aux,
                                           "dst_capacity": self.dst_capacity * spec.rooms_in_flight,
                                           "aux_rows": max(4, spec.rooms_in_flight), "instance": f"bench-decode-{tag}"},
                                logs / f"decode-{tag}.log")
            for rank in range(spec.cp):
                self.prefill.append(child("prefill", {**base, "device": spec.device, "aux_device": spec.prefill_aux,
                                                      "src_capacity": self.src_capacity, "cp_rank": rank,
                                                      "instance": self.prefill_instance},
                                          logs / f"prefill-{tag}-cp{rank}.log"))
            ready = self.decode.reply(CHILD_START_S)
            self.session, self.raw_session, self.dst_descs = ready["session"], ready["raw_session"], ready["buffers"]
            self.metadata = ready.get("metadata", "")  # the decode engine's (NIXL needs it before a raw write)
            for child in self.prefill:
                child.reply(CHILD_START_S)
        except BaseException:
            self.close()
            raise

    # ---- one request length ----------------------------------------------------------------
    def allocation(self, alloc: str, num_tokens: int) -> Allocation:
        num_pages = -(-num_tokens // self.spec.page_size)
        return allocate(alloc, num_pages, self.lanes, self.src_capacity, self.dst_capacity, self.spec.dst_order,
                        seed=num_tokens)

    def prepare(self, pages: Allocation, num_tokens: int, seed: int) -> tuple[int, int, float]:
        """Fill every rank's owned pages, plan the slices; returns (bytes, slices, plan ms of the slowest rank)."""
        for rank, child in enumerate(self.prefill):
            owned, local = pages.for_rank(rank)
            child.send(op="fill", seed=seed, owned=owned.tolist(), local=local.tolist())
        for child in self.prefill:
            child.reply()
        plans = [c.ask(op="plan", dst=self.dst_descs, page_ids=pages.page_ids.tolist(), tokens=num_tokens)
                 for c in self.prefill]
        return sum(p["bytes"] for p in plans), sum(p["slices"] for p in plans), max(p["ms"] for p in plans)

    def ideal_slices(self, pages: Allocation) -> int:
        """runs x layers, + 1 for the aux row when it is written (not in the report: ``aux_inline``);
        a run is a stretch of pages consecutive on both sides."""
        runs = 0
        for rank in range(self.spec.cp):
            owned, local = pages.for_rank(rank)
            if owned.size:
                dst = pages.page_ids[owned]
                runs += 1 + int(np.count_nonzero((np.diff(dst) != 1) | (np.diff(local) != 1)))
        return runs * self.num_layers + (0 if self.spec.aux_inline else 1)

    def poison(self, pages: Allocation) -> None:
        self.decode.ask(op="prepare", page_ids=pages.page_ids.tolist())

    def check(self, pages: Allocation, num_tokens: int, seed: int) -> tuple[int, list[str]]:
        out = self.decode.ask(op="check", page_ids=pages.page_ids.tolist(), tokens=num_tokens, seed=seed, timeout=600)
        return out["checked"], out["errors"]

    def run_kvbridge(self, room: int, pages: Allocation, num_tokens: int, staging: str = "never") -> tuple[float, int]:
        """Seconds from the decode receiver's creation (``ask_first``: from the prefill ranks' send())
        to decode seeing Success; slices the senders posted (staged: wire pieces). ``staging``: the
        prefill ranks' path for the room, "never" (direct) or "always"."""
        self._set_staging(staging)
        aux_owner = owner_of_last_token(num_tokens, self.spec.page_size, self.lanes)
        recv = dict(room=room, tokens=num_tokens, page_ids=pages.page_ids.tolist(), prefill=self.prefill_instance,
                    poll_s=self.spec.poll_s)
        if self.spec.ask_first:
            self.decode.ask(op="recv", ask_first=True, **recv)
            time.sleep(ASK_FIRST_LEAD_S)  # the request (and the room's ticket) in on every rank
            at = time.monotonic() + START_S
            for rank, child in enumerate(self.prefill):  # every rank's forward ends at ``at`` (or its tail starts)
                child.send(op="send", room=room, tokens=num_tokens, aux=rank == aux_owner, at=at,
                           early_ms=self.spec.send_early_ms, early_host=self.spec.send_early_host)
            for child in self.prefill:
                child.reply()
            res = self.decode.ask(op="recv_wait", room=room, poll_s=self.spec.poll_s)
        else:
            for rank, child in enumerate(self.prefill):  # their KV is ready: sends queue until decode asks
                child.ask(op="send", room=room, tokens=num_tokens, aux=rank == aux_owner)
            res = self.decode.ask(op="recv", **recv)
        sent = [c.ask(op="wait_sent", room=room) for c in self.prefill]
        self.last_forward_s = max(s["forward_s"] or 0.0 for s in sent)
        if self.spec.ask_first:  # from the instant every rank's KV was whole
            res["seconds"] = res["final_at"] - at - self.last_forward_s
        self.last_send_s = max(s["send_s"] for s in sent)
        _check_room(f"room {room}", room, res, sent, staging)
        return res["seconds"], sum(s["slices"] for s in sent)

    def room_pages(self, pages: Allocation, k: int) -> Allocation:
        """The k-th room in flight: the allocation, its decode pages in block k of the pool."""
        return replace(pages, page_ids=pages.page_ids + k * self.dst_capacity)

    def run_kvbridge_load(self, rooms: list[int], pages: Allocation, num_tokens: int,
                          staging: str = "never") -> tuple[float, list[float]]:
        """``len(rooms)`` rooms at once (at most ``rooms_in_flight``): decode asks for every room (room
        k on ``room_pages(pages, k)``, aux row k), then every prefill rank sends all of them from one
        instant, in order, as a scheduler hands over a batch of finished prefills. Returns seconds
        from that instant to the last room's Success, and each room's own. Every room must succeed on
        the path asked, with its own aux row, else KVBridgeError names the room."""
        if not 0 < len(rooms) <= self.spec.rooms_in_flight:
            raise ConfigError(f"{len(rooms)} rooms at once: the rig holds pages for {self.spec.rooms_in_flight}",
                              field="rooms_in_flight")
        self._set_staging(staging)
        aux_owner = owner_of_last_token(num_tokens, self.spec.page_size, self.lanes)
        for k, room in enumerate(rooms):
            self.decode.ask(op="recv", ask_first=True, room=room, tokens=num_tokens, aux_slot=k,
                            page_ids=self.room_pages(pages, k).page_ids.tolist(), prefill=self.prefill_instance,
                            poll_s=self.spec.poll_s)
        time.sleep(ASK_FIRST_LEAD_S * max(1.0, len(rooms) / 4))  # every request (and ticket) in on every rank
        before = self.cpu()
        at = time.monotonic() + START_S
        for rank, child in enumerate(self.prefill):
            for room in rooms:
                child.send(op="send", room=room, tokens=num_tokens, aux=rank == aux_owner, at=at)
        for child in self.prefill:
            for _ in rooms:
                child.reply()
        results = self.decode.ask(op="recv_wait_all", rooms=rooms, poll_s=self.spec.poll_s)["results"]
        sent = [[c.ask(op="wait_sent", room=room) for c in self.prefill] for room in rooms]
        self.last_load_cpu = {label: {k: end[k] - before[label][k] for k in end.keys() & before[label].keys()}
                              for label, end in self.cpu().items()}
        for room, res, per_rank in zip(rooms, results, sent):
            _check_room(f"room {room} of {len(rooms)} in flight", room, res, per_rank, staging)
        each = [res["final_at"] - at for res in results]
        return max(each), each

    def cpu(self) -> dict[str, dict[str, float]]:
        """Every rank's CPU seconds so far by thread (``procs.RankBase.cpu``), by rank ("decode",
        "prefill cp0", ...), asked of all at once."""
        ranks = {"decode": self.decode, **{f"prefill cp{r}": c for r, c in enumerate(self.prefill)}}
        for child in ranks.values():
            child.send(op="cpu")
        return {label: child.reply()["cpu"] for label, child in ranks.items()}

    def _set_staging(self, staging: str) -> None:
        if staging != self.staging_mode:
            for child in (*self.prefill, self.decode):
                child.ask(op="staging", mode=staging)
            self.staging_mode = staging

    def run_together(self, op: str, **cmd: Any) -> float:
        """Every prefill rank runs ``op`` from the same instant; seconds until the last one is done."""
        at = time.monotonic() + START_S
        for child in self.prefill:
            child.send(op=op, at=at, **cmd)
        replies = [c.reply() for c in self.prefill]
        errors = [r["failure"] for r in replies if r["failure"]]
        if errors:
            raise KVBridgeError("; ".join(errors))
        return max(r["end"] for r in replies) - at

    def run_raw(self) -> float:
        method = "nixl" if self.spec.engine == "nixl" else "mooncake"
        return self.run_together("raw", method=method, session=self.raw_session, metadata=self.metadata)

    def run_engine(self) -> float:
        return self.run_together("raw", method="engine", session=self.session, metadata=self.metadata)

    def run_memcpy(self) -> float:
        return self.run_together("copy")

    def stats(self) -> dict[str, Any]:
        return {"prefill": [c.ask(op="stats") for c in self.prefill], "decode": self.decode.ask(op="stats")}

    def close(self) -> None:
        for child in [*self.prefill, self.decode]:
            if child is not None:
                child.stop()
        if self._own_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

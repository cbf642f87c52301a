"""NIXL transfer engine adapter (imported only by ``create_engine``): NVIDIA's NIXL over UCX.

    engine = create_engine("nixl")                  # an agent with the UCX backend
    engine.register(*tensor_region(kv_buffer))      # host (DRAM) or device (VRAM) memory
    engine.session_id                               # "nixl:<agent name>"
    engine.metadata                                 # bytes a peer needs before writing here
    peer.add_peer(engine.session_id, engine.metadata)   # carried by kvbridge's registration
    handle = peer.submit_write(engine.session_id, src, dst, length)

**Metadata.** A NIXL writer needs its target's agent metadata (UCX worker address,
the remote keys of every registered region) before its first write. It travels
through kvbridge's own control path, never a listener of NIXL's: ``metadata`` is
a small MessagePack envelope (``PeerInfo``: the agent name, NIXL's metadata bytes,
and the registered regions with their memory type and device), published in the
rank's registration at the bootstrap daemon (base64, ``engine_metadata``) and
handed to ``add_peer`` by whoever reads that registration (a prefill rank
resolving a decode rank, ``kvbridge doctor``, the bench). Read it after the last
``register``: a region registered later is not in it.

**Writes.** Every destination slice is located in the peer's published regions
before anything is posted; a slice outside them fails the whole write with a
reason naming the slice and the session, and nothing of it is written (hard rule
5 against what the peer registered, as NIXL itself refuses such a descriptor
list). A write is split into batches of at most ``max_slices_per_call`` slices
(and by memory type: one NIXL request moves one local and one remote memory
type). Each batch is posted as prepared descriptor lists: the local and remote
``N x 3`` arrays (address, length, device) go to ``prep_xfer_dlist`` as numpy
arrays, ``make_prepped_xfer`` selects all of them by an index array, so a
batch of thousands of slices costs no Python per slice. One pump thread posts
(UCX copies shared-memory transfers inside the post call, so the caller never
posts) and polls ``check_xfer_state`` of what is in flight, backing off from
``POLL_MIN_S`` to ``POLL_MAX_S`` while nothing changes; a final batch releases
its request and both descriptor lists. ``DONE``/``FAILED`` mean nothing of the
handle is still in flight (``TransferEngine``'s rule). The agent runs without NIXL's progress
thread, which spins at a fixed zero delay (half a core per idle agent, measured): while
nothing is in flight the pump progresses the agent's worker every ``IDLE_PROGRESS_S``, which
the target side of UCX's TCP transport needs (its remote writes are messages).

Every NIXL call is made holding one lock (the agent is created with
``NIXL_THREAD_SYNC_NONE``, no locking of its own); NIXL's exceptions
(``nixlNotFoundError``, ``nixlRemoteDisconnectError``, ...) become the failed
batch's reason, or an ``EngineError`` where a caller's call failed.

Which UCX transports move the bytes is UCX's choice (``UCX_TLS`` overrides it):
on one host shared memory (``cma``, ``posix``/``sysv``) or CUDA IPC, across hosts
RDMA or TCP. Security: UCX's TCP and shared-memory endpoints accept any peer
that holds the metadata; keep the daemon's registrations (which carry it) behind
its bearer token on a trusted network.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvbridge.errors import EngineError, TransferTimeout
from kvbridge.transfer.engine.base import wait_ready
from kvbridge.transfer.engine.jobs import Job, JobEngine, JobTable, Regions, as_int, check_write

log = logging.getLogger(__name__)

SESSION_PREFIX = "nixl:"
NIXL_MODULES = ("nixl_cu13", "nixl_cu12")  # the wheels' real packages: the meta package ``nixl`` imports torch
DRAM, VRAM = 0, 1
_MEM_NAMES = ("DRAM", "VRAM")
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3
IDLE_PROGRESS_S = 2e-3  # the pump's tick while nothing is in flight (it progresses the agent's worker)
CLOSE_WAIT_S = 30.0  # in-flight requests get this long to finish at close before they are released anyway
MAX_METADATA_BYTES = 1 << 20  # what add_peer accepts (the daemon caps the registration field too)


class PeerInfo(msgspec.Struct, frozen=True, tag="nixl-peer", tag_field="t"):
    """What a writer needs of a NIXL engine: its agent name, NIXL's agent metadata, and the
    regions it registered as ``(address, nbytes, memory type (0 DRAM, 1 VRAM), device)``."""

    agent: str
    md: bytes
    regions: list[tuple[int, int, int, int]]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(PeerInfo)


def nixl_module() -> Any:
    """NIXL's Python API module of the installed wheel (``nixl_cu13._api`` or ``nixl_cu12._api``),
    imported without the meta package, which imports torch to pick one."""
    errors = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
        except OSError as exc:  # a wheel whose native libraries do not load here
            errors.append(f"{name}: {exc}")
    raise ImportError("; ".join(errors))


def nixl_available() -> bool:
    """True when a NIXL wheel (``nixl-cu12`` or ``nixl-cu13``) imports on this host."""
    try:
        nixl_module()
    except ImportError:
        return False
    return True


@dataclass
class _Peer:
    session: str
    agent: str
    digest: bytes
    regions: Regions
    mem: np.ndarray  # per region of ``regions.sorted_starts``: memory type
    dev: np.ndarray  # and device


@dataclass
class _Batch:
    job: Job
    index: int  # 0-based within the job
    agent: str  # the peer's agent name
    local_mem: int
    remote_mem: int
    local: np.ndarray  # N x 3 uint64: address, length, device
    remote: np.ndarray
    after: Any = None
    handles: list[Any] = field(default_factory=list)  # local dlist, remote dlist, request (released when final)

    @property
    def num_slices(self) -> int:
        return int(self.local.shape[0])

    def describe(self) -> str:
        return (f"write {self.job.handle} batch {self.index + 1}/{self.job.num_batches} to session {self.job.session} "
                f"({self.num_slices} slices, {int(self.local[:, 1].sum())} bytes, "
                f"{_MEM_NAMES[self.local_mem]} -> {_MEM_NAMES[self.remote_mem]})")


class NixlEngine(JobEngine):
    transport = "nixl"

    def __init__(self, *, host: str = "127.0.0.1", max_slices_per_call: int = 1 << 16,
                 backends: tuple[str, ...] = ("UCX",)) -> None:
        if max_slices_per_call < 1:
            raise EngineError(f"max_slices_per_call must be positive, got {max_slices_per_call}",
                              field="max_slices_per_call")
        try:
            api = nixl_module()
        except ImportError as exc:  # pragma: no cover - create_engine checks first
            raise EngineError(f"NIXL does not import: {exc}", field="engine") from exc
        if "NIXL_LOG_LEVEL" not in os.environ:  # its Python logger prints every agent start at INFO
            logging.getLogger("nixl").setLevel(logging.WARNING)
        self.max_slices_per_call = max_slices_per_call
        self._agent_name = f"kvb-{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._session = SESSION_PREFIX + self._agent_name
        self._who = f"nixl engine {self._session}"
        try:
            # no progress thread of NIXL's: it spins (its delay is fixed at 0), half a core per idle
            # agent; the pump progresses the worker instead (see _run)
            config = api.nixl_agent_config(enable_prog_thread=False, backends=list(backends))
            self._nixl = api.nixl_agent(self._agent_name, config)
        except Exception as exc:  # the binding's errors (no UCX plugin, a backend that fails to start)
            raise EngineError(f"{self._who}: creating the NIXL agent with backends {list(backends)} failed: "
                              f"{_what(exc)}", field="engine") from exc
        missing = [b for b in backends if b not in self._nixl.backends]
        if missing:
            raise EngineError(f"{self._who}: NIXL backend(s) {missing} not available; plugins here: "
                              f"{self._nixl.get_plugin_list()}", field="engine")
        self._lock = threading.Lock()  # every call into the agent
        self._regions_lock = threading.Lock()  # ours, read by submit_write (never held across a NIXL post)
        self._regions = Regions()
        self._reg: dict[int, tuple[int, int, int, Any]] = {}  # ptr -> (nbytes, mem, dev, NIXL reg dlist)
        self._local_mem = np.zeros(0, np.int64)  # per region of self._regions.sorted_starts
        self._local_dev = np.zeros(0, np.uint64)
        self._peers: dict[str, _Peer] = {}
        self._jobs = JobTable(self._who)
        self._cond = threading.Condition()
        self._queue: deque[_Batch] = deque()
        self._inflight: list[_Batch] = []  # pump thread only
        self._closed = False
        self.posts = 0  # NIXL requests posted (for stats)
        self._pump = threading.Thread(target=self._run, name=f"nixl-pump-{self._agent_name}", daemon=True)
        self._pump.start()

    @property
    def session_id(self) -> str:
        return self._session

    @property
    def stats(self) -> dict[str, int]:
        """``posts``: NIXL transfer requests posted; ``peers``: agents whose metadata is loaded."""
        return {"posts": self.posts, "peers": len(self._peers)}

    # ---- memory -----------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> None:
        ptr, nbytes = as_int(ptr, self._who), as_int(nbytes, self._who)
        mem, dev = _memory_kind(ptr)
        with self._lock, self._regions_lock:
            self._check_open()
            self._regions.add(ptr, nbytes, self._who)
            try:
                reg = self._nixl.register_memory(np.array([[ptr, nbytes, dev]], np.uint64), _MEM_NAMES[mem])
            except Exception as exc:
                self._regions.remove(ptr, self._who)
                raise EngineError(f"{self._who}: NIXL register_memory({ptr:#x}, {nbytes}, "
                                  f"{_MEM_NAMES[mem]} device {dev}) failed: {_what(exc)}") from exc
            self._reg[ptr] = (nbytes, mem, dev, reg)
            self._index_local()

    def unregister(self, ptr: int) -> None:
        ptr = as_int(ptr, self._who)
        with self._lock, self._regions_lock:
            self._check_open()
            self._regions.remove(ptr, self._who)
            reg = self._reg.pop(ptr)[3]
            self._index_local()
            try:
                self._nixl.deregister_memory(reg)
            except Exception as exc:
                raise EngineError(f"{self._who}: NIXL deregister_memory({ptr:#x}) failed: {_what(exc)}") from exc

    def _index_local(self) -> None:
        starts = self._regions.sorted_starts.tolist()
        self._local_mem = np.array([self._reg[s][1] for s in starts], np.int64)
        self._local_dev = np.array([self._reg[s][2] for s in starts], np.uint64)

    # ---- metadata: published by the target, loaded by the writer -----------------------------
    @property
    def metadata(self) -> bytes:
        """This engine's ``PeerInfo`` (MessagePack), for its registration: read it after the last
        ``register``."""
        with self._lock:
            self._check_open()
            md = self._nixl.get_agent_metadata()
            regions = [(p, n, m, d) for p, (n, m, d, _) in sorted(self._reg.items())]
        return _ENCODER.encode(PeerInfo(agent=self._agent_name, md=md, regions=regions))

    def add_peer(self, session: str, metadata: bytes) -> None:
        """Load a peer's ``metadata`` (its registration's) so writes to ``session`` can go; the same
        metadata again is a no-op, newer metadata of the same session replaces the old."""
        if not isinstance(session, str) or not session.startswith(SESSION_PREFIX):
            raise EngineError(f"{self._who}: {session!r} is not a NIXL session (a peer on another engine?)",
                              field="session")
        if not isinstance(metadata, (bytes, bytearray)) or not metadata:
            raise EngineError(f"{self._who}: session {session} published no NIXL metadata (is it a NIXL engine?)",
                              field="engine_metadata")
        if len(metadata) > MAX_METADATA_BYTES:
            raise EngineError(f"{self._who}: metadata of session {session} is {len(metadata)} bytes, more than "
                              f"{MAX_METADATA_BYTES}", field="engine_metadata")
        digest = hashlib.sha256(metadata).digest()
        known = self._peers.get(session)
        if known is not None and known.digest == digest:
            return
        try:
            info = _DECODER.decode(metadata)
        except msgspec.DecodeError as exc:
            raise EngineError(f"{self._who}: metadata of session {session} is not a NIXL peer record: {exc}",
                              field="engine_metadata") from None
        if SESSION_PREFIX + info.agent != session:
            raise EngineError(f"{self._who}: metadata for session {session} names agent {info.agent!r}",
                              field="engine_metadata")
        regions, mem, dev = Regions(), {}, {}
        for ptr, nbytes, m, d in info.regions:
            if m not in (DRAM, VRAM) or d < 0:
                raise EngineError(f"{self._who}: session {session} publishes region {ptr:#x} with memory type {m} "
                                  f"device {d}", field="engine_metadata")
            regions.add(ptr, nbytes, f"{self._who}: peer {session}")
            mem[ptr], dev[ptr] = m, d
        starts = regions.sorted_starts.tolist()
        peer = _Peer(session, info.agent, digest, regions, np.array([mem[s] for s in starts], np.int64),
                     np.array([dev[s] for s in starts], np.uint64))
        with self._lock:
            self._check_open()
            try:
                if known is not None:
                    self._nixl.remove_remote_agent(known.agent)
                name = self._nixl.add_remote_agent(bytes(info.md))
                name = name.decode() if isinstance(name, bytes) else str(name)
                if name != info.agent:
                    self._nixl.remove_remote_agent(name)
                    raise EngineError(f"{self._who}: NIXL metadata of session {session} is agent {name!r}'s",
                                      field="engine_metadata")
                self._nixl.make_connection(name)  # now, not at the first write
            except EngineError:
                self._peers.pop(session, None)
                raise
            except Exception as exc:
                self._peers.pop(session, None)
                raise EngineError(f"{self._who}: loading the NIXL metadata of session {session} failed: "
                                  f"{_what(exc)}", field="engine_metadata") from exc
            self._peers[session] = peer

    # ---- writes -----------------------------------------------------------------------------
    def submit_write(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
                     after: Any = None) -> int:
        self._check_open()
        src, dst, length = check_write(self._who, session, src, dst, length, self._regions, self._regions_lock)
        with self._regions_lock:
            local_at = self._regions.locate(src, length)
            local_mem, local_dev = self._local_mem[local_at], self._local_dev[local_at]
        if src.size == 0:
            return self._jobs.open(session, 0, 0).handle
        peer = self._peers.get(session)
        problem = ""
        if peer is None:
            problem = (f"no NIXL metadata for session {session} (its registration was not read, "
                       "or it is not a NIXL engine)")
        else:
            remote_at = peer.regions.locate(dst, length)
            outside = np.flatnonzero(remote_at < 0)
            if outside.size:
                i = int(outside[0])
                problem = (f"slice {i} destination [{int(dst[i]):#x}, +{int(length[i])}) is outside the memory "
                           f"registered by session {session}; nothing of the write was posted")
        if problem:
            job = self._jobs.open(session, 1, int(src.size))
            self._jobs.batch_finished(job, f"{self._who}: write {job.handle} to session {session} "
                                           f"({src.size} slices, {int(length.sum())} bytes): {problem}")
            return job.handle
        remote_mem, remote_dev = peer.mem[remote_at], peer.dev[remote_at]
        local = np.stack((src, length, local_dev), axis=1)
        remote = np.stack((dst, length, remote_dev), axis=1)
        groups = [(DRAM if lm == DRAM else VRAM, DRAM if rm == DRAM else VRAM, mask)
                  for lm, rm, mask in _groups(local_mem, remote_mem)]
        cap = self.max_slices_per_call
        pieces = [(lm, rm, sel[a : a + cap]) for lm, rm, sel in groups for a in range(0, sel.size, cap)]
        with self._cond:
            self._check_open()
            job = self._jobs.open(session, len(pieces), int(src.size))
            for i, (lm, rm, sel) in enumerate(pieces):
                whole = sel.size == src.size
                self._queue.append(_Batch(job, i, peer.agent, lm, rm, local if whole else local[sel],
                                          remote if whole else remote[sel], after))
            self._cond.notify()
        return job.handle

    def reads(self, session: str) -> bool:
        return True

    def probe_read(self, session: str, dst: np.ndarray, src: np.ndarray, length: np.ndarray,
                   timeout: float = 5.0) -> None:
        self.read(session, dst, src, length, timeout)

    def read(self, session: str, dst: np.ndarray, src: np.ndarray, length: np.ndarray, timeout: float = 5.0) -> None:
        """Synchronous READ of the peer's ``src[i]`` into our registered ``dst[i]`` (``kvbridge doctor``'s
        read-back; rooms only write). EngineError naming the session, TransferTimeout past ``timeout``."""
        self._check_open()
        dst, src, length = check_write(self._who, session, dst, src, length, self._regions, self._regions_lock)
        peer = self._peers.get(session)
        if peer is None:
            raise EngineError(f"{self._who}: no NIXL metadata for session {session}", field="session")
        remote_at, local_at = peer.regions.locate(src, length), self._regions.locate(dst, length)
        if (remote_at < 0).any():
            raise EngineError(f"{self._who}: a read from session {session} outside the memory it registered",
                              field="src")
        if len(set((peer.mem[remote_at] * 2 + self._local_mem[local_at]).tolist())) != 1:
            raise EngineError(f"{self._who}: one read moves one pair of memory types", field="src")
        handles: list[Any] = []
        deadline = time.monotonic() + timeout
        try:
            with self._lock:
                n = self._nixl
                handles.append(n.prep_xfer_dlist("NIXL_INIT_AGENT", np.stack((dst, length, self._local_dev[local_at]),
                                                                              1), _MEM_NAMES[self._local_mem[local_at[0]]]))
                handles.append(n.prep_xfer_dlist(peer.agent, np.stack((src, length, peer.dev[remote_at]), 1),
                                                 _MEM_NAMES[peer.mem[remote_at[0]]]))
                idx = np.arange(dst.size, dtype=np.int32)
                handles.append(n.make_prepped_xfer("READ", handles[0], idx, handles[1], idx))
                state = n.transfer(handles[2])
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(POLL_MIN_S)
                with self._lock:
                    state = self._nixl.check_xfer_state(handles[2])
        except Exception as exc:
            raise EngineError(f"{self._who}: NIXL read from session {session} failed: {_what(exc)}") from exc
        finally:
            with self._lock:
                for h in reversed(handles):
                    try:
                        h.release()
                    except Exception as exc:  # still in flight: NIXL keeps it; say so in the log
                        log.warning("%s: releasing a read from %s: %s", self._who, session, _what(exc))
        if state == "PROC":
            raise TransferTimeout(f"{self._who}: read from session {session} still in flight after {timeout:g}s",
                                  field="timeout")
        if state != "DONE":
            raise EngineError(f"{self._who}: NIXL read from session {session} ended in state {state}")

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for batch in dropped:
            self._jobs.batch_finished(batch.job, f"{self._who} closed before posting {batch.describe()}")
        self._pump.join(CLOSE_WAIT_S + 10)
        if self._pump.is_alive():
            log.error("%s: pump still waiting on NIXL after %.0fs; engine leaked", self._who, CLOSE_WAIT_S + 10)
            return
        with self._lock, self._regions_lock:
            for ptr, (_, _, _, reg) in list(self._reg.items()):
                self._regions.remove(ptr, self._who)
                try:
                    self._nixl.deregister_memory(reg)
                except Exception as exc:  # closing: log it, withdraw the rest
                    log.warning("%s: deregistering %#x at close: %s", self._who, ptr, _what(exc))
            self._reg.clear()
            for peer in self._peers.values():
                try:
                    self._nixl.remove_remote_agent(peer.agent)
                except Exception as exc:
                    log.debug("%s: removing peer %s at close: %s", self._who, peer.session, _what(exc))
            self._peers.clear()
            self._nixl = None  # the agent's destructor stops the UCX workers

    # ---- pump thread ------------------------------------------------------------------------
    def _run(self) -> None:
        idle = POLL_MIN_S
        closing_since = 0.0
        while True:
            with self._cond:
                while not self._queue and not self._inflight and not self._closed:
                    if not self._cond.wait(IDLE_PROGRESS_S):
                        self._progress()
                if self._closed and not self._queue and not self._inflight:
                    return
                if self._queue:
                    to_post = list(self._queue)
                    self._queue.clear()
                else:
                    to_post = []
                    if self._inflight:  # nothing new: wait a little, longer while nothing changes
                        self._cond.wait(idle)
            for batch in to_post:
                if batch.job.failed:  # an earlier batch failed: do not post the rest
                    self._jobs.batch_finished(batch.job)
                else:
                    self._post(batch)
            changed = self._collect()
            idle = POLL_MIN_S if (changed or to_post) else min(POLL_MAX_S, idle * 2)
            if self._closed and self._inflight:
                closing_since = closing_since or time.monotonic()
                if time.monotonic() - closing_since > CLOSE_WAIT_S:
                    for batch in self._inflight:
                        self._finish(batch, f"{self._who}: {batch.describe()} still in flight "
                                            f"{CLOSE_WAIT_S:.0f}s after close")
                    self._inflight.clear()

    def _progress(self) -> None:
        """Let the agent's worker make progress while nothing of ours is in flight: the target side
        of a write (UCX's TCP transport emulates a remote write with messages the target must
        progress), connection set-up and disconnect detection. The agent runs no progress thread of
        its own; asking for notifications progresses its workers."""
        try:
            with self._lock:
                self._nixl.get_new_notifs()
        except Exception as exc:  # a broken worker shows in the next transfer's state; say it once here
            log.debug("%s: progress failed: %s", self._who, _what(exc))

    def _post(self, batch: _Batch) -> None:
        try:
            wait_ready(batch.after)  # the producer's events, on this (the pump's) thread
            with self._lock:
                n = self._nixl
                local = n.prep_xfer_dlist("NIXL_INIT_AGENT", batch.local, _MEM_NAMES[batch.local_mem])
                batch.handles.append(local)
                remote = n.prep_xfer_dlist(batch.agent, batch.remote, _MEM_NAMES[batch.remote_mem])
                batch.handles.append(remote)
                idx = np.arange(batch.num_slices, dtype=np.int32)
                req = n.make_prepped_xfer("WRITE", local, idx, remote, idx)
                batch.handles.append(req)
                state = n.transfer(req)
                self.posts += 1
        except Exception as exc:  # the binding's own errors become this batch's failure reason
            self._finish(batch, f"{self._who}: NIXL post failed ({_what(exc)}): {batch.describe()}")
            return
        if state == "DONE":
            self._finish(batch)
        elif state == "ERR":
            self._finish(batch, f"{self._who}: NIXL transfer() returned ERR: {batch.describe()}")
        else:
            self._inflight.append(batch)

    def _collect(self) -> bool:
        """Check every request in flight; True when one became final."""
        if not self._inflight:
            return False
        done: list[tuple[_Batch, str]] = []
        with self._lock:
            for batch in self._inflight:
                try:
                    state = self._nixl.check_xfer_state(batch.handles[2])
                except Exception as exc:
                    done.append((batch, f"{self._who}: NIXL check_xfer_state failed ({_what(exc)}): "
                                        f"{batch.describe()}"))
                    continue
                if state == "DONE":
                    done.append((batch, ""))
                elif state != "PROC":
                    done.append((batch, f"{self._who}: NIXL transfer failed (state {state}: a dead peer, or "
                                        f"memory it no longer holds): {batch.describe()}"))
        if not done:
            return False
        finished = {id(b) for b, _ in done}
        self._inflight = [b for b in self._inflight if id(b) not in finished]
        for batch, reason in done:
            self._finish(batch, reason)
        return True

    def _finish(self, batch: _Batch, reason: str = "") -> None:
        """Release the batch's request and descriptor lists, then count it (failed when ``reason``)."""
        with self._lock:
            for handle in reversed(batch.handles):
                try:
                    handle.release()
                except Exception as exc:  # a request NIXL cannot release is still in flight: say so
                    reason = reason or f"{self._who}: NIXL could not release {batch.describe()}: {_what(exc)}"
            batch.handles.clear()
        if reason:
            log.warning("%s", reason)
        self._jobs.batch_finished(batch.job, reason)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"{self._who} is closed")


def _groups(local_mem: np.ndarray, remote_mem: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """Slice indices by (local, remote) memory type: one NIXL request moves one pair."""
    key = local_mem * 2 + remote_mem
    first = int(key[0])
    if (key == first).all():  # the common case: one pair, no mask
        return [(first // 2, first % 2, np.arange(key.size))]
    return [(int(k) // 2, int(k) % 2, np.flatnonzero(key == k)) for k in np.unique(key)]


def _memory_kind(ptr: int) -> tuple[int, int]:
    """(DRAM, 0) for host memory, (VRAM, ordinal) for CUDA device memory. Device memory exists only
    where torch is loaded already (kvbridge allocates it with torch): without it, host memory, and
    no import of torch (seconds) for a host-only engine."""
    if "torch" not in sys.modules:
        return DRAM, 0
    from kvbridge.transfer.engine._cuda import cuda, cuda_available

    if not cuda_available():
        return DRAM, 0
    kind, device = cuda().pointer_kind(ptr)
    return (VRAM, device) if kind == "device" else (DRAM, 0)


def _what(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

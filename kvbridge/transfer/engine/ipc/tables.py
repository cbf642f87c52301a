"""Region tables of the IPC engine (``ipc.engine``): who may write where.

Two tables, one per side of a write, kept by every ``IpcEngine`` (this mixin holds
their methods; the engine holds the state and the one lock that covers both):

    ours     regions registered here (``register``), exported to same-host peers
             with a CUDA IPC handle each; ``unregister`` asks every writer that learnt
             a region to forget it and returns once each confirmed that no copy into
             it is in flight (``_revoke``)
    theirs   a peer's table (``Peer``), fetched over the side channel (``_peer``,
             ``_install``) and fetched once more on a miss; a region the owner withdraws
             is forgotten, its mapping closed and the withdrawal confirmed once the
             batches writing into it completed (``_forget``, ``_retire``, ``_release``)

Side-channel messages (``ipc.channel``): ``get`` -> ``regions`` (a table), ``revoke`` ->
``revoked`` (a confirmation).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.errors import EngineError
from kvbridge.transfer.engine.ipc.channel import Conn
from kvbridge.transfer.engine.jobs import as_int, locate

log = logging.getLogger("kvbridge.transfer.engine.ipc")

CONNECT_TIMEOUT_S = 5.0
REVOKE_TIMEOUT_S = 30.0
DEVICE, HOST = "device", "host"


@dataclass
class Export:
    """A region this engine registered, as peers see it."""

    start: int
    nbytes: int
    kind: str
    device: int = -1
    handle: bytes = b""  # CUDA IPC handle of the allocation holding it
    offset: int = 0  # start - allocation base

    def as_list(self) -> list[Any]:
        return [self.start, self.nbytes, self.kind, self.device, self.handle, self.offset]


@dataclass
class PeerRegion:
    """A region a peer registered, as a writer here uses it."""

    start: int
    nbytes: int
    kind: str
    device: int
    handle: bytes
    offset: int
    local: int = 0  # address of ``start`` in this process; 0 until opened
    inflight: int = 0  # batches in flight that write into it
    revoke_seq: int | None = None  # the owner withdrew it: confirm once inflight is 0


@dataclass
class Peer:
    session: str
    conn: Conn
    regions: list[PeerRegion] = field(default_factory=list)  # sorted by start
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    ends: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    device: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # per region: device memory
    shift: np.ndarray | None = None  # per region: its address here minus its address there (None: rebuild)

    def set_regions(self, regions: list[PeerRegion]) -> None:
        self.regions = sorted(regions, key=lambda r: r.start)
        self.starts = np.array([r.start for r in self.regions], dtype=np.uint64)
        self.ends = np.array([r.start + r.nbytes for r in self.regions], dtype=np.uint64)
        self.device = np.array([r.kind == DEVICE for r in self.regions], dtype=bool)
        self.shift = None

    def shifts(self) -> np.ndarray:
        """Address translation per region (regions opened since the last call counted): cached per table."""
        if self.shift is None:
            self.shift = np.array([r.local - r.start for r in self.regions], dtype=np.int64)
        return self.shift


class IpcTables:
    """The region-table half of ``IpcEngine`` (see the module docstring); its state lives on the
    engine: ``_lock``, ``_regions``, ``_kinds``, ``_own_device``, ``_exports``, ``_peers``,
    ``_acks``, ``_revoking``, ``_seqs``, ``_channel``, ``_device``, ``_has_cuda``, ``_who``."""

    # ---- memory (target side) ---------------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> None:
        ptr, nbytes = as_int(ptr, self._who), as_int(nbytes, self._who)
        self._check_open()
        export = self._describe(ptr, nbytes) if ptr > 0 and nbytes > 0 else None
        with self._lock:
            self._regions.add(ptr, nbytes, self._who)
            self._kinds[ptr] = export.kind if export else HOST
            self._exports[ptr] = export
            self._rebuild_kinds()

    def unregister(self, ptr: int) -> None:
        ptr = as_int(ptr, self._who)
        with self._lock:
            self._regions.remove(ptr, self._who)
            self._kinds.pop(ptr, None)
            self._exports.pop(ptr, None)
            self._rebuild_kinds()
            # under the lock that also covers serving tables: a writer either never gets ptr or is asked
            writers = [c for c in self._channel.accepted() if ptr in c.served]
        self._revoke(ptr, writers)

    def _rebuild_kinds(self) -> None:
        self._own_device = np.array([self._kinds[int(s)] == DEVICE for s in self._regions.sorted_starts.tolist()],
                                    dtype=bool)

    def _describe(self, ptr: int, nbytes: int) -> Export:
        if not self._has_cuda:
            return Export(ptr, nbytes, HOST)
        from kvbridge.transfer.engine._cuda import cuda

        kind, device = cuda().pointer_kind(ptr)
        if kind == HOST:
            return Export(ptr, nbytes, HOST)
        base, size = cuda().allocation(ptr, device)
        if ptr + nbytes > base + size:
            raise EngineError(f"{self._who}: region {ptr:#x}+{nbytes} spans more than one CUDA allocation")
        if self._device is None:
            self._device = device
        return Export(ptr, nbytes, DEVICE, device, cuda().ipc_handle(base, device), ptr - base)

    def _revoke(self, ptr: int, writers: list[Conn]) -> None:
        """Tell ``writers`` (those that learnt ``ptr``) to stop; return once each confirmed (or went away)."""
        if not writers:
            return
        seq = next(self._seqs)
        with self._lock:
            self._revoking[seq] = set(writers)
        for conn in writers:
            try:
                conn.send({"t": "revoke", "seq": seq, "start": ptr})
            except EngineError:  # its connection is gone: a dead writer writes nothing
                self._confirmed(seq, conn)
        deadline = time.monotonic() + REVOKE_TIMEOUT_S
        with self._acks:
            while self._revoking.get(seq) and time.monotonic() < deadline:
                self._acks.wait(deadline - time.monotonic())
            left = self._revoking.pop(seq, set())
        if left:
            raise EngineError(f"{self._who}: withdrawing region {ptr:#x}: writer pid(s) "
                              f"{sorted(c.peer_pid for c in left)} did not confirm within {REVOKE_TIMEOUT_S:g}s")

    def _confirmed(self, seq: int, conn: Conn) -> None:
        with self._acks:
            waiting = self._revoking.get(seq)
            if waiting is not None:
                waiting.discard(conn)
                self._acks.notify_all()

    # ---- side channel (I/O thread) ----------------------------------------------------------
    def _on_message(self, conn: Conn, msg: dict) -> None:
        kind = msg["t"]
        if kind == "get" and not conn.outgoing:
            with self._lock:  # sent under the lock: a revoke of any of these goes out after it
                exports = [e for e in self._exports.values() if e is not None]
                conn.served.update(e.start for e in exports)
                conn.send({"t": "regions", "id": msg.get("id"), "regions": [e.as_list() for e in exports]})
        elif kind == "regions" and conn.outgoing:
            self._install(conn, msg["regions"])
        elif kind == "revoked" and not conn.outgoing:
            self._confirmed(int(msg["seq"]), conn)
        elif kind == "revoke" and conn.outgoing:
            self._forget(conn, int(msg["start"]), int(msg["seq"]))
        else:
            log.warning("%s: unexpected side-channel message %r from pid %d", self._who, kind, conn.peer_pid)

    def _on_closed(self, conn: Conn) -> None:
        if not conn.outgoing:  # a writer went away: nothing of it is in flight any more
            with self._acks:
                for waiting in self._revoking.values():
                    waiting.discard(conn)
                self._acks.notify_all()
            return
        with self._lock:
            peer = self._peers.get(conn.session)
            if peer is None or peer.conn is not conn:
                return
            del self._peers[conn.session]
            regions = list(peer.regions)
            peer.set_regions([])
        for region in regions:
            self._retire(peer, region, seq=None)

    def _install(self, conn: Conn, table: list) -> None:
        """A peer's region table, on the I/O thread (so a revoke sent after it is handled after it)."""
        fresh = {int(r[0]): PeerRegion(int(r[0]), int(r[1]), str(r[2]), int(r[3]), bytes(r[4]), int(r[5]))
                 for r in table}
        with self._lock:
            peer = self._peers.get(conn.session)
            if peer is None or peer.conn is not conn:
                return
            for old in peer.regions:  # keep what is opened and counted
                if old.start in fresh and fresh[old.start].handle == old.handle:
                    fresh[old.start] = old
            peer.set_regions(list(fresh.values()))

    def _forget(self, conn: Conn, start: int, seq: int) -> None:
        with self._lock:
            peer = self._peers.get(conn.session)
            region = None
            if peer is not None and peer.conn is conn:
                region = next((r for r in peer.regions if r.start == start), None)
                if region is not None:
                    peer.set_regions([r for r in peer.regions if r is not region])
        if region is None:
            conn.send({"t": "revoked", "seq": seq})
            return
        self._retire(peer, region, seq)

    def _retire(self, peer: Peer, region: PeerRegion, seq: int | None) -> None:
        """A region left the peer's table: close its mapping and confirm once no copy into it is in flight."""
        with self._lock:
            region.revoke_seq = -1 if seq is None else seq
            if region.inflight:
                return  # the pump thread finishes the job when the last batch into it completes
        self._release(peer, region)

    def _release(self, peer: Peer, region: PeerRegion) -> None:
        if region.local and region.kind == DEVICE and not peer.conn.same_process:
            from kvbridge.transfer.engine._cuda import mappings

            try:
                mappings().release(region.handle)
            except EngineError as exc:  # logged: the mapping leaks, nothing is written through it
                log.warning("%s: %s", self._who, exc)
        region.local = 0
        peer.shift = None
        if region.revoke_seq is not None and region.revoke_seq >= 0 and not peer.conn.closed:
            try:
                peer.conn.send({"t": "revoked", "seq": region.revoke_seq})
            except EngineError as exc:
                log.warning("%s: %s", self._who, exc)

    # ---- peers' tables (writer side) ---------------------------------------------------------
    def reaches(self, session: str) -> bool:
        """True when the IPC engine of ``session`` answers on this host (its region table read)."""
        try:
            self._peer(session)
        except EngineError:
            return False
        return True

    def reachable(self, session: str, dst: np.ndarray, length: np.ndarray) -> np.ndarray | None:
        """Per slice, whether a write could reach its destination: device memory the peer registered,
        or any memory of a peer in this process (slices outside every region count as reachable: the
        write fails with the reason). None when the peer does not answer."""
        try:
            peer = self._peer(session)
            with self._lock:
                missed = bool((locate(peer.starts, peer.ends, dst, length) < 0).any())
            if missed:  # registered since we asked? ask once more
                peer = self._peer(session, refresh=True)
        except EngineError:
            return None
        with self._lock:
            if peer.conn.same_process:
                return np.ones(dst.size, dtype=bool)
            idx = locate(peer.starts, peer.ends, dst, length)
            device = peer.device
        return np.where(idx >= 0, device[np.maximum(idx, 0)] if device.size else True, True)

    @staticmethod
    def _used(peer: Peer, idx: np.ndarray) -> list[PeerRegion]:
        return [peer.regions[j] for j in np.flatnonzero(np.bincount(idx, minlength=len(peer.regions))).tolist()]

    def _why_outside(self, peer: Peer, dst: np.ndarray, length: np.ndarray, idx: np.ndarray) -> str | None:
        """Why a dst slice cannot be written, or None (lock held)."""
        bad = np.flatnonzero(idx < 0)
        if bad.size:
            i = int(bad[0])
            return (f"{self._who}: slice {i} destination [{int(dst[i]):#x}, +{int(length[i])}) is outside the "
                    f"memory registered by session {peer.session}")
        if not peer.conn.same_process:
            for r in self._used(peer, idx):
                if r.kind == HOST:
                    return (f"{self._who}: destination region {r.start:#x}+{r.nbytes} of session {peer.session} is "
                            f"host memory of process {peer.conn.peer_pid}; CUDA IPC reaches device memory only")
        return None

    def _peer(self, session: str, refresh: bool = False) -> Peer:
        with self._lock:
            peer = self._peers.get(session)
        if peer is None or peer.conn.closed:
            peer = Peer(session, self._channel.connect(session, CONNECT_TIMEOUT_S))
            with self._lock:
                self._peers[session] = peer
            refresh = True
        if refresh:  # the reply is installed by the I/O thread (_install) before request() returns
            self._channel.request(peer.conn, {"t": "get"}, CONNECT_TIMEOUT_S)
            self._open_all(peer)
        return peer

    def _open_all(self, peer: Peer) -> None:
        """Map every region of a table just learnt, at connect rather than on a room's first write
        (``cudaIpcOpenMemHandle`` per allocation: 69 opens in a first 8K room's submit on the GPU
        host). A region that does not open stays closed: a write into it tries again and fails
        with the reason."""
        with self._lock:
            for region in peer.regions:
                if region.local or region.revoke_seq is not None:
                    continue
                try:
                    self._open(peer, region)
                except EngineError as exc:
                    log.debug("%s: region %#x of session %s not opened at connect: %s", self._who, region.start,
                              peer.session, exc)
            peer.shift = None

    def _open(self, peer: Peer, region: PeerRegion) -> None:
        if region.local:
            return
        if peer.conn.same_process or region.kind == HOST:
            region.local = region.start
            return
        from kvbridge.transfer.engine._cuda import mappings

        region.local = mappings().acquire(region.handle, self._writer_device(region)) + region.offset

    def _writer_device(self, region: PeerRegion) -> int:
        return self._device if self._device is not None else region.device

"""The data-path hops of ``kvbridge doctor``: a rank's control endpoint and its
transfer-engine session, probed from this host.

Control: a ``Ping`` over the real control channel, sealed with the cluster secret, must come
back as a ``Heartbeat``. A TCP connect first tells "nobody listens" apart from "listens,
but does not answer us" (a rank drops what does not carry its secret, without a word).

Engine: doctor runs its own engine of the rank's kind (Mooncake; NIXL for a ``nixl:`` session,
loading the metadata the rank's registration carries) with a registered scratch buffer. For every
rank that advertises a scratch region (``ScratchDescriptor`` in its registration: a few
KiB registered with its engine that hold no KV), doctor writes a random nonce into it
(this host -> the rank) and reads it back (the rank -> this host), then compares. A probe
never writes a KV page: a rank that advertises no scratch region is skipped, not probed.
The write/read pair checks what a room needs from this host's side: the session's RPC
port answers, the data port is reachable, and registered memory accepts remote writes.
Run doctor on a prefill host to check the prefill -> decode direction rooms use.
"""

from __future__ import annotations

import base64
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import numpy as np

from kvbridge.bootstrap.schemas import RankDetail, RankView, ScratchDescriptor
from kvbridge.doctor.checks import FAIL, OK, SKIP, Check
from kvbridge.errors import KVBridgeError, ProtocolError, TransferError
from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel import PeerSet
from kvbridge.transfer.engine.native_logs import quiet_native_logs

__all__ = ["control_checks", "EngineProbe", "NixlProbe"]

PROBE_BYTES = 16


def _tcp_open(host: str, port: int, timeout: float) -> str | None:
    """None when something accepts a TCP connection at host:port, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or repr(exc)


def _host_port(address: str) -> tuple[str, int]:
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    return parsed.hostname or "", parsed.port or 0


def control_checks(ranks: list[tuple[str, str]], secret: bytes | None, timeout: float) -> list[Check]:
    """Ping every ``(label, control endpoint)``; a Heartbeat back means the hop works with our secret."""
    out: list[Check] = []
    peers = PeerSet(secret=secret)
    try:
        for seq, (label, endpoint) in enumerate(ranks, 1):
            out.append(_ping(peers, label, endpoint, seq, secret, timeout))
    finally:
        peers.close()
    return out


def _ping(peers: PeerSet, label: str, endpoint: str, seq: int, secret: bytes | None, timeout: float) -> Check:
    t0 = time.monotonic()
    host, port = _host_port(endpoint)
    closed = _tcp_open(host, port, timeout)
    if closed is not None:
        return Check("control", label, FAIL, f"{endpoint}: nobody listens ({closed})",
                     "the rank is down, or a firewall/NetworkPolicy blocks this port from here",
                     seconds=time.monotonic() - t0)
    try:
        peers.send(endpoint, wire.Ping(decode_rank=f"doctor@{socket.gethostname()}", seq=seq))
    except TransferError as exc:
        return Check("control", label, FAIL, f"{endpoint}: cannot send: {exc}", "check the endpoint",
                     seconds=time.monotonic() - t0)
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        for where, msg in peers.recv_ready(int(max(1, (deadline - time.monotonic()) * 1000))):
            if where != endpoint:
                continue
            if isinstance(msg, wire.Heartbeat) and msg.seq == seq:
                ms = 1000 * (time.monotonic() - t0)
                return Check("control", label, OK, f"{endpoint}: Heartbeat from cp{msg.cp_rank} in {ms:.1f} ms "
                             f"({'authenticated' if secret else 'no secret'})", seconds=time.monotonic() - t0)
            if isinstance(msg, ProtocolError) and msg.field == "v":  # another kvbridge's wire protocol
                return Check("control", label, FAIL, f"{endpoint}: answer refused here: {msg}"[:300],
                             "doctor and the rank run kvbridge versions of different wire protocols "
                             "(kvbridge version): run the same one", seconds=time.monotonic() - t0)
            if isinstance(msg, ProtocolError):  # the answer does not open with our secret
                return Check("control", label, FAIL, f"{endpoint}: answer refused here: {msg}"[:300],
                             "doctor and the rank disagree on the cluster secret (--secret / KVBRIDGE_SECRET): "
                             "one of them has none", seconds=time.monotonic() - t0)
            if isinstance(msg, wire.ErrorReply):
                return Check("control", label, FAIL, f"{endpoint}: refused our Ping: {msg.reason}"[:300],
                             "check the cluster secret and the kvbridge versions", seconds=time.monotonic() - t0)
    return Check("control", label, FAIL, f"{endpoint}: listening, but no Heartbeat within {timeout:g}s",
                 "wrong cluster secret (a rank drops unauthenticated messages without a reply): pass the "
                 "secret the ranks use (--secret / KVBRIDGE_SECRET); else the rank's loop is stalled",
                 seconds=time.monotonic() - t0)


class EngineProbe:
    """Doctor's own Mooncake engine and scratch buffer (``close()`` it)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        from mooncake.engine import TransferEngine  # lazily: doctor's other hops work without Mooncake

        # Mooncake's glog lines (its start-up's, and an ERROR per refused connection) go to fd 2
        # from C++: kept off doctor's output and handed to kvbridge's log, as the engines do
        # (native_logs.py: GLOG_minloglevel does not reach Mooncake's glog)
        with quiet_native_logs():
            self.engine = TransferEngine()
            started = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if started != 0:
            raise TransferError(f"doctor: Mooncake engine did not start on {host}", field="host")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.buf = np.zeros(2 * PROBE_BYTES, dtype=np.uint8)
        if self.engine.register_memory(self.buf.ctypes.data, self.buf.nbytes) != 0:
            raise TransferError("doctor: cannot register its scratch buffer", field="scratch")

    def close(self) -> None:
        self.engine.unregister_memory(self.buf.ctypes.data)

    def check(self, label: str, rank: RankView, timeout: float) -> Check:
        if rank.scratch is None:
            return Check("engine", label, SKIP, f"{rank.session_id}: the rank advertises no scratch region; doctor "
                         "never writes into KV pages, so this session is not probed")
        t0 = time.monotonic()
        host, port = _host_port(rank.session_id)
        closed = _tcp_open(host, port, timeout)
        if closed is not None:
            return Check("engine", label, FAIL, f"session {rank.session_id}: nothing answers ({closed})",
                         "the rank's transfer engine is down, or a firewall/NetworkPolicy blocks its RPC port from "
                         "here (Mooncake picks its ports at start-up)", seconds=time.monotonic() - t0)
        with quiet_native_logs(error_level=logging.DEBUG):  # a failure is this check's to report
            problem = self._write_and_read(rank.session_id, rank.scratch, timeout)
        seconds = time.monotonic() - t0
        if problem:
            return Check("engine", label, FAIL, f"session {rank.session_id}: {problem}",
                         "check that Mooncake's data ports are reachable from here (same protocol, tcp/rdma) and "
                         "that the rank is alive", seconds=seconds)
        return Check("engine", label, OK, f"session {rank.session_id}: {PROBE_BYTES} B written into its scratch and "
                     f"read back in {1000 * seconds:.1f} ms", seconds=seconds)

    def _write_and_read(self, session: str, scratch: ScratchDescriptor, timeout: float) -> str:
        nonce = np.frombuffer(secrets.token_bytes(PROBE_BYTES), dtype=np.uint8)
        self.buf[:PROBE_BYTES] = nonce
        self.buf[PROBE_BYTES:] = 0
        slot = secrets.randbelow(scratch.nbytes // PROBE_BYTES) * PROBE_BYTES  # concurrent doctors rarely collide
        local, remote = self.buf.ctypes.data, scratch.base + slot

        def write() -> int:
            return int(self.engine.transfer_sync_write(session, local, remote, PROBE_BYTES))

        def read() -> int:
            return int(self.engine.transfer_sync_read(session, local + PROBE_BYTES, remote, PROBE_BYTES))

        for what, op in (("probe write", write), ("read-back", read)):
            code = _bounded(op, timeout)
            if code is None:
                return f"{what} still pending after {timeout:g}s"
            if code != 0:
                return f"{what} failed (Mooncake returned {code})"
        if not np.array_equal(self.buf[PROBE_BYTES:], nonce):
            return "read-back differs from what was written (another writer on the scratch region?)"
        return ""


class NixlProbe:
    """Doctor's own NIXL engine (kvbridge's adapter, the one rooms write through) and scratch
    buffer, for ranks whose session is a NIXL agent (``close()`` it)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        from kvbridge.transfer.engine import create_engine

        self.engine = create_engine("nixl", host=host)
        self.buf = np.zeros(2 * PROBE_BYTES, dtype=np.uint8)
        self.engine.register(self.buf.ctypes.data, self.buf.nbytes)

    def close(self) -> None:
        self.engine.close()

    def check(self, label: str, rank: RankView, detail: Callable[[str], RankDetail], timeout: float) -> Check:
        """``detail(rank_id)``: the rank's registration (the daemon's), which carries its NIXL metadata."""
        if rank.scratch is None:
            return Check("engine", label, SKIP, f"{rank.session_id}: the rank advertises no scratch region; doctor "
                         "never writes into KV pages, so this session is not probed")
        t0 = time.monotonic()
        session, scratch = rank.session_id, rank.scratch
        try:
            metadata = base64.b64decode(detail(rank.rank_id).engine_metadata, validate=True)
            self.engine.add_peer(session, metadata)
        except (KVBridgeError, ValueError) as exc:
            return Check("engine", label, FAIL, f"session {session}: its registration's NIXL metadata does not load: "
                         f"{exc}"[:300], "the rank registered without (or with stale) engine metadata: restart it "
                         "on kvbridge's NIXL engine", seconds=time.monotonic() - t0)
        nonce = np.frombuffer(secrets.token_bytes(PROBE_BYTES), dtype=np.uint8)
        self.buf[:PROBE_BYTES], self.buf[PROBE_BYTES:] = nonce, 0
        remote = scratch.base + secrets.randbelow(scratch.nbytes // PROBE_BYTES) * PROBE_BYTES
        local = self.buf.ctypes.data
        try:
            self.engine.write(session, [local], [remote], [PROBE_BYTES], timeout)
            self.engine.read(session, [local + PROBE_BYTES], [remote], [PROBE_BYTES], timeout)
            problem = "" if np.array_equal(self.buf[PROBE_BYTES:], nonce) else \
                "read-back differs from what was written (another writer on the scratch region?)"
        except KVBridgeError as exc:
            problem = str(exc)
        seconds = time.monotonic() - t0
        if problem:
            return Check("engine", label, FAIL, f"session {session}: {problem}"[:300],
                         "check that UCX reaches the rank from here (UCX_TLS, UCX_NET_DEVICES) and that the rank "
                         "is alive", seconds=seconds)
        return Check("engine", label, OK, f"session {session}: {PROBE_BYTES} B written into its scratch and read "
                     f"back over NIXL in {1000 * seconds:.1f} ms", seconds=seconds)


def _bounded(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` on a daemon thread; None if it has not returned within ``timeout`` (a Mooncake
    call cannot be cancelled: the thread is left to finish on its own)."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    return box[0] if box else None

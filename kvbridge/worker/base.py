"""What prefill and decode workers share: resources, the ops loop, draining.

The loop reads like an engine's ``step()``::

    for op in ops.receive(timeout): handle(op)      # start rooms, stats, shutdown
    for task in tasks: advance(task)                 # poll sender/receiver, send chunks, verify
    finished tasks -> RoomResult replies

Shutdown (SIGTERM or a Shutdown op): new rooms are refused, in-flight rooms get
``drain_timeout`` seconds to finish, the rest are aborted with a reason and
their replies sent; then the endpoint closes (the rank deregisters).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import ConfigError, KVBridgeError, PeerLost
from kvbridge.transfer.engine.registry import engine_entry
from kvbridge.worker import ops
from kvbridge.worker.config import WorkerConfig
from kvbridge.worker.metrics import WorkerMetrics
from kvbridge.worker.pages import PageAllocator
from kvbridge.worker.resources import allocate_buffers, aux_schema_of, build_contract, build_specs, buffers_nbytes


@dataclass
class Task:
    """One room this worker runs for an ops client."""

    room: int
    num_tokens: int
    peer: bytes
    request_id: int
    started: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)  # phase -> seconds since start
    aborting: bool = False  # abort asked; the room still reports its final state

    def mark(self, phase: str) -> None:
        self.marks.setdefault(phase, round(time.monotonic() - self.started, 6))

    @property
    def age(self) -> float:
        return time.monotonic() - self.started


BACKSTOP_GRACE_S = 2.0


class WorkerBase:
    role = ""
    room_op: type = ops.Prefill
    aux_device = "cpu"  # aux rows (prefill staging, decode buffer); device memory for transports that need it

    def __init__(self, cfg: WorkerConfig, engine_factory: Callable[[], Any] | None = None) -> None:
        self.cfg = cfg
        self.engine_factory = engine_factory  # for in-process workers sharing a local fabric
        self.log = logging.getLogger(f"kvbridge.worker.{self.role}")
        self.specs, self.contract, self.aux_schema = self.build_geometry()
        self.pages = PageAllocator(cfg.pages)
        self.tasks: dict[int, Task] = {}
        self.counters: Counter[str] = Counter()
        self.draining = False
        self.shutdown_requested = False
        self.buffers: dict = {}
        self.engine: Any = None
        self.endpoint: Any = None
        self.ops_server: Any = None  # ops.OpsServer once started
        self.metrics = WorkerMetrics(self)

    # ---- lifetime ---------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Allocate, start the engine and endpoint, bind the ops channel; returns the ready record."""
        kind = engine_entry(self.cfg.engine).kind
        if kind == "in-process" and self.engine_factory is None:
            raise ConfigError(
                f"the {self.cfg.engine} engine moves bytes between regions of one process; a worker's peers are other "
                "processes: use --engine mooncake (the local engine is for tests and the in-process bench)",
                field="engine",
            )
        if kind == "same-host" and self.engine_factory is None and not (
                self.cfg.model and self.cfg.model_device.startswith("cuda")):
            raise ConfigError(
                f"the {self.cfg.engine} engine reaches GPU memory of other processes only, and this worker keeps its KV "
                "in host memory (synthetic KV, or --model-device cpu): use --engine auto (CUDA IPC where both sides are "
                "GPU memory on one host, Mooncake for the rest) or --engine mooncake",
                field="engine",
            )
        # ports first: a port in use is refused before memory is allocated or the rank registers
        self.ops_server = ops.OpsServer(self.cfg.host, self.cfg.ops_port, self.cfg.secret_bytes)
        metrics_url = self.metrics.serve(self.cfg.host, self.cfg.metrics_port) if self.cfg.metrics_port >= 0 else ""
        self.buffers = self.allocate_buffers()
        self.engine = (self.engine_factory or self._create_engine)()
        # the endpoint owns the rank's scratch region (registered, advertised): prefill proves the
        # rank's ownership there, and `kvbridge doctor` probes it
        self.endpoint = self.make_endpoint()
        self.endpoint.start()
        ready = {
            "role": self.role,
            "rank": self.cfg.rank_name,
            "pid": os.getpid(),
            "ops": self.ops_server.endpoint,
            "metrics": metrics_url,
            "session": self.engine.session_id,
            "pool_bytes": buffers_nbytes(self.buffers),
            **self.extra_ready(),
        }
        self.log.info("%s ready: %s", self.cfg.rank_name, ready)
        return ready

    def bootstrap_client(self) -> Any:
        """The rank's client of the daemon: its token and lease file (the endpoint names its scratch region)."""
        from kvbridge.bootstrap.client import BootstrapClient

        cfg = self.cfg
        return BootstrapClient(cfg.bootstrap, token=cfg.token or None, lease_file=cfg.lease_file or None,
                               lease_wait_s=2 * cfg.lease_ttl + 5)

    def _create_engine(self) -> Any:
        from kvbridge.transfer.engine import create_engine

        engine = create_engine(
            self.cfg.engine,
            host=self.cfg.host,
            protocol=self.cfg.protocol,
            device=self.cfg.device,
            max_slices_per_call=self.cfg.max_slices_per_call,
        )
        if self.cfg.chaos_failed_writes:  # testing: SIGUSR1 arms it (runtime.serve)
            from kvbridge.transfer.engine.faulty import FaultyEngine

            engine = FaultyEngine(engine, self.cfg.chaos_failed_writes)
        return engine

    def close(self) -> None:
        for name, closer in (("endpoint", self.endpoint), ("engine", self.engine), ("ops", self.ops_server),
                             ("metrics", self.metrics)):
            if closer is None:
                continue
            try:
                closer.close()
            except KVBridgeError as exc:  # keep closing the rest; the reason is logged
                self.log.warning("closing %s: %s", name, exc)

    def drain(self, timeout: float) -> None:
        """Refuse new rooms; let in-flight ones finish, abort what is left."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.tasks and time.monotonic() < deadline:
            self.step(0.02)
        for task in list(self.tasks.values()):
            self.abort(task, f"worker {self.cfg.rank_name} shutting down: room unfinished after {timeout:.1f}s drain")
        deadline = time.monotonic() + 5.0
        while self.tasks and time.monotonic() < deadline:
            self.step(0.02)
        for task in list(self.tasks.values()):
            self.finish(task, ops.RoomResult(task.room, False, "worker shut down before the room ended", self.cfg.rank_name))

    # ---- the loop ---------------------------------------------------------------------------
    def step(self, timeout: float) -> None:
        for peer, request_id, op in self.ops_server.receive(timeout):
            self.handle(peer, request_id, op)
        for task in list(self.tasks.values()):
            # a backstop: the endpoint's own deadlines (as long, counted from when it learnt of the room)
            # fire first and say more (which rank never asked, which pages are missing)
            if task.age > self.cfg.transfer_timeout + BACKSTOP_GRACE_S and not task.aborting:
                self.abort(task, f"room exceeded transfer_timeout {self.cfg.transfer_timeout:.1f}s on {self.cfg.rank_name}")
            try:
                result = self.advance(task)
            except KVBridgeError as exc:
                self.abort(task, str(exc))
                result = None
            if result is not None:
                self.finish(task, result)
        self.housekeeping()

    def reply(self, peer: bytes, request_id: int, msg: ops.Reply) -> None:
        """Answer an ops client; one that went away meanwhile (an idle client closed, a router
        restarted) loses its answer, and the worker goes on: the room's outcome is in its stats
        and logs either way."""
        try:
            self.ops_server.reply(peer, request_id, msg)
        except PeerLost as exc:
            self.counters["replies_lost"] += 1
            self.log.warning("the ops client of request %d is gone; its %s is dropped: %s", request_id,
                             type(msg).__name__, exc)

    def handle(self, peer: bytes, request_id: int, op: ops.Op) -> None:
        reply = self.reply
        if isinstance(op, ops.Stats):
            reply(peer, request_id, ops.StatsReply(self.stats()))
        elif isinstance(op, ops.Shutdown):
            self.shutdown_requested = True
            reply(peer, request_id, ops.Ack())
        elif not isinstance(op, self.room_op):
            reply(peer, request_id, ops.OpError(f"a {self.role} worker does not run {type(op).__name__} ops"))
        elif self.draining:
            reply(peer, request_id, ops.OpError(f"worker {self.cfg.rank_name} is shutting down; room {op.room} refused"))
        elif op.room in self.tasks:
            reply(peer, request_id, ops.OpError(f"room {op.room} is already running on {self.cfg.rank_name}"))
        elif op.num_tokens < 1:
            reply(peer, request_id, ops.OpError(f"room {op.room}: num_tokens must be >= 1"))
        else:
            try:
                self.tasks[op.room] = self.begin(peer, request_id, op)
            except KVBridgeError as exc:
                self.counters["rooms_failed"] += 1
                self.metrics.room_refused(str(exc))
                reply(peer, request_id, ops.RoomResult(op.room, False, str(exc), self.cfg.rank_name))

    def finish(self, task: Task, result: ops.RoomResult) -> None:
        self.tasks.pop(task.room, None)
        self.counters["rooms_ok" if result.ok else "rooms_failed"] += 1
        self.counters["bytes"] += result.num_bytes
        level = logging.DEBUG if result.ok else logging.WARNING
        self.log.log(level, "room %d %s %s", task.room, "ok" if result.ok else "FAILED", result.reason)
        self.metrics.room_finished(task, result)
        self.reply(task.peer, task.request_id, result)

    def stats(self) -> dict[str, Any]:
        return {
            "rank": self.cfg.rank_name,
            "role": self.role,
            "rooms_in_flight": len(self.tasks),
            "pages_free": self.pages.num_free,
            "pages_held": self.pages.num_held,
            "capacity_pages": self.pages.capacity,
            "draining": self.draining,
            **dict(self.counters),
        }

    # ---- what the pools are (model mode overrides both) ----------------------------------
    def build_geometry(self) -> tuple[dict, Any, Any]:
        """``(specs, contract, aux schema)`` of the preset."""
        cfg = self.cfg
        contract = build_contract(cfg.preset, cfg.layers, cfg.page_size, cfg.draft_layers, cfg.lane_rule)
        return build_specs(cfg.preset, cfg.layers, cfg.page_size, cfg.draft_layers), contract, aux_schema_of(contract)

    def allocate_buffers(self) -> dict:
        return allocate_buffers(self.specs, self.cfg.pages)

    # ---- per role ---------------------------------------------------------------------------
    def make_endpoint(self) -> Any:
        raise NotImplementedError

    def extra_ready(self) -> dict[str, Any]:
        return {}

    def begin(self, peer: bytes, request_id: int, op: Any) -> Task:
        raise NotImplementedError

    def advance(self, task: Any) -> ops.RoomResult | None:
        raise NotImplementedError

    def abort(self, task: Any, reason: str) -> None:
        raise NotImplementedError

    def housekeeping(self) -> None:
        pass

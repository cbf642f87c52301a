"""A whole PD deployment on loopback: bootstrap daemon, a CP prefill instance, a decode instance.

Used by ``kvbridge demo`` and the tests. Every process is separate, ports are
picked at runtime (workers report theirs through a ready file), and ``close``
(or leaving the ``with`` block) stops all of them.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.transfer.engine.registry import engine_entry
from kvbridge.worker import ops
from kvbridge.worker.inprocess import ThreadWorker
from kvbridge.worker.launch import HOST, Proc, ProcessGroup, kvbridge_argv, spawn_bootstrap, start_bootstrap

__all__ = ["Cluster", "ClusterSpec", "Worker", "spawn_bootstrap", "start_bootstrap"]


@dataclass(frozen=True)
class ClusterSpec:
    cp: int = 2
    decode_ranks: int = 1
    preset: str = "deepseek-v3.2-fp8"
    layers: int = 4
    draft_layers: int = 1
    page_size: int = 64
    pages: int = 512
    engine: str = "mooncake"
    prefill_instance: str = "demo-prefill"
    decode_instance: str = "demo-decode"
    drain_timeout: float = 10.0
    transfer_timeout: float = 60.0
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    extra_args: tuple[str, ...] = ()
    # model mode: a transformers model instead of a preset (see kvbridge.integrations.transformers)
    model: str = ""
    prefill_tp: int = 1  # prefill TP ranks per CP rank (each stores its KV heads)
    model_device: str = "cpu"
    decode_model_device: str = ""  # decode ranks' device, when not model_device
    nvlink: bool = False  # Mooncake's intra-node NVLink transport (protocol rdma + MC_INTRANODE_NVLINK)
    model_dtype: str = "float32"
    threads: int = 1
    exchange_dir: str = ""  # decode ranks' shared directory (head slices, tokens and logits)


@dataclass
class Worker:
    ready: dict[str, Any]
    client: ops.OpsClient
    proc: Proc | None = None  # a worker process, or
    thread: ThreadWorker | None = None  # a worker thread of this process (local engine)


class Cluster:
    def __init__(self, spec: ClusterSpec, workdir: str | Path | None = None) -> None:
        self.spec = spec
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="kvbridge-demo-")
        self.workdir = Path(workdir or self._tmp.name)
        env = {"KVBRIDGE_BOOTSTRAP_TOKEN": spec.token, "KVBRIDGE_SECRET": spec.secret}
        if spec.nvlink:
            env["MC_INTRANODE_NVLINK"] = "true"
        self.group = ProcessGroup(self.workdir, env=env)
        self.bootstrap_url = ""
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self._codes: dict[str, int | None] | None = None

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def common_args(self, role: str = "prefill") -> list[str]:
        s = self.spec
        device = s.decode_model_device if role == "decode" and s.decode_model_device else s.model_device
        model = ["--model", s.model, "--model-device", device, "--model-dtype", s.model_dtype,
                 "--threads", str(s.threads)] if s.model else []
        model += ["--protocol", "rdma"] if s.nvlink else []
        return [
            "--preset", s.preset, "--layers", str(s.layers), "--draft-layers", str(s.draft_layers),
            "--page-size", str(s.page_size), "--pages", str(s.pages), "--engine", s.engine,
            "--host", HOST, "--bootstrap", self.bootstrap_url, "--drain-timeout", str(s.drain_timeout),
            "--transfer-timeout", str(s.transfer_timeout), *model, *s.extra_args,
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> None:
        self.bootstrap_url = spawn_bootstrap(self.group, timeout)
        if engine_entry(self.spec.engine).kind == "in-process":  # the local engine: worker threads of this process
            self._start_threads(timeout)
        else:
            self._start_processes(timeout)

    def _start_processes(self, timeout: float) -> None:
        s = self.spec
        pending = []
        for cp_rank in range(s.cp):
            for tp_rank in range(s.prefill_tp):
                argv = kvbridge_argv(
                    "prefill-worker", "--instance", s.prefill_instance, "--cp-rank", str(cp_rank), "--cp-size",
                    str(s.cp), "--tp-rank", str(tp_rank), "--tp-size", str(s.prefill_tp), *self.common_args(),
                )  # fmt: skip
                name = f"prefill-cp{cp_rank}" + (f"-tp{tp_rank}" if s.prefill_tp > 1 else "")
                pending.append(("prefill", self.group.spawn(name, argv, ready_file=True)))
        exchange = ["--exchange-dir", s.exchange_dir] if s.model and s.exchange_dir else []
        for tp_rank in range(s.decode_ranks):
            argv = kvbridge_argv(
                "decode-worker", "--instance", s.decode_instance, "--tp-rank", str(tp_rank),
                "--tp-size", str(s.decode_ranks), *exchange, *self.common_args("decode"),
            )  # fmt: skip
            pending.append(("decode", self.group.spawn(f"decode-tp{tp_rank}", argv, ready_file=True)))
        deadline = time.monotonic() + timeout
        for role, proc in pending:
            ready = self.group.wait_ready(proc, max(1.0, deadline - time.monotonic()))
            worker = Worker(ready, ops.OpsClient(ready["ops"], secret=s.secret.encode()), proc=proc)
            (self.prefill if role == "prefill" else self.decode).append(worker)

    def _start_threads(self, timeout: float) -> None:
        """The local engine: every rank a thread of this process, one shared fabric."""
        from kvbridge.transfer.engine import LocalFabric, create_engine
        from kvbridge.worker.config import load_config
        from kvbridge.worker.decode import DecodeWorker
        from kvbridge.worker.prefill import PrefillWorker

        s, fabric = self.spec, LocalFabric()
        common = dict(
            preset=s.preset, layers=s.layers, draft_layers=s.draft_layers, page_size=s.page_size, pages=s.pages,
            engine="local", host=HOST, bootstrap=self.bootstrap_url, drain_timeout=s.drain_timeout,
            transfer_timeout=s.transfer_timeout, token=s.token, secret=s.secret,
        )  # fmt: skip
        ranks = [("prefill", PrefillWorker, dict(instance=s.prefill_instance, cp_rank=r, cp_size=s.cp)) for r in range(s.cp)]
        ranks += [("decode", DecodeWorker, dict(instance=s.decode_instance, tp_rank=r, tp_size=s.decode_ranks))
                  for r in range(s.decode_ranks)]  # fmt: skip
        for role, cls, identity in ranks:
            cfg = load_config(role, {**common, **identity}, environ={})
            thread = ThreadWorker(cls(cfg, lambda: create_engine("local", fabric=fabric)))
            ready = thread.start(timeout)
            worker = Worker(ready, ops.OpsClient(ready["ops"], secret=s.secret.encode()), thread=thread)
            (self.prefill if role == "prefill" else self.decode).append(worker)

    @property
    def workers(self) -> list[Worker]:
        return [*self.prefill, *self.decode]

    def submit_room(self, room: int, num_tokens: int, chunk_tokens: int = 0) -> list[tuple[Worker, int]]:
        """Start one room on every prefill and decode rank; returns the pending (worker, request id) pairs."""
        pending = [(w, w.client.submit(ops.Prefill(room, num_tokens, chunk_tokens))) for w in self.prefill]
        pending += [(w, w.client.submit(ops.Decode(room, num_tokens, self.spec.prefill_instance))) for w in self.decode]
        return pending

    def poll(self, timeout: float) -> None:
        """Collect replies from every worker (spends at most ``timeout`` seconds in total)."""
        per = timeout / max(1, len(self.workers))
        for w in self.workers:
            w.client.poll(per)

    def close(self, keep_logs: bool = False) -> dict[str, int | None]:
        """Stop every process (idempotent); the exit code of each. Logs stay when ``keep_logs``."""
        if self._codes is None:
            threads = {w.thread.name: w.thread.stop() for w in self.workers if w.thread is not None}
            for w in self.workers:
                w.client.close()
            self._codes = {**threads, **self.group.stop_all()}
        if self._tmp is not None and not keep_logs:
            self._tmp.cleanup()
            self._tmp = None
        return self._codes

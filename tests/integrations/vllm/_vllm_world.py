"""A prefill instance and a decode instance as vLLM runs them, minus the model: vLLM's
real ``Scheduler`` (each with the connector's scheduler side, built by vLLM's factory
from the ``--kv-transfer-config`` JSON), and worker ranks in processes of their own
(``_vllm_rank.py``) with vLLM's KV tensors, real Mooncake TCP transfers between them,
and a real bootstrap daemon. The test plays the model runner: each step it hands the
workers the scheduler's output, aggregates their connector outputs with vLLM's
``KVOutputAggregator`` and feeds the scheduler a ``ModelRunnerOutput``.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = str(Path(__file__).resolve().parent)
ROOT = str(Path(__file__).resolve().parents[3])
TOKEN = 7  # the token every forward pass samples


class RankFailed(RuntimeError):
    pass


@dataclass
class Worker:
    proc: Any
    conn: Any
    info: dict[str, Any] = field(default_factory=dict)

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise RankFailed(f"rank did not answer {cmd} within {timeout}s")
        kind, value = self.conn.recv()
        if kind == "raise":
            raise RankFailed(value)
        return value


# What every rank imports before it builds anything: loaded once into the fork server, so that a
# rank starts in a fork instead of a fresh interpreter importing vLLM and torch (about 20 s of CPU
# each on 2 cores). Nothing here starts a thread or touches a device at import.
PRELOAD = ["torch", "vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.v1.kv_cache_layout",
           "vllm.v1.worker.utils", "_vllm_config", "_vllm_rank", "kvbridge.integrations.vllm"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_ranks(cfgs: list[dict[str, Any]], timeout: float = 180.0) -> list[Any]:
    """Start one process per rank config (forked from a server that has imported vLLM: PRELOAD);
    each answers ("ready", info) or ("error", ...)."""
    ctx = _context()
    out = []
    for cfg in cfgs:
        parent, child = ctx.Pipe()
        import _vllm_rank

        proc = ctx.Process(target=_vllm_rank.main, args=(child, {**cfg, "paths": [HERE, ROOT]}), daemon=True)
        proc.start()
        out.append((proc, parent))
    answers = []
    deadline = time.monotonic() + timeout
    for proc, parent in out:
        if not parent.poll(max(1.0, deadline - time.monotonic())):
            raise RankFailed("a rank did not start in time")
        answers.append((proc, parent, parent.recv()))
    return answers


class Instance:
    """One vLLM engine: the real scheduler in this process, its workers in theirs."""

    def __init__(self, role: str, model: str, extra: dict[str, Any], *, tp: int, layout: str, block_size: int,
                 num_blocks: int, max_batched: int = 64, window: int = 0, mamba: bool = False) -> None:
        import _vllm_config as C
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.role, self.tp, self.block_size = role, tp, block_size
        self.window = window  # a gpt-oss-like hybrid under vLLM's hybrid manager (_vllm_config.vllm_config)
        self.mamba = mamba  # a Mamba2 hybrid the same way
        base = dict(model=model, role=role, extra=extra, block_size=block_size, tp=tp, layout=layout,
                    num_blocks=num_blocks, window=window, mamba=mamba)
        self.cfgs = [{**base, "tp_rank": r, "extra": {**extra, "tp_rank": r}} for r in range(tp)]
        self.vc = C.vllm_config(model, role, extra, block_size=block_size, tp=tp, layout=layout,
                                max_batched=max_batched, window=window, mamba=mamba)
        self.kvcc = C.kv_cache_config(self.vc, num_blocks)
        sizes = {"block_size": block_size}
        if mamba:  # the engine core's scheduling block: the LCM of the groups' (a Mamba block spans the model)
            from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

            sizes = dict(zip(("block_size", "hash_block_size"), resolve_kv_cache_block_sizes(self.kvcc, self.vc)))
        self.scheduler = Scheduler(self.vc, self.kvcc, StructuredOutputManager(self.vc), **sizes)
        self.aggregator = KVOutputAggregator(tp)
        self.workers: list[Worker] = []
        self.outputs: dict[str, Any] = {}  # request id -> its last EngineCoreOutput
        self.invalid_seen: set[int] = set()
        self.worker_stats: dict[str, int] = {}  # the workers' connector stats (KVBridgeStats), summed

    def attach(self, answers: list[tuple]) -> None:
        for proc, conn, (kind, *rest) in answers:
            if kind != "ready":
                raise RankFailed(f"{self.role} rank refused to start: {rest}")
            self.workers.append(Worker(proc, conn, rest[0]))

    # -- requests ------------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], params: dict[str, Any] | None, max_tokens: int = 1) -> Any:
        from vllm import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request
        from vllm.utils.hashing import sha256

        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.extra_args = {"kv_transfer_params": dict(params)} if params is not None else None
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(self.block_size, sha256))
        self.scheduler.add_request(req)
        return req

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def group_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """Every KV cache group's block table of the request (hybrid: a sliding window's skipped
        blocks are vLLM's null block)."""
        return tuple(list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(req_id))

    # -- one engine step ---------------------------------------------------------------------------

    def step(self, seeds: dict[str, int] | None = None) -> Any:
        """schedule -> every worker (forward writes for prefill, the connector's hooks) -> aggregate ->
        update_from_output. ``seeds``: request id -> the seed of its KV bytes (prefill)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        writes = []
        sampled: dict[str, list[int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            start = req.num_computed_tokens - n  # schedule() advanced it already
            if self.role == "kv_producer" and seeds and req_id in seeds:
                ids = self.group_block_ids(req_id) if self.window or self.mamba else self.block_ids(req_id)
                writes.append((ids, start, min(req.num_computed_tokens, req.num_prompt_tokens), seeds[req_id]))
            sampled[req_id] = [TOKEN] if req.num_computed_tokens >= req.num_tokens else []
        results = [w.call("step", so.kv_connector_metadata, set(so.finished_req_ids), writes) for w in self.workers]
        outs = []
        for r in results:
            kvo = KVConnectorOutput(finished_sending=r["sending"] or None, finished_recving=r["recving"] or None,
                                    failed_recving=r["failed"], invalid_block_ids=r["invalid"],
                                    kv_connector_worker_meta=r.get("worker_meta"))
            for k, v in (r.get("stats") or {}).items():  # the workers' connector stats, summed over the run
                self.worker_stats[k] = self.worker_stats.get(k, 0) + v
            self.invalid_seen |= r["invalid"]
            ids = list(sampled)
            outs.append(ModelRunnerOutput(req_ids=ids, req_id_to_index={k: i for i, k in enumerate(ids)},
                                          sampled_token_ids=[sampled[k] for k in ids], kv_connector_output=kvo))
        merged = self.aggregator.aggregate(outs)
        engine_outputs = self.scheduler.update_from_output(so, merged)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                self.outputs[o.request_id] = o
        return so

    def run_until(self, done: Any, seeds: dict[str, int] | None = None, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role}: condition not reached in {timeout}s")
            self.step(seeds)
            time.sleep(0.01)

    def shuffle_free_blocks(self, seed: int) -> None:
        """Take every free block and give them back in random order: vLLM's allocator then hands
        out scattered block ids (its free queue is the order blocks were freed)."""
        import random

        pool = self.scheduler.kv_cache_manager.block_pool
        blocks = pool.get_new_blocks(pool.get_num_free_blocks())
        random.Random(seed).shuffle(blocks)
        pool.free_blocks(blocks)

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def stop(self) -> None:
        for w in self.workers:
            try:
                w.call("stop", timeout=15.0)
            except (RankFailed, OSError, EOFError):
                pass
        for w in self.workers:
            w.proc.join(10.0)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5.0)
        self.workers = []


def instance_pair(model: str, daemon: tuple[str, str], *, peer_timeout: float, **geo: Any) -> tuple[Instance, Instance]:
    """A prefill and a decode ``Instance`` of ``model`` with the same geometry, decode pointed at
    the prefill instance through the daemon (``(url, token)``); their ranks not started yet."""
    import uuid

    url, token = daemon
    tag = uuid.uuid4().hex[:6]
    base = {"bootstrap_url": url, "bootstrap_token": token, "peer_timeout": peer_timeout}
    pre = Instance("kv_producer", model, {**base, "instance": f"p-{tag}"}, **geo)
    dec = Instance("kv_consumer", model, {**base, "instance": f"d-{tag}", "prefill_instance": f"p-{tag}"}, **geo)
    return pre, dec


def ensure_path() -> None:
    for p in (HERE, ROOT):
        if p not in sys.path:
            sys.path.insert(0, p)

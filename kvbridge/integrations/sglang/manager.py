"""``KVBridgeKVManager``: one per SGLang scheduler rank; owns the rank's kvbridge endpoint(s).

SGLang builds it in ``PrefillBootstrapQueue._init_kv_manager`` /
``DecodePreallocQueue._init_kv_manager`` with the rank's ``KVArgs``. Here the
translation happens once: ``KVArgs`` -> pools, buffers (``RawBuffer``) and aux
regions (``kvargs``), server arguments and ranks -> ``Settings``, both -> the
runtime contract.

    prefill   an endpoint when this rank sends (MLA: attention TP rank 0 of each CP rank, or
              each rank of a KV shard group; MHA/GQA: every attention TP rank, its heads),
              registered at the prefill's daemon as (dp, cp, tp, pp); the other TP ranks send
              nothing and report what their peers do. A pipeline stage (--pp-size > 1) is a
              kvbridge stage: its layers [prefill_start_layer, +its count), the whole model's
              contract; a stage but the last waits (DAEMON_WAIT_S) for the last stage's contract
              at the daemon, since only the last stage knows the model's layers from its KVArgs
    decode    one endpoint per bootstrap daemon, made on the first request toward it
              (``try_ensure_parallel_info``): a cluster daemon, or the daemon of each
              prefill instance; its contract takes the prefill instance's lane rule
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVManager
from sglang.srt.disaggregation.common.conn import PrefillServerInfo

from kvbridge import (
    BootstrapClient,
    BootstrapUnavailable,
    ConfigError,
    DecodeConfig,
    DecodeEndpoint,
    InstanceIncomplete,
    KVBridgeError,
    PrefillConfig,
    PrefillEndpoint,
    PrefillInfo,
    RawBuffer,
    RuntimeContract,
    UnknownInstance,
    create_engine,
    stage_specs,
)
from kvbridge.integrations.sglang.contract import rank_contract
from kvbridge.integrations.sglang.kvargs import (ModelLayers, SGLangCache, head_range, model_layers, read_kv_args,
                                                stage_layers, swa_full_layers)
from kvbridge.integrations.sglang.state_kinds import geometry_of
from kvbridge.integrations.sglang.version import sglang_version
from kvbridge.integrations.sglang.building import building_queue
from kvbridge.integrations.sglang import settings
from kvbridge.integrations.sglang.logs import route_logs
from kvbridge.integrations.sglang.metrics import Counters
from kvbridge.integrations.sglang.settings import Settings, model_weights, read_settings

log = logging.getLogger(__name__)

DAEMON_WAIT_S = 120.0  # the prefill daemon starts beside the scheduler (TokenizerManager): wait this long


class KVBridgeKVManager(BaseKVManager):
    """One SGLang rank's kvbridge side. ``endpoint`` (prefill) is None on a rank that sends
    nothing; decode endpoints come per daemon, see the module docstring."""

    supports_host_destination = False

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: Any = False) -> None:
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        role = getattr(disaggregation_mode, "value", disaggregation_mode)
        if role not in ("prefill", "decode"):
            raise ConfigError(f"disaggregation mode {role!r}: the kvbridge backend serves prefill or decode",
                              field="disaggregation_mode")
        self.settings: Settings = read_settings(role, server_args, self.is_mla_backend,
                                                gpu_id=int(getattr(args, "gpu_id", 0) or 0))
        s = self.settings
        route_logs(s.log_level or None)
        self.counters = Counters(role, shared=s.metrics)  # refusals and failures by reason (metrics.py)
        self._weights: str | None = None  # the contract's model.weights (settings.model_weights)
        queue = building_queue()
        cache = read_kv_args(args, is_mla=self.is_mla_backend, kv_checksum=s.kv_checksum, hidden_dtype=s.hidden_dtype,
                             geometry=geometry_of(queue))
        # the model's layer pattern (hybrid and V4 models; None: a dense model's, or not known)
        self.layers: ModelLayers | None = model_layers(args, queue)
        self.cache: SGLangCache = swa_full_layers(cache, queue, self.layers)
        self.page_size = self.cache.page_size
        # a pipeline stage's target layers [start, end) (prefill; None without pipeline parallelism)
        self.stage: tuple[int, int] | None = stage_layers(self.cache, args, self.layers) \
            if role == "prefill" and s.pp_size > 1 else None
        settings.refuse_checksum_of_partial_pages(s.kv_checksum, self.page_size)
        # what SGLang's schedulers read on a manager
        self.attn_cp_rank, self.attn_cp_size = s.cp_rank, s.cp_size
        self.enable_all_cp_ranks_for_transfer = False  # consulted only with host-tensor page indices
        self.is_dummy_cp_rank = role == "prefill" and s.lane_rule == "replicated" and s.cp_rank != 0
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        self.endpoint: PrefillEndpoint | None = None
        self._clients: dict[str, BootstrapClient] = {}
        self._endpoints: dict[str, DecodeEndpoint] = {}  # decode: per daemon URL
        self._instances: dict[str, tuple[str, str]] = {}  # decode: bootstrap address -> (daemon URL, instance)
        self._resolving: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._creating = threading.Lock()  # decode endpoints are made on pool threads
        self._engines: list[Any] = []  # one per endpoint, closed with it
        self.released = False  # SGLang released the KV memory (deregister_buffer_to_engine)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvb-sglang")
        atexit.register(self.close)
        if role == "prefill":
            try:
                self._start_prefill()
            except BaseException:  # a refused start-up leaves no client, engine or endpoint behind
                self.close()
                raise
        log.info("kvbridge %s rank %s ready (lane rule %s%s)", role, s.label, s.lane_rule,
                 "" if s.sends else ", sends nothing")

    # -- both roles ---------------------------------------------------------------------

    def register_to_bootstrap(self) -> None:
        """Registration happens when an endpoint starts (prefill: now; decode: per daemon)."""

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        return True

    def buffers(self, specs: Any = None) -> tuple[dict[tuple[str, int], RawBuffer], dict[str, RawBuffer]]:
        """This rank's pool buffers and aux regions as kvbridge takes them. A pipeline stage
        (``specs``: the whole model's) hands its own layers only: SGLang lists a draft pool on
        every stage on CUDA (its draft pool is not built per stage), but the draft layers are the
        last stage's to send (kvbridge's rule: they follow the last hidden state)."""
        keep = None
        if self.stage is not None and specs is not None:
            cut = stage_specs(specs, self.stage, self._num_target_layers(specs))
            keep = {(name, layer) for name, spec in cut.items() for layer in spec.layer_ids}
        kv = {(p.name, layer): b.raw(self.settings.kv_device) for p in self.cache.pools.values()
              for layer, b in zip(p.layer_ids, p.buffers) if keep is None or (p.name, layer) in keep}
        aux_device = "cpu"  # MetadataBuffers: host memory (decode refuses SGLang's NVLink pool, settings.py)
        return kv, {a.name: a.buffer.raw(aux_device) for a in self.cache.aux}

    def contract(self, lane_rule: str, num_kv_heads: int | None = None,
                 model: RuntimeContract | None = None) -> tuple[Any, Any, Any]:
        """``num_kv_heads``: the KV heads of the whole row of an MHA/GQA cache (its k/v pools are
        head-sharded over attention TP, at any TP size, so that prefill and decode of different TP
        sizes build the same contract); this rank's share follows from its TP rank (``head_range``).
        ``model``: on a pipeline stage but the last, the last stage's contract."""
        s = self.settings
        heads = None
        if num_kv_heads is not None and not self.cache.is_mla:
            heads = (num_kv_heads, *head_range(num_kv_heads, s.tp_size, s.tp_rank))
        if self._weights is None:  # once per rank, when its first contract is built
            self._weights = model_weights(s)
        return rank_contract(self.cache, s, lane_rule=lane_rule, kv_layout=getattr(self.kv_args, "kv_layout", None),
                             sglang_version=sglang_version(), heads=heads, stage=self.stage, model=model,
                             weights=self._weights, pattern=self.layers)

    def _staging_config(self) -> dict[str, Any]:
        """The staging keywords of this rank's endpoint config (``KVBRIDGE_STAGING*``): the rooms
        carry window, compressed and state pools on the staged path as on the direct one
        (docs/concepts.md, "Pool kinds in the rooms"), so every mode applies to them as given."""
        return self.settings.staging_config

    def _num_target_layers(self, specs: Any) -> int:
        if self.layers is not None:  # a hybrid or V4 model: its pools hold some of its layers each
            return self.layers.num_layers
        return specs["target" if self.cache.is_mla else "k"].num_layers

    @property
    def last_stage(self) -> bool:
        """Prefill: the last pipeline stage (or no pipeline parallelism)."""
        return self.settings.pp_rank == self.settings.pp_size - 1

    def _last_stage_contract(self, client: BootstrapClient, timeout: float) -> RuntimeContract:
        """A stage but the last: the model's contract, which the last stage registers (the stages
        start together; the last does not wait for the others, so this wait ends)."""
        s = self.settings
        deadline = time.monotonic() + timeout
        while True:
            for f in client.fingerprints():
                if f.instance == s.instance:
                    return f.contract
            if time.monotonic() > deadline:
                raise InstanceIncomplete(f"pipeline stage pp{s.pp_rank} of {s.pp_size} of prefill instance "
                                         f"{s.instance!r}: no stage registered the model's contract at "
                                         f"{s.daemon_url} within {timeout:.0f}s; the last stage pp{s.pp_size - 1} "
                                         "registers it (it alone knows the model's layers from SGLang's KVArgs)",
                                         field="pp_rank")  # fmt: skip
            time.sleep(0.1)

    def _prefill_kv_heads(self) -> int | None:
        """Prefill, MHA/GQA: the model's KV heads (SGLang's ``PrefillBootstrapQueue._init_kv_manager``
        sets ``total_kv_head_num``; without it, TP 1 sends whole rows). A prefill TP wider than the
        heads is refused: its replica ranks would send the same heads twice."""
        s = self.settings
        if self.cache.is_mla:
            return None
        total = int(getattr(self.kv_args, "total_kv_head_num", 0) or 0)
        if total < 1 and s.tp_size == 1:
            return None
        if total < 1:
            raise ConfigError("KVArgs.total_kv_head_num is not set: kvbridge needs the model's KV heads to send an "
                              "MHA/GQA cache over attention TP > 1", field="total_kv_head_num")
        if s.tp_size > total:
            raise ConfigError(f"prefill attention TP {s.tp_size} over {total} KV heads is not supported by kvbridge's "
                              "SGLang backend: its ranks hold replicas of the same heads, and kvbridge draws each head "
                              f"from one prefill rank; instead serve prefill with attention TP <= {total} (decode may "
                              "use any TP, heads are replicated there)", field="attn_tp_size")
        return total

    def _decode_kv_heads(self, client: BootstrapClient, instance: str) -> int | None:
        """Decode, MHA/GQA: the KV heads of the prefill instance's contract (SGLang's decode
        ``KVArgs`` does not carry them); None when that contract has whole rows (decode TP 1 only)."""
        if self.cache.is_mla:
            return None
        for f in client.fingerprints():
            if f.instance == instance:
                specs = {p.name: p.to_spec() for p in f.contract.pools}
                if "k" in specs and specs["k"].num_heads:
                    return specs["k"].num_heads
                if self.settings.tp_size == 1:
                    return None
                raise ConfigError(f"prefill instance {instance!r} sends whole k/v rows (no KV head count in its "
                                  f"contract); decode attention TP {self.settings.tp_size} needs head-sharded pools",
                                  field="pools.k.num_heads")  # fmt: skip
        raise UnknownInstance(f"prefill instance {instance!r} has no contract at the daemon", field="instance")

    def client(self, url: str) -> BootstrapClient:
        with self._lock:
            if url not in self._clients:
                self._clients[url] = BootstrapClient(url, token=self.settings.token or None)
            return self._clients[url]

    def engine(self) -> Any:
        s = self.settings
        engine = create_engine(s.engine, host=s.host, protocol=s.protocol, device=s.ib_device)
        with self._lock:
            self._engines.append(engine)
        return engine

    def close(self) -> None:
        """Stop the endpoints and deregister (process exit; SGLang never closes a manager)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stop_endpoints()
        for c in self._clients.values():
            c.close()
        self._clients = {}

    def _stop_endpoints(self) -> None:
        """Every endpoint stops (its rooms fail, its rank leaves the daemon, its memory is withdrawn
        from its engine), then the engines close; decode forgets the prefill instances it resolved."""
        with self._lock:
            endpoints = [*self._endpoints.values(), *([self.endpoint] if self.endpoint else [])]
            engines, self._engines = self._engines, []
            self._endpoints, self.endpoint = {}, None
            self._instances, self._resolving = {}, {}
            self.prefill_info_table.clear()
        for ep in endpoints:
            try:
                ep.close(timeout=2.0)
            except KVBridgeError as exc:
                log.warning("closing %s: %s", ep.config.rank_label, exc)
        for engine in engines:
            engine.close()

    # -- SGLang's release_memory_occupation / resume_memory_occupation ---------------------

    RELEASED = ("SGLang released this rank's KV memory (release_memory_occupation: memory saver or a weight "
                "update); its buffers are withdrawn from kvbridge's transfer engine until resume_memory_occupation")

    def deregister_buffer_to_engine(self) -> None:
        """SGLang calls this before it frees the KV pools. No registration may outlive the memory:
        every endpoint of this rank stops and its engine closes (rooms still open fail, naming the
        shutdown). Until ``register_buffer_to_engine``, a room on this rank is refused (``RELEASED``)."""
        with self._lock:
            if self.released:
                return
            self.released = True
        self._stop_endpoints()
        log.info("kvbridge %s rank %s: KV memory released, buffers withdrawn", self.settings.role, self.settings.label)

    def register_buffer_to_engine(self) -> None:
        """SGLang calls this once the KV pools are back (at the addresses in ``KVArgs``): prefill
        registers them again with a fresh engine and rejoins the daemon; decode makes its endpoints
        again as requests resolve their prefill instance."""
        with self._lock:
            if not self.released:
                return
            self.released = False
        if self.settings.role == "prefill":
            self._start_prefill()
        log.info("kvbridge %s rank %s: KV memory resumed, buffers registered", self.settings.role, self.settings.label)

    # -- prefill --------------------------------------------------------------------------

    def _start_prefill(self) -> None:
        s = self.settings
        heads = self._prefill_kv_heads()
        model = None
        if not self.last_stage:  # the model's layers come from the last stage (see the module docstring)
            if not s.sends:
                return
            client = self.client(s.daemon_url)
            _wait_for_daemon(client, s.daemon_url, DAEMON_WAIT_S)
            model = None if s.contract_path else self._last_stage_contract(client, DAEMON_WAIT_S)
        specs, schema, contract = self.contract(s.lane_rule, heads, model)
        if not s.sends:
            return
        client = self.client(s.daemon_url)
        _wait_for_daemon(client, s.daemon_url, DAEMON_WAIT_S)
        kv, aux = self.buffers(specs)
        cfg = PrefillConfig(instance=s.instance, dp_rank=s.dp_rank, cp_rank=s.cp_rank, dp_size=s.dp_size,
                            cp_size=s.cp_size, tp_rank=s.tp_rank, tp_size=s.tp_size, lane_rule=s.lane_rule,
                            pp_rank=s.pp_rank, pp_size=s.pp_size, pp_layers=self.stage, host=s.host, secret=s.secret,
                            lease_ttl=s.lease_ttl, target_timeout=s.bootstrap_timeout, peer_timeout=s.peer_timeout,
                            aux_slots=1, **self._staging_config())  # fmt: skip
        self.endpoint = PrefillEndpoint(cfg, self.engine(), specs, kv, contract, client, schema, aux_buffer=aux)
        self.endpoint.start()

    # -- decode: the prefill instance of a bootstrap address --------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode scheduler asks this (every second, a bounded number of times) before it
        resolves a request's prefill DP rank: True once the prefill instance at ``bootstrap_addr``
        is known and this rank has an endpoint at its daemon. The daemon is asked off the
        scheduler thread; the first calls start that and return False."""
        if self.released:
            return False  # nothing to resolve into: the receiver refuses the request (RELEASED)
        if bootstrap_addr in self.prefill_info_table:
            return True
        with self._lock:
            fut = self._resolving.get(bootstrap_addr)
            if fut is None:
                self._resolving[bootstrap_addr] = self._pool.submit(self._resolve, bootstrap_addr)
                return False
            if not fut.done():
                return False
            del self._resolving[bootstrap_addr]
        try:
            url, info = fut.result()
        except KVBridgeError as exc:
            log.warning("kvbridge decode rank %s: prefill at %s not ready: %s", self.settings.label, bootstrap_addr, exc)
            return False
        self._instances[bootstrap_addr] = (url, info.instance)
        # follow_bootstrap_room: kvbridge's look-up picks room % dp_size when no DP rank is given
        self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
            attn_tp_size=info.tp_size, attn_cp_size=info.cp_size, dp_size=info.dp_size, pp_size=info.pp_size,
            page_size=self.page_size, kv_cache_dtype=self.cache.kv_cache_dtype, follow_bootstrap_room=True)
        return True

    def _resolve(self, bootstrap_addr: str) -> tuple[str, PrefillInfo]:
        url, instance = self.settings.daemon_for(bootstrap_addr)
        info = PrefillInfo.lookup(self.client(url), instance)
        if not info.complete:
            raise InstanceIncomplete(f"prefill instance {info.instance!r} at {url}: not every rank registered yet",
                                     field="instance")
        self._decode_endpoint(url, info.lane_rule, self._decode_kv_heads(self.client(url), info.instance))
        return url, info

    def _decode_endpoint(self, url: str, lane_rule: str, num_kv_heads: int | None = None) -> DecodeEndpoint:
        """The endpoint at daemon ``url``; its contract takes the prefill instance's lane rule
        (decode has no CP mode of its own: the look-up tells it who owns which page)."""
        with self._creating:  # one endpoint per daemon, however many prefill instances resolve to it at once
            with self._lock:
                ep = self._endpoints.get(url)
            if ep is not None:
                return ep
            if self.released:  # a look-up that was under way when SGLang released the memory
                raise ConfigError(self.RELEASED, field="kv_memory")
            s = self.settings
            specs, schema, contract = self.contract(lane_rule, num_kv_heads)
            kv, aux = self.buffers()
            cfg = DecodeConfig(instance=s.instance, dp_rank=s.dp_rank, tp_rank=s.tp_rank, dp_size=s.dp_size,
                               tp_size=s.tp_size, host=s.host, secret=s.secret, bootstrap_timeout=s.bootstrap_timeout,
                               waiting_timeout=s.bootstrap_timeout, transfer_timeout=s.waiting_timeout,
                               peer_timeout=s.peer_timeout, lease_ttl=s.lease_ttl, **self._staging_config())  # fmt: skip
            ep = DecodeEndpoint(cfg, self.engine(), specs, kv, contract, self.client(url), aux, schema)
            ep.start()
            with self._lock:
                self._endpoints[url] = ep
            return ep

    def receiver_endpoint(self, bootstrap_addr: str) -> tuple[DecodeEndpoint, str] | None:
        """The endpoint and prefill instance of a bootstrap address, once resolved."""
        found = self._instances.get(bootstrap_addr)
        if found is None:
            return None
        url, instance = found
        with self._lock:
            ep = self._endpoints.get(url)
        return None if ep is None else (ep, instance)

    def submit_prefill_recompute(self, kv_receiver: Any, payload: Any) -> None:
        """PD retraction rebootstrap: not supported; the receiver fails, naming it."""
        kv_receiver.fail("PD retraction re-bootstrap (SGLang asks prefill to recompute a retracted request) is not "
                         "supported by kvbridge's backend: the request would need a second room on the same prefill "
                         "pages; instead give decode a retraction backup (--disaggregation-decode-retraction-backup "
                         "cpu_tensor or host_pool: a retracted request resumes from its own KV), or serve with "
                         "--disaggregation-transfer-backend mooncake")


def _wait_for_daemon(client: BootstrapClient, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.health()
            return
        except BootstrapUnavailable:
            if time.monotonic() > deadline:
                raise BootstrapUnavailable(f"no kvbridge bootstrap daemon at {url} after {timeout:.0f}s (the prefill "
                                           "server starts one on --disaggregation-bootstrap-port, or set "
                                           "KVBRIDGE_BOOTSTRAP_URL to a cluster daemon)", field="bootstrap") from None
            time.sleep(0.5)

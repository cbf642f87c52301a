"""``KVBridgeConnector``: vLLM's ``KVConnectorBase_V1`` on kvbridge, one facade over the
scheduler side (``scheduler.py``) and the worker side (``worker.py``); vLLM builds it
with the role it needs, in the process that needs it.

Every abstract method of the base is implemented; what kvbridge does not do is said
by name below (the base's defaults stand for the rest):

    supports HMA                  KVBridgeConnector: no, so vLLM turns the hybrid manager off (a sliding
                                  window is then allocated in full and moves as every token's pages;
                                  vLLM itself refuses Mamba hybrids without it). KVBridgeHMAConnector:
                                  yes (SupportsHMA, request_finished_all_groups): one full-attention
                                  group with its sliding-window groups, or with its Mamba groups
                                  (state pools, prefill one token short: on_new_request), move
                                  (hybrid.py); other groups are refused by kind (settings.refuse_hybrid)
    save_kv_layer                 prefill, layerwise (default): the layer of the prompts ending in this
                                  step goes out now; wait_for_save sends what is left (worker.py).
                                  It must run at every prefill step: with cudagraph_mode=FULL (prefill
                                  replayed as one graph) the connector says so at start (a warning):
                                  use PIECEWISE / FULL_AND_PIECEWISE, or layerwise=false
    wait_for_layer_load           nothing to wait: loads are asynchronous (WAITING_FOR_REMOTE_KVS)
    get_handshake_metadata        None: the bootstrap daemon pairs ranks, not vLLM's side channel
    kv_both                       refused (settings.py)

kvbridge's log records go through vLLM's logging configuration (``route_logs``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvbridge import ConfigError, cuda_graph_note
from kvbridge.integrations.vllm.amx import request_amx_state
from kvbridge.integrations.vllm.meta import KVBridgeMetadata
from kvbridge.integrations.vllm.scheduler import SchedulerSide
from kvbridge.integrations.vllm.settings import read_settings, refuse_hybrid
from kvbridge.integrations.vllm.stats import build_stats
from kvbridge.integrations.vllm.worker import WorkerSide

log = logging.getLogger(__name__)


class KVBridgeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_logs(os.environ.get("KVBRIDGE_LOG_LEVEL"))
        self.settings = read_settings(vllm_config)
        self.groups = refuse_hybrid(kv_cache_config) if kv_cache_config is not None else None
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(self.settings, vllm_config.cache_config.block_size, self.groups)
        else:
            if kv_cache_config is None:
                raise ConfigError("the worker side needs vLLM's KVCacheConfig (the number of blocks)",
                                  field="kv_cache_config")
            request_amx_state()  # a decode's first forward may be vLLM's AMX attention (amx.py)
            note = cuda_graph_note(self.settings.role == "prefill" and self.settings.layerwise is not False,
                                   str(getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", "")))
            if note:  # the per-layer hook must run at every prefill step (kvbridge.LayerPosts' docstring)
                log.warning("kvbridge: %s", note)
            mc = vllm_config.model_config
            self.worker_side = WorkerSide(self.settings, tp_rank=_tp_rank(self.settings),
                                          total_kv_heads=int(mc.get_total_num_kv_heads()), is_mla=bool(mc.use_mla),
                                          num_blocks=int(kv_cache_config.num_blocks), groups=self.groups,
                                          kv_cache_groups=kv_cache_config.kv_cache_groups)  # fmt: skip

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        self._scheduler.on_new_request(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.kv_cache_manager = kv_cache_manager

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_work

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Refusals, rooms sent, received and failed, by reason, since vLLM last asked (stats.py)."""
        side = self.scheduler_side if self.scheduler_side is not None else self.worker_side
        return None if side is None else side.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return build_stats(data)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads finish before the request is scheduled (asynchronous loading)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._worker.get_transfer_results(finished_req_ids)
        return sending or None, recving or None

    def build_connector_worker_meta(self) -> Any:
        """Prefill: the rooms that did not open or send this step (the scheduler answers them
        without a room, ``scheduler.py``)."""
        return self._worker.build_connector_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # -- helpers -------------------------------------------------------------------------------

    @property
    def _scheduler(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise ConfigError("a scheduler-side call on the worker side of KVBridgeConnector", field="role")
        return self.scheduler_side

    @property
    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise ConfigError("a worker-side call on the scheduler side of KVBridgeConnector", field="role")
        return self.worker_side

    def _meta(self) -> KVBridgeMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVBridgeMetadata) else None


class KVBridgeHMAConnector(KVBridgeConnector, SupportsHMA):
    """``KVBridgeConnector`` that keeps vLLM's hybrid KV cache manager on (``"kv_connector":
    "KVBridgeHMAConnector"``): vLLM then hands it every KV cache group, which
    ``settings.refuse_hybrid`` maps onto pool kinds at start-up: one full-attention group is the
    room's page mapping, each sliding-window group a window pool whose blocks of the last W tokens
    move, each Mamba group's conv and SSM state a state pool whose slot moves with the last chunk,
    prefill one token short (``hybrid.py``). vLLM calls
    ``request_finished_all_groups`` instead of ``request_finished``."""

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        groups = self._scheduler.groups
        want = 1 if groups is None else len(groups.names)
        if len(block_ids) != want:
            raise ConfigError(f"request {request.request_id}: blocks of {len(block_ids)} KV cache groups, the "
                              f"connector was built for {want}", field="kv_cache_config.kv_cache_groups")
        # every group's blocks are held or freed together (vLLM frees them all on finished_sending)
        return self._scheduler.request_finished(request, list(block_ids[0 if groups is None else groups.paged]))


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def route_logs(level: str | None) -> None:
    """kvbridge's records through vLLM's logging configuration: the ``kvbridge`` logger takes vLLM's
    handlers (its format: level, time, file and line; vLLM prefixes each process's lines with its
    name and pid) at ``level`` (``KVBRIDGE_LOG_LEVEL``), else vLLM's level (``VLLM_LOGGING_LEVEL``,
    INFO by default), so INFO lines show when asked. Without vLLM's handlers
    (``VLLM_CONFIGURE_LOGGING=0``) kvbridge's records go to the root logger the user configured."""
    if level is not None and level.upper() not in LOG_LEVELS:
        raise ConfigError(f"KVBRIDGE_LOG_LEVEL {level!r} is not one of {', '.join(LOG_LEVELS)}",
                          field="KVBRIDGE_LOG_LEVEL")
    ours, vllm_log = logging.getLogger("kvbridge"), logging.getLogger("vllm")
    if not vllm_log.handlers:
        return
    for handler in vllm_log.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.setLevel(level.upper() if level else vllm_log.getEffectiveLevel())
    ours.propagate = False


def _tp_rank(settings: Any) -> int:
    """vLLM's TP rank of this worker when its parallel state is up; else ``tp_rank`` from the
    extra config (external launchers, tests), else 0."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    return settings.tp_rank_override or 0

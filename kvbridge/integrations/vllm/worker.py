"""The connector's worker side: one per vLLM worker (one TP rank), owning its kvbridge
endpoint, and the rooms of its requests as ``KVSender`` / ``KVReceiver`` handles.

    register_kv_caches   vLLM's layer tensors -> pool, buffers, contract (``cache.py``); the
                         endpoint starts and registers at the daemon; decode with
                         ``prefill_instance`` set compares contracts now and refuses a mismatch
    save_kv_layer        prefill (``layerwise``, the default): as vLLM's forward pass writes layer
                         l, ``LayerPosts.layer_done(l)``: when l closes a layer group (at least
                         ``layer_group_bytes`` of the step's prompts, 8 MiB by default) a CUDA
                         event is recorded on the current stream and the poster thread sends
                         the group, sender.send(..., layers=group, ready_event=event), for each
                         request whose prompt ends in this step (its last SendChunk; rooms opened
                         at the step's first hook); vLLM's thread plans nothing, nothing waits on
                         the model's stream; a step with no such request (a decode step: the hook
                         fires then too) sends nothing
    wait_for_save        prefill: each SendChunk of the step -> sender.send (the step's forward
                         pass has written those pages); opens the room on its first chunk; a
                         last chunk sent layer by layer sends only what is left: any layer the
                         hook missed, then is_last with the aux row (and a page an earlier
                         chunk ended inside). Earlier chunks of a chunked prefill go here
                         whole, as their step ends (their pages are few next to the last one's
                         wait, and a page they end inside must wait for its rows anyway)
    start_load_kv        decode: each Receive -> receiver(room).init(pages, first_page=hit); each
                         ReleaseRoom -> receiver(room).release(binding=): prefill frees the room now
                         both: aborts
    build_connector_worker_meta
                         prefill: the requests whose room did not open or send this step, by
                         reason (the scheduler answers them without a room, decode computes them)
    get_transfer_results prefill: rooms final (Success or Failed) of requests vLLM finished ->
                         finished_sending (vLLM frees their blocks); decode: rooms Success, or
                         Failed once no write can land (hard rule 6) -> finished_recving, a
                         failed room's blocks -> get_block_ids_with_load_errors (vLLM fails the
                         request, or recomputes it under kv_load_failure_policy=recompute); with
                         hybrid groups (block ids are per group) the request -> failed_recving

Which ranks are kvbridge ranks:

    NHD GQA/MHA   every TP rank, its heads [h0, h1): kvbridge slices heads for a decode of
                  another TP size (p1 -> d2, p2 -> d1)
    HND           every TP rank pairs with the decode rank of the same TP rank: each is its own
                  kvbridge DP group (dp_rank = tp_rank), whole blocks, TP size in the contract
    MLA           prefill TP rank 0 sends (the latent is replicated), the other prefill ranks send
                  nothing and report their requests finished; every decode rank receives
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge import (
    BootstrapClient,
    ConfigError,
    ContractMismatch,
    DecodeConfig,
    DecodeEndpoint,
    KVBridgeError,
    KVPoll,
    LayerPosts,
    PrefillConfig,
    PrefillEndpoint,
    RoomInUse,
    RoomSend,
    create_engine,
    diff_contracts,
    layerwise_slower,
)
from kvbridge.integrations.vllm.cache import (AUX_SCHEMA, HND, SharedRegions, VLLMCache, layer_id, mamba_state_buffers,
                                              pool_spec, rank_contract, read_group_caches, read_kv_caches, window_spec)
from kvbridge.integrations.vllm.hybrid import GroupLayout, mamba_state_specs
from kvbridge.integrations.vllm.meta import KVBridgeMetadata, KVBridgeWorkerMeta, Receive, ReleaseRoom, SendChunk
from kvbridge.integrations.vllm.settings import Settings, model_weights
from kvbridge.integrations.vllm.stats import KVBridgeStats

log = logging.getLogger(__name__)

FINAL = (KVPoll.Success, KVPoll.Failed)
STATS_KEPT = 256


@dataclass
class _Recv:
    receive: Receive
    handle: Any = None
    aux_slot: int | None = None
    failure: str = ""  # set when the room failed, or could not be opened
    started: float = field(default_factory=time.monotonic)


class WorkerSide:
    def __init__(self, settings: Settings, *, tp_rank: int, total_kv_heads: int, is_mla: bool, num_blocks: int,
                 groups: GroupLayout | None = None, kv_cache_groups: Any = ()) -> None:
        self.settings = settings
        self.groups = groups  # hybrid manager: the paged group and the window groups (hybrid.py)
        self.kv_cache_groups = list(kv_cache_groups)  # vLLM's KVCacheGroupSpec list (their layer names)
        self.window_pools: tuple[str, ...] = ()  # hybrid: the window groups' pools
        # window pools are not sent by layer ranges; auto (None) may still turn it off once the engine is known
        self.layerwise = settings.layerwise is not False and groups is None
        self.tp_rank = tp_rank
        self.total_kv_heads = total_kv_heads
        self.is_mla = is_mla
        self.num_blocks = num_blocks
        self.is_prefill = settings.role == "prefill"
        self.label = settings.label(tp_rank)
        self.cache: VLLMCache | None = None
        self.endpoint: Any = None
        self.engine: Any = None
        self.client: BootstrapClient | None = None
        self.dp_rank = 0  # the kvbridge DP group of this rank (HND: its TP rank)
        self._senders: dict[str, Any] = {}  # prefill: req id -> KVSender
        self._finished: set[str] = set()  # prefill: requests vLLM finished, not yet reported
        self._sending_ids: set[str] = set()  # prefill ranks that send nothing: requests seen
        self._layers_sent: dict[str, set[int]] = {}  # prefill: req id -> layers its last chunk sent by save_kv_layer
        self._broken: set[str] = set()  # prefill: requests whose room failed on a send: nothing more is sent
        self._posts: LayerPosts | None = None  # prefill, layerwise: the poster thread of this rank's layer groups
        self._pass_meta: KVBridgeMetadata | None = None  # the step whose layers are being posted
        self._pass_rooms: dict[str, tuple[SendChunk, RoomSend]] = {}
        self._recvs: dict[str, _Recv] = {}
        self._releasing: dict[str, Any] = {}  # decode: req id -> the KVReceiver whose release is on its way
        self._refused: dict[str, str] = {}  # prefill: req id -> why its room failed this step (for the scheduler)
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # decode, hybrid groups: requests whose load failed (failed_recving)
        self._free_slots: list[int] = []
        self._aux: dict[str, np.ndarray] = {}
        # kvbridge's account of the last rooms (KVSender / KVReceiver .stats: bytes, slices, seconds,
        # paths direct/staged), request id -> stats, the newest STATS_KEPT
        self.room_stats: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.stats = KVBridgeStats()  # rooms sent, received and failed since vLLM last took them

    # -- start-up ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        s = self.settings
        windows, caches, state_bufs, whole = {}, {}, {}, []
        if self.groups is not None:  # hybrid: a pool per group, the paged one the room's page mapping
            if self.is_mla:
                raise ConfigError("MLA with hybrid KV cache groups is not moved by kvbridge's vLLM connector",
                                  field="kv_cache_config.kv_cache_groups")
            if s.staging == "always":
                raise ConfigError("staging 'always' with hybrid KV cache groups: the rooms carry window pools on the "
                                  "direct path only (set staging auto or never)", field="staging")
            g = self.groups
            mamba = {i for i, _ in g.states}
            attn = [i for i in range(len(self.kv_cache_groups)) if i not in mamba]
            caches = read_group_caches(kv_caches, [self.kv_cache_groups[i] for i in attn], [g.names[i] for i in attn],
                                       self.num_blocks, s.block_size)
            cache = caches[g.names[g.paged]]
            windows = {name: window_spec(caches[name], name, w) for _, name, w in g.windows}
            for i, _ in g.states:  # each Mamba group's states: state pools over vLLM's raw views (hybrid.py)
                group = self.kv_cache_groups[i]
                stride = int(kv_caches[group.layer_names[0]].stride(0))
                states = mamba_state_specs(group.kv_cache_spec, i, [layer_id(n) for n in group.layer_names],
                                           tp_size=s.tp_size, block_stride=stride)
                windows.update(states)
                state_bufs.update(mamba_state_buffers(kv_caches, group, i, self.num_blocks, states))
                whole.extend((int(kv_caches[n].data_ptr()), self.num_blocks * stride) for n in group.layer_names)
            self.window_pools = tuple(n for n, p in windows.items() if p.kind == "window")
        else:
            cache = read_kv_caches(kv_caches, self.num_blocks, s.block_size, self.is_mla)
        self.cache = cache
        if cache.layout == HND:  # each TP rank is a DP group of its own (module docstring)
            self.dp_rank, tp_size, tp_rank, dp_size = self.tp_rank, 1, 0, s.tp_size
        else:
            tp_size, tp_rank, dp_size = s.tp_size, self.tp_rank, 1
        if self.is_prefill and cache.layout != HND and not self.is_mla and s.tp_size > self.total_kv_heads:
            raise ConfigError(f"prefill TP {s.tp_size} over {self.total_kv_heads} KV heads: its ranks hold replicas "
                              "of the same heads and kvbridge draws each head from one prefill rank; serve prefill "
                              f"with TP <= {self.total_kv_heads} (decode may use any TP)", field="tensor_parallel_size")
        spec = pool_spec(cache, self.total_kv_heads, tp_size if cache.layout != HND else 1, tp_rank)
        contract = rank_contract(cache, spec, model_name=s.model_name, revision=s.revision, tp_size=s.tp_size,
                                 vllm_version=s.vllm_version, weights=model_weights(s), windows=windows)
        if self.is_prefill and self.is_mla:
            tp_size, tp_rank = 1, 0
            if self.tp_rank != 0:
                log.info("kvbridge prefill %s: MLA latent is replicated, TP rank 0 sends; this rank sends nothing",
                         self.label)
                return
        self.client = BootstrapClient(s.daemon_url, token=s.token or None)
        self.engine = create_engine(s.engine, host=s.host, protocol=s.protocol, device=s.device or None)
        specs, buffers = {spec.name: spec, **windows}, cache.buffers()
        for name in windows:
            if name in caches:
                buffers.update(caches[name].buffers())
        buffers.update(state_bufs)
        # hybrid: one tensor backs a layer of each group, registered once (cache.SharedRegions); a Mamba
        # layer's states are regions inside its view, registered whole first
        engine = SharedRegions(self.engine, s.engine) if windows else self.engine
        for ptr, nbytes in whole:
            engine.register(ptr, nbytes)
        staging = {**s.staging_config, "staging": "never"} if windows else s.staging_config
        try:
            if not self.is_prefill and s.prefill_instance:  # on the engine's transport, as prefill registered it
                self._check_prefill_contract(contract.with_transport(self.engine.transport))
            if self.is_prefill:
                cfg = PrefillConfig(instance=s.instance, dp_rank=self.dp_rank, dp_size=dp_size, tp_rank=tp_rank,
                                    tp_size=tp_size, host=s.host, secret=s.secret, lease_ttl=s.lease_ttl,
                                    target_timeout=s.target_timeout, peer_timeout=s.peer_timeout, trace=s.trace,
                                    **staging)  # fmt: skip
                self.endpoint = PrefillEndpoint(cfg, engine, specs, buffers, contract, self.client, AUX_SCHEMA)
            else:
                slots = max(1, s.aux_slots)
                self._aux = {"room": np.zeros((slots, 1), dtype=np.uint64)}
                self._free_slots = list(range(slots - 1, -1, -1))
                cfg = DecodeConfig(instance=s.instance, dp_rank=self.dp_rank, dp_size=dp_size, tp_rank=tp_rank,
                                   tp_size=tp_size, host=s.host, secret=s.secret, lease_ttl=s.lease_ttl,
                                   transfer_timeout=s.transfer_timeout, peer_timeout=s.peer_timeout, trace=s.trace,
                                   lease_quarantine=s.lease_quarantine,
                                   **staging)  # fmt: skip
                self.endpoint = DecodeEndpoint(cfg, engine, specs, buffers, contract, self.client, self._aux,
                                               AUX_SCHEMA)
            self.endpoint.start()
            if self.is_prefill and self.layerwise:
                self._check_layerwise(cache.layers[0].device)
            self._posts = self._layer_posts(cache) if self.is_prefill and self.layerwise else None
        except BaseException:
            self.shutdown()
            raise
        log.info("kvbridge %s %s ready: %s, %d layers, %s blocks of %d tokens, pool %s (%d B/token)%s", s.role,
                 self.label, cache.layout, len(cache.layers), cache.num_blocks, cache.block_size, spec.name,
                 spec.bytes_per_token, "".join(f", window pool {n} (W {w.window}, layers {list(w.layer_ids)})"
                                               for n, w in windows.items()))

    def _check_prefill_contract(self, contract: Any) -> None:
        """Decode with ``prefill_instance``: the prefill instance's contract, compared before the
        first request; a difference is refused naming every field (hard rule 7)."""
        s = self.settings
        deadline = time.monotonic() + s.prefill_wait_s
        while True:
            found = [f for f in self.client.fingerprints() if f.instance == s.prefill_instance and f.role == "prefill"]
            if found:
                break
            if time.monotonic() >= deadline:
                raise ConfigError(f"prefill instance {s.prefill_instance!r} is not registered at {s.daemon_url} "
                                  f"after {s.prefill_wait_s:.0f}s (start prefill first, or unset prefill_instance to "
                                  "check contracts at each request)", rank=self.label, field="prefill_instance")
            time.sleep(0.2)
        diff = diff_contracts(found[0].contract, contract)
        if diff:
            fields = ", ".join(f"{d.path}: prefill {d.prefill!r} != decode {d.decode!r}" for d in diff[:6])
            raise ContractMismatch(f"decode {self.label} does not match prefill instance {s.prefill_instance!r}: "
                                   f"{fields} (field by field: {s.daemon_url}/diagnostics)", diff=diff,
                                   rank=self.label, field=diff[0].path)

    # -- prefill ----------------------------------------------------------------------------

    def _check_layerwise(self, device: str) -> None:
        """``layerwise`` auto: off where layer-wise measured slower than whole rooms on this rank's
        engine (``layerwise_slower``), logged; true: kept, with a warning saying so."""
        slower = layerwise_slower(self.engine, device)
        if slower is None:
            return
        if self.settings.layerwise is None:
            self.layerwise = False
            log.info("kvbridge prefill %s: layerwise auto sends whole rooms: %s", self.label, slower)
        else:
            log.warning("kvbridge prefill %s: layerwise=true kept although %s", self.label, slower)

    def _layer_posts(self, cache: VLLMCache) -> LayerPosts | None:
        """The rank's ``LayerPosts`` when its layer ids are 0..n-1 (what layer groups count), else
        None: each layer is then sent from vLLM's thread as it is written (``_save_layer_alone``)."""
        ids = sorted(b.layer_id for b in cache.layers)
        if ids != list(range(len(ids))):
            log.info("kvbridge prefill %s: layer ids %s..%s are not 0..n-1: layers are sent one by one from the "
                     "forward's thread", self.label, ids[0], ids[-1])
            return None
        return LayerPosts(len(ids), cache.block_bytes, device=cache.layers[0].device,
                          min_bytes=self.settings.layer_group_bytes, min_pass_bytes=self.settings.layer_pass_bytes)

    def save_kv_layer(self, layer_name: str, meta: KVBridgeMetadata | None) -> None:
        """Layer ``layer_name`` of this step is written: when it closes a layer group, that group is
        sent for the requests whose prompt ends in this step, by ``LayerPosts``' poster thread after
        a CUDA event recorded now on the current stream (behind the layer's kernels): this thread
        plans nothing and waits for nothing, and nothing synchronises the model's stream."""
        if not self.is_prefill or not self.layerwise or meta is None or self.endpoint is None:
            return
        if self._posts is None:
            self._save_layer_alone(layer_name, meta)
            return
        if meta is not self._pass_meta:
            self._begin_pass(meta)
        if not self._pass_rooms:  # a decode step, or only earlier chunks of chunked prefills: nothing per layer
            return
        try:
            layer = self.cache.layer_of(layer_name)
        except ConfigError:  # not a layer registered with kvbridge: wait_for_save sends what no hook did
            return
        self._posts.layer_done(layer)

    def _begin_pass(self, meta: KVBridgeMetadata) -> None:
        """The step's first hook: its prompts' last chunks become the pass's rooms (opened now)."""
        self._end_pass()
        self._pass_meta = meta
        for c in meta.sends:
            if not c.is_last or c.req_id in self._broken:
                continue
            sender = self._sender(c)
            if sender is None:
                continue
            logical, local = self._pages(c)
            if logical.size:  # no pages: wait_for_save sends the end alone
                self._pass_rooms[c.req_id] = (c, RoomSend(sender, logical, local, self._tokens(c.num_tokens)))
        if self._pass_rooms:
            pages = sum(r.logical.size for _, r in self._pass_rooms.values())
            self._posts.begin([r for _, r in self._pass_rooms.values()], layer_bytes=pages * self.cache.block_bytes)

    def _end_pass(self) -> None:
        """Every group of the pass handed to its sender: each room's layers sent are what
        ``_send_rest`` completes; a room whose send failed is failed."""
        rooms, self._pass_rooms, self._pass_meta = self._pass_rooms, {}, None
        if not rooms:
            return
        self._posts.finish(raise_first=False)
        for req_id, (c, r) in rooms.items():
            if r.error is not None:
                self._failed(c, r.sender, r.error)
            else:
                self._layers_sent[req_id] = {layer for start, end in r.sent for layer in range(start, end)}

    def _save_layer_alone(self, layer_name: str, meta: KVBridgeMetadata) -> None:
        """Without ``LayerPosts``: layer ``layer_name`` sent now, from this thread, after an event."""
        last = [c for c in meta.sends if c.is_last]
        if not last:  # a decode step, or only earlier chunks of chunked prefills: nothing per layer
            return
        try:
            layer = self.cache.layer_of(layer_name)
        except ConfigError:  # not a layer registered with kvbridge: wait_for_save sends what no hook did
            return
        ready = self._ready_event()
        for c in last:
            if c.req_id in self._broken:
                continue
            sent = self._layers_sent.setdefault(c.req_id, set())
            if layer in sent:
                continue
            sender = self._sender(c)
            if sender is None:
                continue
            try:
                logical, local = self._pages(c)
                if logical.size:
                    sender.send(logical, local, num_tokens_ready=self._tokens(c.num_tokens), layers=(layer, layer + 1),
                                ready_event=ready)
                sent.add(layer)
            except KVBridgeError as exc:
                self._failed(c, sender, exc)

    def wait_for_save(self, meta: KVBridgeMetadata | None) -> None:
        if self._pass_rooms:
            self._end_pass()
        self._pass_meta = None
        if not self.is_prefill or meta is None or not meta.sends:
            return
        ready = self._ready_event()
        for chunk in meta.sends:
            if chunk.req_id in self._broken:
                continue
            sent = self._layers_sent.pop(chunk.req_id, None) if chunk.is_last else None
            if sent:
                self._send_rest(chunk, sent, ready)
            else:
                self._send(chunk, ready)

    def _send_rest(self, c: SendChunk, sent: set[int], ready_event: Any) -> None:
        """A last chunk whose layers went out layer by layer: the layers no hook sent, then the end."""
        sender = self._senders.get(c.req_id)
        if sender is None:  # opening it failed in the hook: reported finished already
            return
        try:
            missing = sorted({b.layer_id for b in self.cache.layers} - sent)
            logical, local = self._pages(c)
            for start, end in _runs(missing):
                sender.send(logical, local, num_tokens_ready=self._tokens(c.num_tokens), layers=(start, end),
                            ready_event=ready_event)
            empty = np.zeros(0, dtype=np.int64)
            aux = {} if sender.writes_aux else None
            sender.send(empty, empty, num_tokens_ready=self._tokens(c.num_tokens), is_last=True, aux=aux,
                        ready_event=ready_event)
        except KVBridgeError as exc:
            self._failed(c, sender, exc)

    def _ready_event(self) -> Any:
        """GPU caches: an event after the step's forward pass on the current stream; kvbridge
        reads no byte of the chunk before it completes (the forward may still be queued)."""
        if self.cache is None or self.cache.layers[0].device == "cpu":
            return None
        import torch

        event = torch.cuda.Event()
        event.record()
        return event

    def _send(self, c: SendChunk, ready_event: Any = None) -> None:
        if self.endpoint is None:
            self._sending_ids.add(c.req_id)
            return
        sender = self._sender(c)
        if sender is None:
            return
        try:
            logical, local = self._pages(c)
            ready = self._tokens(c.num_tokens) if c.is_last else c.tokens_ready
            aux = {} if c.is_last and sender.writes_aux else None
            units = {name: np.asarray(ids, dtype=np.int64) for name, ids in c.windows} if c.windows else None
            sender.send(logical, local, num_tokens_ready=ready, is_last=c.is_last, aux=aux, ready_event=ready_event,
                        kind_units=units)
        except KVBridgeError as exc:
            self._failed(c, sender, exc)

    def _sender(self, c: SendChunk) -> Any:
        """The request's KVSender, opened and initialised on its first chunk (None: that failed)."""
        sender = self._senders.get(c.req_id)
        if sender is None:
            try:
                sender = self.endpoint.sender(c.room)
                later = {name: None for name in self.window_pools}  # their blocks come with the last chunk
                later.update((name, np.asarray(ids, dtype=np.int64)) for name, ids in c.windows
                             if name not in later)  # a Mamba group's state slots: from the first chunk
                sender.init(self._tokens(c.num_tokens), binding=c.binding, kind_units=later or None)
            except KVBridgeError as exc:
                self._failed(c, sender, exc)
                return None
            self._senders[c.req_id] = sender
        return sender

    @staticmethod
    def _pages(c: SendChunk) -> tuple[np.ndarray, np.ndarray]:
        return (np.arange(c.first_page, c.first_page + len(c.block_ids), dtype=np.int64),
                np.asarray(c.block_ids, dtype=np.int64))

    def _failed(self, c: SendChunk, sender: Any, exc: KVBridgeError) -> None:
        self.stats.count("send_failed")
        self._refused.setdefault(c.req_id, "room_in_use" if isinstance(exc, RoomInUse) else
                                 "open_failed" if c.req_id not in self._senders else "send_failed")
        log.warning("kvbridge prefill %s: room %d of request %s failed: %s", self.label, c.room, c.req_id, exc)
        self._layers_sent.pop(c.req_id, None)
        self._broken.add(c.req_id)
        if sender is not None:
            sender.abort(str(exc))
            self._senders.setdefault(c.req_id, sender)
        else:
            self._sending_ids.add(c.req_id)  # no room: reported finished as soon as vLLM finishes it

    def _tokens(self, n: int) -> int:
        """HND moves whole blocks: the prompt rounded up to them (cache.py)."""
        bs = self.settings.block_size
        return -(-n // bs) * bs if self.cache is not None and self.cache.whole_blocks else n

    # -- decode -----------------------------------------------------------------------------

    def start_load_kv(self, meta: KVBridgeMetadata | None) -> None:
        if meta is None:
            return
        for req_id in meta.aborts:
            self._abort(req_id)
        if self.is_prefill:
            return
        for r in meta.receives:
            self._receive(r)
        for rel in meta.releases:
            self._release_room(rel)

    def _release_room(self, rel: ReleaseRoom) -> None:
        """Tell the room's prefill ranks (those this rank would have asked) that it is not needed."""
        if self.endpoint is None or rel.req_id in self._releasing:
            return
        try:
            handle = self.endpoint.receiver(rel.room, rel.prefill_instance, self.dp_rank)
            handle.release(binding=rel.binding, reason=f"request {rel.req_id}: {rel.reason}")
        except KVBridgeError as exc:
            self.stats.count("release_failed")
            log.warning("kvbridge decode %s: request %s: room %d not released: %s", self.label, rel.req_id, rel.room,
                        exc)
            return
        self._releasing[rel.req_id] = handle

    def _released(self) -> None:
        """Close the releases that went out (or failed: the prefill rank's timeout frees the room then)."""
        for req_id, handle in list(self._releasing.items()):
            state = handle.poll()
            if state not in FINAL:
                continue
            if state == KVPoll.Success:
                self.stats.count("rooms_released")
            else:
                self.stats.count("release_failed")
                log.warning("kvbridge decode %s: request %s: room %d not released: %s", self.label, req_id,
                            handle.room, handle.failure_reason)
            handle.close()
            del self._releasing[req_id]

    def build_connector_worker_meta(self) -> KVBridgeWorkerMeta | None:
        """Prefill: the rooms that did not open or send since the last step, for the scheduler."""
        if not self._refused:
            return None
        out, self._refused = KVBridgeWorkerMeta(refused=self._refused), {}
        return out

    def _receive(self, r: Receive) -> None:
        rec = self._recvs[r.req_id] = _Recv(r)
        if r.error:
            rec.failure = r.error
            return
        if self.endpoint is None:
            rec.failure = "kvbridge decode endpoint not started (register_kv_caches was not called)"
            return
        if not self._free_slots:
            rec.failure = f"all {len(self._aux['room'])} aux slots in use (raise kv_connector_extra_config.aux_slots)"
            return
        rec.aux_slot = self._free_slots.pop()
        try:
            rec.handle = self.endpoint.receiver(r.room, r.prefill_instance, self.dp_rank)
            units = {name: np.asarray(ids, dtype=np.int64) for name, ids in r.windows} if r.windows else None
            rec.handle.init(np.asarray(r.block_ids, dtype=np.int64), rec.aux_slot, r.num_tokens or None,
                            first_page=r.first_page, binding=r.binding, kind_units=units)
        except KVBridgeError as exc:
            rec.failure = str(exc)
            if rec.handle is not None:
                rec.handle.abort(str(exc))

    def _abort(self, req_id: str) -> None:
        sender = self._senders.get(req_id)
        if sender is not None:
            sender.abort(f"request {req_id} aborted by vLLM")
            self._finished.add(req_id)
        rec = self._recvs.get(req_id)
        if rec is not None and rec.handle is not None:
            rec.handle.abort(f"request {req_id} aborted by vLLM")

    # -- both: what is done -------------------------------------------------------------------

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` of this step."""
        if self.is_prefill:
            return self._finished_sending(finished_req_ids), set(), set()
        self._released()
        recving = self._finished_recving()
        failed, self._failed_loads = self._failed_loads, set()
        return set(), recving, failed

    def _finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        self._finished.update(finished_req_ids)
        done = set()
        for req_id in list(self._finished):
            if req_id in self._sending_ids:
                self._sending_ids.discard(req_id)
                self._broken.discard(req_id)
                self._finished.discard(req_id)
                done.add(req_id)
                continue
            sender = self._senders.get(req_id)
            if sender is None:
                self._finished.discard(req_id)  # not ours (vLLM passes every finished request)
                continue
            state = sender.poll()
            if state not in FINAL:
                continue
            if state == KVPoll.Failed:
                if req_id not in self._broken:  # a failure _failed() did not count
                    self.stats.count("send_failed")
                log.warning("kvbridge prefill %s: request %s: %s", self.label, req_id, sender.failure_reason)
            else:
                self.stats.count("rooms_released" if sender.stats.get("released") else "rooms_sent")
            self._keep_stats(req_id, sender.stats)
            if state != KVPoll.Failed and self.settings.trace:
                log.info("kvbridge prefill %s: request %s sent: %s", self.label, req_id, _stats_line(sender.stats))
            sender.close()
            del self._senders[req_id]
            self._broken.discard(req_id)
            self._finished.discard(req_id)
            done.add(req_id)
        return done

    def _finished_recving(self) -> set[str]:
        done = set()
        for req_id, rec in list(self._recvs.items()):
            if rec.handle is not None and not rec.failure:
                state = rec.handle.poll()
                if state == KVPoll.Success:
                    self.stats.count("rooms_received")
                    self._keep_stats(req_id, rec.handle.stats)
                    if self.settings.trace:
                        log.info("kvbridge decode %s: request %s received: %s", self.label, req_id,
                                 _stats_line(rec.handle.stats))
                    self._release(req_id, rec)
                    done.add(req_id)
                    continue
                if state != KVPoll.Failed:
                    continue
                rec.failure = rec.handle.failure_reason or "room failed"
            if rec.handle is not None and not rec.handle.pages_releasable:
                continue  # a write may still land in these blocks (hard rule 6)
            self.stats.count("load_failed")
            log.warning("kvbridge decode %s: request %s (room %d): KV load failed: %s", self.label, req_id,
                        rec.receive.room, rec.failure)
            if self.groups is not None:  # block ids are per group: vLLM takes the request (failed_recving)
                self._failed_loads.add(req_id)
            else:
                self._load_errors.update(rec.receive.block_ids)
            self._release(req_id, rec)
            done.add(req_id)
        return done

    def _keep_stats(self, req_id: str, stats: dict[str, Any]) -> None:
        self.room_stats[req_id] = dict(stats)
        while len(self.room_stats) > STATS_KEPT:
            self.room_stats.popitem(last=False)

    def _release(self, req_id: str, rec: _Recv) -> None:
        if rec.handle is not None:
            rec.handle.close()
        if rec.aux_slot is not None:
            self._free_slots.append(rec.aux_slot)
        del self._recvs[req_id]

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self._posts is not None:
            self._posts.close()
            self._posts = None
        for sender in self._senders.values():
            sender.close()
        for rec in self._recvs.values():
            if rec.handle is not None:
                rec.handle.close()
        for handle in self._releasing.values():
            handle.close()
        self._senders, self._recvs, self._releasing = {}, {}, {}
        if self.endpoint is not None:
            try:
                self.endpoint.close(timeout=2.0)
            except KVBridgeError as exc:
                log.warning("closing kvbridge %s: %s", self.label, exc)
            self.endpoint = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.client is not None:
            self.client.close()
            self.client = None


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Ascending ids as ``[start, end)`` runs: 0 1 2 5 -> (0, 3), (5, 6)."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _stats_line(stats: dict[str, Any]) -> str:
    keys = ("bytes", "slices", "transfer_s", "total_s", "paths")
    return " ".join(f"{k}={stats[k]}" for k in keys if k in stats)

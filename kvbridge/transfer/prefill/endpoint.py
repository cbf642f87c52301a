"""PrefillEndpoint: one prefill rank's shell around its rooms' state machine.

The shell (``transfer/shell.py``: the loop, the lock, the event queue) owns what the
machine (``prefill/machine.py``) must not: the control server, the transfer engine, one
thread that reads decode ranks' registrations from the daemon, the aux rows and the pages
in memory, and the lease. It feeds the machine events and carries out the actions it
returns (``Send``, ``SendDigested``, ``PostWrite``, ``PostChunk``, ``Resolve``,
``ReleaseAux``, ``FreeRoom``). The loop reads like ``step()``:

    receive control messages -> feed each  ->  feed queued events (registrations read,
    writes refused at submission)  ->  collect completions (write_final)  ->  tick(now)

Fewest hops: a request is parsed, checked, planned and posted in the loop turn that
receives it; ``send()`` posts from the engine's thread when the request is already
here. The machine's one door is ``feed(event)`` (``prefill/events.py``); an engine's result is
an event record, never a call into the machine from inside a post: a write refused inside
``submit_write`` is queued (``PostFailed``) and fed once the current actions are carried out;
the completion callback (``EndpointShell._engine_final``) collects and reports from its own
thread only when the lock is free (no loop turn), and otherwise wakes the loop, which collects:

    decode init() --request--> loop: check, plan, post --engine--> callback: collect, report
                                                     (lock held: the loop's next turn) --> decode

Threads: the loop, the engine's own, the bootstrap lease keeper and the registration
reader; never one per room.
"""

from __future__ import annotations

import base64
import logging
import os
import queue
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

import numpy as np

from kvbridge.bootstrap.client import BootstrapClient, LeaseKeeper
from kvbridge.bootstrap.contract import RuntimeContract, fingerprint
from kvbridge.errors import (ConfigError, KVBridgeError, LayoutError, RoomEnded, TransferError,
                             UnknownInstance)
from kvbridge.layout import AuxSchema, OwnerLanes, PoolSpec, stage_specs
from kvbridge.transfer.actions import AbortRoom, FreeRoom, Send, Shutdown, Tick
from kvbridge.transfer.aux_rows import AuxBuffers, AuxStaging
from kvbridge.transfer.channel import ControlServer
from kvbridge.transfer.channel.transport import Limits
from kvbridge.transfer.checks import check_against_contract
from kvbridge.transfer.digest import kind_unit_digests, page_digests
from kvbridge.transfer.engine import TransferEngine, WriteState
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.engine.registry import entry_of, route_key
from kvbridge.transfer.prefill.config import PrefillConfig
from kvbridge.transfer.prefill.admission import NonceWritten, ReadProof, WriteNonce
from kvbridge.transfer.prefill.targets import Resolve
from kvbridge.transfer.prefill.tickets import DeciderRead, ReadDecider, RegisteredAs
from kvbridge.transfer.ownership import ProofKey
from kvbridge.transfer.prefill.events import (AuxFrom, Chunk, Closing, EngineInit, Gc, Message, Post, PostFailed,
                                              Posted, PostWrite, ProofReadBack, ReleaseAux, Resolved, SendDigested,
                                              Serving, WriteFinal)
from kvbridge.transfer.prefill.machine import PrefillRooms
from kvbridge.transfer.prefill.events import KindUnits
from kvbridge.transfer.prefill.kinds import token_page_size
from kvbridge.transfer.prefill.room import PrefillRoom, page_ids
from kvbridge.transfer.prefill.staged import ChunkPostFailed, ChunkPosted, Gather, PostChunk, SetMode
from kvbridge.transfer.prefill.sender import KVSender
from kvbridge.transfer.registration import EndpointBuffers, check_kind_config, register_rank, unregister_quietly
from kvbridge.transfer.rooms import open_waiting
from kvbridge.transfer.scratch import PRIVATE_BYTES, PRIVATE_SLOTS, Scratch
from kvbridge.transfer.shell import EndpointShell
from kvbridge.transfer.staging import StagingBuffer

log = logging.getLogger(__name__)

__all__ = ["PrefillConfig", "PrefillEndpoint"]


def _stage_specs(config: PrefillConfig, specs: Mapping[str, PoolSpec], num_target_layers: int) -> dict[str, PoolSpec]:
    """The specs of this rank's pipeline stage: every pool cut to the stage's layers (all of them
    without ``pp_layers``). The last stage's layers end at the model's last target layer."""
    if config.pp_layers is None:
        return dict(specs)
    start, end = config.pp_layers
    if end > num_target_layers:
        raise ConfigError(f"pp_layers [{start}, {end}) reach past the contract's {num_target_layers} target layers",
                          rank=config.rank_label, field="pp_layers")
    if config.last_stage != (end == num_target_layers):
        raise ConfigError(f"pipeline stage pp{config.pp_rank} of {config.pp_size} declares layers [{start}, {end}): "
                          f"{'the last' if config.last_stage else 'only the last'} stage's layers end at the model's "
                          f"last target layer ({num_target_layers}); it holds the draft layers and the aux row",
                          rank=config.rank_label, field="pp_layers")
    return stage_specs(specs, (start, end), num_target_layers)


class PrefillEndpoint(EndpointShell):
    """One prefill rank. ``bootstrap`` is required: the rank registers there, and reads each
    decode rank's registered buffers from it. ``aux_buffer`` (optional): the engine's own aux
    rows, packed uint8 ``[rows, row_bytes]`` or ``{region: tensor[rows, ...]}``, registered so
    that ``send(..., aux_slot=i)`` writes row ``i`` without a copy; ``send(..., aux=row)`` uses
    kvbridge's staging rows. Specs, aux schema and lane rule are checked against the contract
    here (ConfigError naming the field). A pipeline stage (``config.pp_layers``) takes the whole
    model's specs and contract but buffers of its own layers only (``stage_specs``,
    docs/pipeline.md)."""

    def __init__(
        self,
        config: PrefillConfig,
        engine: TransferEngine,
        specs: Mapping[str, PoolSpec],
        buffers: Mapping[tuple[str, int], Any],
        contract: RuntimeContract,
        bootstrap: BootstrapClient,
        aux_schema: AuxSchema,
        *,
        aux_buffer: Any = None,
    ) -> None:
        super().__init__()
        self._loop_name = "prefill"
        rank = config.rank_label
        if bootstrap is None:
            raise ConfigError("a PrefillEndpoint needs a BootstrapClient: it registers there and reads each decode "
                              "rank's registered buffers from it before writing", rank=rank, field="bootstrap")
        check_against_contract(specs, aux_schema, contract, rank=rank, lane_rule=config.lane_rule,
                               tp_size=config.tp_size, tp_rank=config.tp_rank)
        self.config = config
        self.engine = engine
        # a pipeline stage registers, pairs and sends its own layers only (kvbridge.layout.stages)
        self.specs = _stage_specs(config, specs, contract.model.target_layers)
        check_kind_config(self.specs, cp_size=config.cp_size, lane_rule=config.lane_rule, pp_size=config.pp_size,
                          rank=rank)  # what the rooms carry of window/compressed/state
        self.buffers = EndpointBuffers(self.specs, buffers, rank=rank)
        # the contract as this rank holds it: on its engine's transport (decode ranks on another are refused)
        self.contract = contract = contract.with_transport(engine.transport)
        self.fingerprint = fingerprint(contract)
        self.bootstrap = bootstrap
        self.aux_schema = aux_schema
        self.aux_staging = AuxStaging(aux_schema, config.aux_slots, rank=rank, device=config.aux_device)
        self.aux_buffers = None if aux_buffer is None else AuxBuffers(aux_schema, aux_buffer, rank=rank)
        self.page_size = token_page_size(self.specs)
        self.trace = config.trace or os.environ.get("KVBRIDGE_TRACE") == "1"
        # the gather buffer staged writes leave from (docs/staging.md)
        self.gather = StagingBuffer.for_buffers(self.buffers.tensors, config.staging, config.staging_bytes,
                                                config.staging_slot_bytes, rank=rank, role="prefill",
                                                engine=self.engine)
        # signs this rank's room tickets when it is a room's decider (prefill/tickets.py); its public
        # half is in the registration, where the instance's other ranks read it
        self.proof_key = ProofKey()
        self.machine = PrefillRooms(
            config, self.specs, self.buffers.descs, aux_schema, self.fingerprint,
            digests_readable=self.buffers.readable, trace=self.trace,
            gather=None if self.gather is None else self.gather.area, target_layers=contract.model.target_layers,
            proof_key=self.proof_key,
        )  # fmt: skip
        self._registered_as: str | None = None  # the registration the machine's tickets name
        # advertised for `kvbridge doctor`; its private tail is the source of our ownership nonces
        self.scratch = Scratch(device=config.aux_device)
        self._resolver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvb-resolve")
        # the engine's probes of decode ranks (nonce writes, proof reads), each on a private scratch slot of its own:
        # one peer whose engine does not answer holds one thread for the engine's timeout (Mooncake: 30 s and more),
        # not the daemon reads nor every other connection's proof (CI, round 23: a read hung 30 s on a stalled host)
        self._probes = ThreadPoolExecutor(max_workers=PRIVATE_SLOTS, thread_name_prefix="kvb-probe")
        self._probe_slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(PRIVATE_SLOTS):
            self._probe_slots.put(slot)
        self._server: ControlServer | None = None
        self._next_housekeeping = 0.0
        self._gathered: dict[int, Any] = {}  # gather slot -> its gather's event (None: host, done), or why it failed
        self._lease: LeaseKeeper | None = None

    # -- life cycle -----------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise KVBridgeError("endpoint not started", rank=self.config.rank_label)
        return self._server.endpoint

    @property
    def lanes(self) -> OwnerLanes:
        """The instance's owner lanes (which CP rank holds which logical page)."""
        return self.machine.lanes

    @property
    def counters(self) -> dict[str, int]:
        """Rooms ok/failed, bytes and slices posted since start."""
        return self.machine.counters

    def health(self) -> dict[str, Any]:
        """A snapshot for metrics and operators, read under the endpoint's lock: ``staging``
        (the staged-transfer counters, the paths chosen among them), ``control`` (the control
        channel's message counts)."""
        with self._lock:
            staging = self.machine.staging_counters()
        return {"staging": staging, "control": {} if self._server is None else self._server.stats.counts()}

    def connections(self) -> dict[str, int]:
        """The control channel's connections: ``peers`` now and ``proven`` among them (never
        displaced), ``displaced`` and ``refused`` since start (``kvbridge chaos --hostile``'s
        address flood reads them through the worker's Stats)."""
        server = self._server
        if server is None:
            return {}
        peers = server.peers
        return {"peers": len(peers), "proven": sum(self._proven(p) for p in peers),
                "displaced": server.stats.displaced, "refused": server.stats.refused}

    def start(self) -> None:
        self.buffers.register(self.engine)
        self.scratch.register(self.engine)
        self.aux_staging.register(self.engine)
        if self.aux_buffers is not None:
            self.aux_buffers.register(self.engine)
        if self.gather is not None:
            self.gather.register(self.engine)
        self._server = ControlServer(self.config.host, self.config.control_port, secret=self.config.secret,
                                     limits=Limits(idle_timeout=self.config.idle_timeout or None),
                                     vouch=self._known_rank, protected=self._proven)
        with self._lock:
            self._feed_event(Serving(self._server.endpoint))  # what decode ranks' KeyProofs sign
        self.engine.set_notify(self._engine_final)
        self._start_loop(f"kvb-prefill-{self.config.cp_rank}")
        self._lease = register_rank(
            self.bootstrap, self.config, "prefill", self.endpoint, self.engine.session_id,
            self.buffers.descs, self.aux_buffers or self.aux_staging, self.contract, self.config.lease_ttl,
            scratch=self.scratch.descriptor, engine_metadata=self.engine.metadata,
            proof_key=self.proof_key.public_hex, proof_signature=self.proof_key.sign_claim,
        )
        with self._lock:
            self._note_registration()
        log.info("prefill rank %s serving %s (session %s)", self.config.rank_label, self.endpoint, self.engine.session_id)

    # Slots for known ranks (channel/server.py): read on the channel's loop thread without the lock
    # (it may hold the channel's while a sender holds ours), so only single dict reads here.
    def _proven(self, ident: bytes) -> bool:
        """A connection that proved its registration (never displaced by a newcomer)."""
        return self.machine.is_proven(ident)

    def _known_rank(self, hello: Any) -> bool:
        """A newcomer naming a decode registration this rank has read (a rank that reconnects):
        it may displace an unproven connection when every slot is taken."""
        return bool(hello.peer) and self.machine.knows_rank(hello.peer)

    def close(self, timeout: float = 5.0) -> None:
        """Let in-flight rooms finish for up to ``timeout`` s, fail the rest, deregister."""
        with self._lock:
            self._feed_event(Closing())
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.locked(lambda: self.machine.busy):
            time.sleep(0.02)
        with self._lock:
            self._feed_event(Shutdown(f"prefill rank {self.config.rank_label} is shutting down", time.monotonic()))
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.machine.writing:
            time.sleep(0.02)
        self._stop_loop(timeout)
        self._resolver.shutdown(wait=False, cancel_futures=True)
        self._probes.shutdown(wait=False, cancel_futures=True)
        if self._lease is not None:
            self._lease.stop(deregister=True)
        if self._server is not None:
            self._server.close()
        self.engine.set_notify(None)
        # the engine may outlive this endpoint: withdraw our memory before the caller frees it
        unregister_quietly(self.engine, self.buffers, self.aux_staging, self.aux_buffers, self.scratch, self.gather)

    def _wake(self) -> None:
        if self._server is not None:
            self._server.wakeup.post()

    # -- engine-facing (any thread) -------------------------------------------

    def sender(self, room: int, *, wait: float = 0.0) -> KVSender:
        """A KVSender for ``room``. RoomInUse while a previous room of that id is open, or draining
        (its writes still in flight) for longer than ``wait`` seconds (``RoomInUse.draining``)."""
        with self._lock:
            r = open_waiting(lambda: self._open(room), self._room_freed, wait)
        return KVSender(self, r)

    def _open(self, room: int) -> PrefillRoom:
        """(lock held) Close the rooms of dropped handles first: a dropped KVSender holds its room
        no more, so its id is draining or free now, never "still held" (and ``wait`` applies)."""
        self._close_released()
        return self.machine.open(room, time.monotonic())

    def set_staging(self, mode: str) -> None:
        """Change the staging override (auto, always, never) for targets not yet planned (the
        bench compares the paths on one set of ranks)."""
        self._check_staging_mode(mode, self.gather, "gather buffer")
        with self._lock:
            self._feed_event(SetMode(mode))

    def init_room(self, r: PrefillRoom, num_tokens: int | None, num_pages: int | None, first_page: int = 0,
                  binding: bytes = b"", kind_units: Any = None) -> None:
        with self._lock:
            if kind_units is not None:
                self._feed_event(KindUnits(r, kind_units))
            self._feed_event(EngineInit(r, num_tokens, num_pages, time.monotonic(), first_page, binding))

    def kind_units(self, r: PrefillRoom, kind_units: Any) -> None:
        """KVSender.send(kind_units=) ahead of its chunk: the units as the engine has them now."""
        with self._lock:
            self._feed_event(KindUnits(r, kind_units))

    def send_chunk(self, r: PrefillRoom, logical: Any, local: Any, num_tokens_ready: int | None, is_last: bool,
                   aux: Any, aux_slot: int | None, ready_event: Any = None, layers: Any = None) -> None:
        """KVSender.send(): the engine's input checked, the chunk queued, and posted from this thread
        when the decode ranks already asked (no loop turn); completions are reported from the
        engine's callback."""
        with self._lock:
            if r.state.final:  # ended meanwhile (abort, peer loss) or before: nothing is queued
                # An engine may still call send() on a room it has not polled since it ended (SGLang's CP
                # ranks with nothing to send, the owner of the last token after decode refused the room):
                # never an exception on its thread. Said in the log unless it carried nothing to a success.
                carried = aux is not None or np.asarray(logical).size > 0
                if carried or r.state.state != KVPoll.Success:
                    why = f": {r.state.reason}" if r.state.reason else ""
                    log.warning("%s", RoomEnded(f"send() on room {r.room}, which already ended ({r.state.state.name}"
                                                f"{why}); nothing queued: poll() says a room's final state",
                                                room=r.room, rank=self.config.rank_label, field="send"))
                return
            row = None if aux is None else self.aux_schema.pack_row(aux, r.room)
            if aux_slot is not None:
                self._check_aux_slot(r.room, aux_slot)
            local_arr = page_ids(local, "local_pages", r.ctx)
            if local_arr.size and (local_arr.min() < 0 or local_arr.max() >= self.buffers.min_capacity):
                raise LayoutError(f"local pages must lie in [0, {self.buffers.min_capacity})", room=r.room,
                                  rank=self.config.rank_label, field="local_pages")
            self._feed_event(Chunk(r, logical, local_arr, num_tokens_ready, is_last, row, aux_slot, ready_event, layers))
            aux = None
            if row is not None:  # staged now (a device copy is queued, not waited for), off the request's path
                try:
                    slot = self.aux_staging.stage(r.room, row, after=ready_event)
                except KVBridgeError as exc:
                    self._feed_event(AbortRoom(r, f"aux row of room {r.room} cannot be staged: {exc}",
                                               time.monotonic()))
                    raise
                aux = AuxFrom(self.aux_staging.regions, slot, self.aux_staging.row_base,
                              self.aux_staging.ready_event(r.room), row.tobytes())
            elif aux_slot is not None:  # the engine's own row: written from where it is
                aux = AuxFrom(self.aux_buffers.regions, aux_slot, self.aux_buffers.row_base)
            self._feed_event(Post(r, time.monotonic(), aux))

    def _check_aux_slot(self, room: int, slot: int) -> None:
        if self.aux_buffers is None:
            raise LayoutError("send(aux_slot=...) needs the engine's aux rows: PrefillEndpoint(..., aux_buffer=...)",
                              room=room, rank=self.config.rank_label, field="aux_slot")
        self.aux_buffers.check_slot(slot, room=room)
        if _on_host(self.aux_buffers):
            echoed = self.aux_buffers.read_room(slot)  # host memory: catch a wrong slot here (hard rule 4)
            if echoed != room:
                raise LayoutError(f"aux slot {slot} holds room {echoed}'s row", room=room,
                                  rank=self.config.rank_label, field="aux_slot")

    # -- carrying out actions (lock held) ---------------------------------------

    def _carry(self, a: Any) -> None:
        if type(a) is PostWrite:
            self._post(a)
        elif type(a) is Gather:
            self._gather(a)
        elif type(a) is PostChunk:
            self._post_chunk(a)
        elif type(a) is Send:
            for ident in a.to:
                self._reply(ident, a.msg)
        elif type(a) is SendDigested:
            self._send_digested(a)
        elif type(a) is ReleaseAux:
            self.aux_staging.release(a.room)
        elif type(a) is FreeRoom:
            self._room_freed.notify_all()  # sender(room, wait=...) may open it now
        elif type(a) is Resolve:
            self._resolver.submit(self._resolve, a)
        elif type(a) is WriteNonce:
            self._probes.submit(self._write_nonce, a)
        elif type(a) is ReadProof:
            self._probes.submit(self._read_proof, a)
        elif type(a) is ReadDecider:
            self._resolver.submit(self._read_decider, a)
        else:
            raise TypeError(f"prefill endpoint cannot carry out {a!r}")

    def _post(self, a: PostWrite) -> None:
        """Submit a write. A refusal is an event for the loop's next turn (the machine is not
        entered from inside a post); a completion comes through ``take_final``, also on the loop."""
        if not a.target.active:  # its target failed since the write was planned: nothing to post
            self._queue(PostFailed(a, None, time.monotonic()))
            return
        start = time.monotonic()
        try:
            handle = self.engine.submit_write(a.session, a.src, a.dst, a.length, after=a.after)
        except KVBridgeError as exc:
            self._queue(PostFailed(a, str(exc), time.monotonic()))
            return
        except Exception as exc:  # a bug must fail this target, not the engine thread or the loop that called us
            log.exception("room %d on %s: posting to %s failed", a.room, self.config.rank_label, a.target.decode_rank)
            reason = f"internal error posting room {a.room} to {a.target.decode_rank}: {type(exc).__name__}: {exc}"
            self._queue(PostFailed(a, reason, time.monotonic()))
            return
        now = time.monotonic()
        self._queue(Posted(a, handle, now, now - start))  # booked before any completion is collected

    def _send_digested(self, a: SendDigested) -> None:
        """The machine's report with the digests of the pages it names, read here."""
        digests = page_digests(self.specs, self.buffers.tensors, a.pools, a.pages, a.local, a.num_tokens) \
            if a.pools else None
        kinds = {pool: kind_unit_digests(self.specs[pool], self.buffers.tensors, logical, units,
                                         a.kind_tokens).astype("<u8").tobytes() for pool, logical, units in a.kinds}
        self._reply(a.to, msgspec.structs.replace(a.msg, digests=None if digests is None else digests.tobytes(),
                                                  kind_digests=kinds))

    def _gather(self, a: Gather) -> None:
        """Gather a staged chunk into our gather slot now, ahead of its grant (GPU: queued on the
        stager's stream after the source pages' events; host: copied here). What went wrong is
        kept for the chunk's PostChunk, which then posts nothing."""
        stager = self.gather.stager
        try:
            if a.after is not None:
                stager.wait_for(a.after)  # the source pages are whole (GPU: the stream waits, not this thread)
            self._gathered[a.local_slot] = stager.gather(a.staged, a.chunk, self.gather.slot_addr(a.local_slot))
        except Exception as exc:
            if not isinstance(exc, KVBridgeError):
                log.exception("room %d on %s: gathering chunk %d failed", a.room, self.config.rank_label, a.chunk)
            self._gathered[a.local_slot] = _GatherFailed(f"gathering chunk {a.chunk} of room {a.room} failed: "
                                                         f"{type(exc).__name__}: {exc}")

    def _post_chunk(self, a: PostChunk) -> None:
        """Write a gathered chunk's pieces into the decode slot it was granted (GPU: the write
        waits for the gather's event; host: the gather is done)."""
        event = self._gathered.pop(a.local_slot, None)
        if not a.target.active:
            self._queue(ChunkPostFailed(a, None, time.monotonic()))
            return
        if isinstance(event, _GatherFailed):
            self._queue(ChunkPostFailed(a, event.reason, time.monotonic()))
            return
        try:
            local = self.gather.slot_addr(a.local_slot)
            src, dst, length = a.staged.wire(a.chunk, local, a.remote_addr)
            handle = self.engine.submit_write(a.session, src, dst, length, after=event)
        except KVBridgeError as exc:
            self._queue(ChunkPostFailed(a, str(exc), time.monotonic()))
            return
        except Exception as exc:  # a bug must fail this target, not the thread that called us
            log.exception("room %d on %s: staging a chunk to %s failed", a.room, self.config.rank_label,
                          a.target.decode_rank)
            reason = f"internal error staging room {a.room} to {a.target.decode_rank}: {type(exc).__name__}: {exc}"
            self._queue(ChunkPostFailed(a, reason, time.monotonic()))
            return
        self._queue(ChunkPosted(a, handle, len(length), int(a.staged.chunk_bytes[a.chunk]), time.monotonic()))

    def _engine_kind(self, session: str) -> str:
        """The route a write to ``session`` goes through (``registry.route_key``: the registered
        engine, per peer for one that routes, and where the pages are), whose entry's staging
        thresholds ``choose_path`` takes."""
        route = getattr(self.engine, "route", None)
        name = route(session) if route is not None else entry_of(self.engine).name
        return route_key(name, on_gpu=self.gather is not None and self.gather.on_gpu)

    def _reply(self, ident: bytes, msg: Any) -> None:
        try:
            self._server.send(ident, msg)
        except TransferError as exc:  # the decode rank went away; liveness fails its targets
            log.warning("cannot reach decode peer %s: %s", ident.hex(), exc)

    def _collect(self) -> None:
        """Feed the writes that became final (the loop's turn, lock held)."""
        for handle in self.machine.pending(self.engine.take_final()):
            status = self.engine.poll(handle)
            if status.state is WriteState.PENDING:
                continue
            self._feed_event(WriteFinal(handle, status, time.monotonic()))

    def _resolve(self, a: Resolve) -> None:
        """Resolver thread: read a decode rank's registration, hand the answer to the loop."""
        try:
            detail, problem = self.bootstrap.rank(a.rank_id), None
        except UnknownInstance:
            detail, problem = None, (f"decode rank {a.label} (registration {a.rank_id}) is not registered with the "
                                     "bootstrap daemon (never, or its lease expired): its buffers cannot be checked")
        except KVBridgeError as exc:
            detail, problem = None, f"cannot read decode rank {a.label}'s registration {a.rank_id}: {exc}"
        if detail is not None:  # what the engine must know before writing there (NIXL: the agent's metadata)
            try:
                self.engine.add_peer(detail.session_id, base64.b64decode(detail.engine_metadata, validate=True))
            except (KVBridgeError, ValueError) as exc:  # binascii.Error is a ValueError
                detail, problem = None, (f"decode rank {a.label}'s registration {a.rank_id}: its transfer engine's "
                                         f"metadata does not load: {exc}")
        kind = "local" if detail is None else self._engine_kind(detail.session_id)
        by_read = detail is not None and self.engine.reads(detail.session_id)
        self._queue(Resolved(a.rank_id, detail, problem, time.monotonic(), kind, by_read))

    def _note_registration(self) -> None:
        """Tell the machine our registration (the decider its tickets name) when it is new (with the lock)."""
        rank_id = None if self._lease is None else self._lease.registration.rank_id
        if rank_id and rank_id != self._registered_as:
            self._registered_as = rank_id
            self._feed_event(RegisteredAs(rank_id))

    def _read_decider(self, a: ReadDecider) -> None:
        """Resolver thread: read a room decider's registration (its proof key and coordinates)."""
        try:
            d = self.bootstrap.rank(a.rank_id)
            ev = DeciderRead(a.rank_id, d.rank.instance, d.rank.role,
                             (d.rank.dp_rank, d.rank.cp_rank, d.rank.tp_rank, d.rank.pp_rank), d.proof_key, None,
                             time.monotonic())
        except KVBridgeError as exc:
            ev = DeciderRead(a.rank_id, "", "", (0, 0, 0, 0), None, str(exc), time.monotonic())
        self._queue(ev)

    def _read_proof(self, a: ReadProof) -> None:
        """Probe thread: read a decode rank's memory proof out of its scratch region into a private
        scratch slot of ours (this thread's while it reads: no other probe uses it). Nothing is
        written into the decode rank's memory."""
        slot = self._probe_slots.get()
        try:
            if a.length > PRIVATE_BYTES:
                raise KVBridgeError(f"a proof read of {a.length} bytes does not fit a {PRIVATE_BYTES}-byte slot",
                                    field="length")
            self.engine.probe_read(a.session, np.array([self.scratch.landing(slot)], np.uint64),
                                   np.array([a.src], np.uint64), np.array([a.length], np.uint64),
                                   timeout=self.config.peer_timeout)
            data, problem = self.scratch.read_landing(a.length, slot), None
        except KVBridgeError as exc:
            data, problem = b"", f"session {a.session}: {exc}"
        except Exception as exc:  # a bug refuses this connection, never the probe thread
            log.exception("proof read from %s failed", a.session)
            data, problem = b"", f"session {a.session}: {type(exc).__name__}: {exc}"
        finally:
            self._probe_slots.put(slot)
        self._queue(ProofReadBack(a.ident, data, problem, time.monotonic()))

    def _write_nonce(self, a: WriteNonce) -> None:
        """Probe thread: the ownership nonce into a decode rank's scratch region, from a private
        scratch slot of ours (this thread's while it writes: no other probe uses it)."""
        slot = self._probe_slots.get()
        try:
            self.scratch.set_source(a.nonce, slot)
            self.engine.probe_write(a.session, np.array([self.scratch.source(slot)], np.uint64),
                                    np.array([a.dst], np.uint64), np.array([len(a.nonce)], np.uint64),
                                    timeout=self.config.peer_timeout)
            problem = None
        except KVBridgeError as exc:
            problem = f"session {a.session}: {exc}"
        except Exception as exc:  # a bug refuses this connection, never the probe thread
            log.exception("nonce write to %s failed", a.session)
            problem = f"session {a.session}: {type(exc).__name__}: {exc}"
        finally:
            self._probe_slots.put(slot)
        self._queue(NonceWritten(a.ident, problem, time.monotonic()))

    def _hello_of(self, ident: bytes) -> str | None:
        hello = self._server.hello_of(ident) if self._server is not None else None
        return None if hello is None else hello.peer

    # -- the loop -------------------------------------------------------------

    def _step(self) -> None:
        # write completions wake the loop through the engine's notify callback: no busy polling
        # a staged chunk's next group to plan: take the next turn at once
        for ident, msg in self._server.recv_ready(0 if self.machine.wants_turn else 50):
            with self._lock:
                self._feed_event(Message(ident, msg, self._hello_of(ident), time.monotonic()))
                self._feed_queued()
        with self._lock:
            self._feed_queued()
            self._collect()
            self._feed_queued()
            now = time.monotonic()
            self._feed_event(Tick(now))
            if now >= self._next_housekeeping:
                self._next_housekeeping = now + self.config.housekeeping_interval
                self._close_released()
                self._note_registration()  # (a re-registration after a daemon restart gives a new id)
                self._feed_event(Gc(now))
            self._feed_queued()


class _GatherFailed:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _on_host(aux: AuxBuffers) -> bool:
    # torch: device.type; numpy (2.x) has a device too, the string "cpu"
    return aux.readable and all(getattr(getattr(t, "device", None), "type", "cpu") == "cpu"
                                for t in aux.tensors.values())


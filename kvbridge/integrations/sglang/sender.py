"""``KVBridgeKVSender``: one request on one SGLang prefill rank, on a kvbridge ``KVSender``.

SGLang's prefill scheduler drives it (``PrefillBootstrapQueue.create_sender`` ->
``pop_bootstrapped`` / ``finalize_bootstrap`` -> ``send_kv_chunk`` per chunk ->
``process_disagg_prefill_inflight_queue``), and all-reduces every rank's ``poll()``
over attention TP and CP with MIN:

    SGLang                                      kvbridge
    __init__(mgr, addr, room, has_dp_rank)      ep.sender(room)   (a draining id: retried from poll())
    bind_request(req) (kvbridge's patch of      sender.bind(room_binding(req.origin_input_ids)): a claim
      create_sender)                            of another request is refused from now on
    pop_decode_prefix_len() -> P * page_size    P = sender.decode_first_page: the prefix every decode
                                                rank holds (SGLang asks once poll() read WaitingForInput)
    init(num_pages, aux_index)                  sender.init(len(prompt), num_pages=P + num_pages, first_page=P,
                                                binding=the same): SGLang counts the pages after the prefix
    send(page ids, state, num_kv_tokens)        sender.send(logical = P + pages given so far.., local,
                                                num_tokens_ready=P * page_size + sum of num_kv_tokens,
                                                is_last=all pages given, aux_slot=aux_index on the owner
                                                of the last page, ready_event=the early-send wait event:
                                                no byte read before it completes)
    poll() / failure_exception() / abort()      poll() / KVTransferError(room, reason) / abort()
    clear()                                     close()
    get_transfer_metric()                       stats: bytes posted, first write to the final state
    room_stats (not SGLang's)                   stats: the whole account (paths direct/staged, chunks)

The decode prefix. SGLang sends, and with ``--disaggregation-enable-kv-checksum`` digests,
tokens ``[prefix, n)`` on prefill, and decode digests the same range of its own pages: the
prefix must be what decode holds, so it is kvbridge's ``decode_first_page`` (decode TP ranks
holding different prefixes cannot be told to SGLang as one number: the room fails, naming
them). A chunk's pages are the request's positions ``[P + sent, P + sent + len)``; this rank passes
those it owns (its lane), each stored at ``page id`` (``page id // N`` with
logical-page KV sharding over N ranks, where SGLang places page id p on rank
``p % N``: kvbridge requires that to be the position's lane, and fails a room whose
pages do not follow it). The paged state indices (DSA's index K, BLOCK_SCALE's MXFP8 scales)
must be the request's page ids: target, index, scales and draft move with one mapping (hard
rule 3).

A rank without an endpoint (attention TP ranks > 0 of an MLA cache) sends nothing
and reports Success, so that the MIN is its peers' state; it still fails on its
own abort and raises from ``failure_exception`` like every rank. No decode rank asks it
for anything, so it cannot learn the decode prefix, and its ``pop_decode_prefix_len()``
is 0. Nothing of that value leaves the rank: SGLang uses it only for this rank's own
``init``/``send`` (which send nothing) and its own checksum, written into its own
metadata row, while the row decode receives, checksum included, is the endpoint rank's
(TP rank 0 of the CP rank owning the last page), taken over ``[prefix, n)``.

Pipeline-parallel prefill (``--pp-size > 1``), as SGLang 0.5.23's PP prefill loop
(``event_loop_pp_disagg_prefill``) drives the stages: the bootstrap poll is PP rank 0's alone
(``poll_and_all_reduce_prefill_pp`` hands it to every stage), so every stage runs
``finalize_bootstrap`` once decode asked stage 0; every stage calls ``send_kv_chunk`` for its own
layers and fills its own metadata row; a request is released once every stage polled Success or
Failed (the intersection of their lists). In kvbridge each stage is a pipeline stage sending its
own layers; the aux row is the last stage's (it holds the last hidden state), so the other stages
pass no aux slot (``writes_aux`` is False there). A stage that decode has not asked yet when stage 0
bootstraps cannot know the decode prefix: ``pop_decode_prefix_len()`` returns 0 there, the stage
hands in every page, and kvbridge still writes each decode rank only the pages after its prefix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVSender, KVPoll, KVTransferMetric

from kvbridge import KVBridgeError, LayoutError
from kvbridge.integrations.sglang.handles import RoomHandle
from kvbridge.integrations.sglang.state_kinds import STATE_KINDS, kind_units, state_type_names


class KVBridgeKVSender(RoomHandle, BaseKVSender):
    role = "prefill"
    idle_state = KVPoll.Success  # a rank without an endpoint: what its peers report decides (MIN)

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:  # fmt: skip
        self._start(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        # SGLang's early send of a cached prefix (Scheduler.maybe_send_cached_prefix_chunk) sets this,
        # under overlap scheduling, to a CUDA event recorded after the previous forward pass that may
        # still write those pages; it belongs to the next send() only.
        self._early_send_wait_event: Any = None
        self._num_pages: int | None = None  # SGLang's count: pages after the decode prefix
        self._prefix_pages = 0  # the decode prefix (pop_decode_prefix_len), in pages
        self._aux_index: int | None = None
        self._pages_given = 0
        self._tokens_given = 0
        self._page_ids: list[np.ndarray] = []
        self._mine: np.ndarray | None = None  # position -> this rank sends it (the room's owned pages, after init)
        s = mgr.settings
        if mgr.released:
            self.fail(mgr.RELEASED)
        elif (unsigned := self._unsigned()) is not None:
            self.fail(unsigned)
        elif s.dp_size > 1 and not req_has_disagg_prefill_dp_rank and self.bootstrap_room % s.dp_size != s.dp_rank:
            self.fail(f"room {self.bootstrap_room} came to prefill DP rank {s.dp_rank}, but decode looks it up in "
                      f"DP rank {self.bootstrap_room % s.dp_size} (room % dp_size): route with "
                      "load_balance_method follow_bootstrap_room, or pass the prefill DP rank with the request")
        elif mgr.endpoint is not None:
            self._open()

    def _open(self) -> None:
        self._open_with(lambda: self.kv_mgr.endpoint.sender(self.bootstrap_room))

    def _bound(self) -> None:
        """The open room takes the request's binding now: a decode claim with another digest (a
        room id taken from another request, a longer prompt) is refused at once; one accepted
        before this call with another digest fails this request (its room was pre-claimed)."""
        if self._handle is None or self._failure is not None:
            return
        try:
            self._handle.bind(self.binding)
        except KVBridgeError as exc:
            self.fail(str(exc))

    # -- SGLang's calls -------------------------------------------------------------------

    def init(self, num_kv_indices: int, aux_index: Any = None) -> None:
        self._num_pages = int(num_kv_indices)
        self._aux_index = None if aux_index is None else int(aux_index)
        self._tokens_given = self._prefix_pages * self.kv_mgr.page_size  # the prefix exists: tokens [0, P*page)
        if self._handle is None or self._failure is not None:
            return
        try:
            later = {p: None for p, st in self.kv_mgr.cache.state_of.items() if STATE_KINDS.get(st) == "window"}
            self._handle.init(self.num_tokens, num_pages=self._prefix_pages + self._num_pages,
                              first_page=self._prefix_pages, binding=self.binding,
                              **({"kind_units": later} if later else {}))  # window pages: with the last chunk
        except KVBridgeError as exc:
            self.fail(str(exc))

    def pop_decode_prefix_len(self) -> int:
        """The decode prefix in tokens (whole pages): what every decode rank of the room holds.
        SGLang asks once poll() read WaitingForInput (every decode rank asked), before init()."""
        if self._handle is None or self._failure is not None:
            return 0  # no endpoint (see the module docstring), or failed: nothing is sent
        if self.kv_mgr.settings.pp_size > 1 and int(self._handle.poll()) == KVPoll.Bootstrapping:
            return 0  # a stage decode has not asked yet (see the module docstring)
        try:
            self._prefix_pages = int(self._handle.decode_first_page)
        except KVBridgeError as exc:  # asked too early, or decode ranks holding different prefixes
            self.fail(str(exc))
            return 0
        return self._prefix_pages * self.kv_mgr.page_size

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: Any = None) -> None:
        wait_event, self._early_send_wait_event = self._early_send_wait_event, None
        if self._failure is not None or self._num_pages is None:
            return
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        start = self._prefix_pages + self._pages_given  # SGLang's pages start after the decode prefix
        self._pages_given += pages.size
        self._page_ids.append(pages)
        if num_kv_tokens is None:
            self.fail("SGLang sent a chunk without num_kv_tokens: kvbridge needs the token count to send only the "
                      "valid rows of the last page")
            return
        self._tokens_given += int(num_kv_tokens)
        is_last = self._pages_given == self._num_pages
        kind_units = self._kind_units(state_indices, is_last)
        if kind_units is None or self._handle is None:
            return
        try:
            logical, local = self._owned(np.arange(start, self._prefix_pages + self._pages_given), pages)
            aux_slot = self._aux_index if is_last and self._handle.writes_aux else None
            self._handle.send(logical, local, num_tokens_ready=self._tokens_given, is_last=is_last,
                              aux_slot=aux_slot, ready_event=wait_event,
                              **({"kind_units": kind_units} if kind_units else {}))  # fmt: skip
        except KVBridgeError as exc:
            self.fail(str(exc))

    def _owned(self, positions: np.ndarray, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(logical pages, local pages) of this chunk that this rank sends."""
        if self._mine is None:  # once a room: owned_pages is a copy under the endpoint's lock
            owned = self._handle.owned_pages
            self._mine = np.zeros(self._prefix_pages + (self._num_pages or 0), dtype=bool)
            self._mine[owned[owned < self._mine.size]] = True
        if positions.size and positions[-1] >= self._mine.size:  # (ascending) past the room's pages: none is owned
            mine = np.isin(positions, np.flatnonzero(self._mine))
        else:
            mine = self._mine[positions]
        shard = self.kv_mgr.settings.kv_shard_size
        if shard > 1:
            off = np.flatnonzero(pages % shard != positions % shard)
            if off.size:
                i = int(off[0])
                raise LayoutError(f"KV cache sharding: page id {int(pages[i])} of position {int(positions[i])} lies "
                                  f"on shard rank {int(pages[i] % shard)}, not the position's lane "
                                  f"{int(positions[i] % shard)} (kvbridge's interleaved owner lanes need the "
                                  "allocator's round-robin to start at rank 0)", room=self.bootstrap_room,
                                  rank=self.label, field="kv_indices")
            return positions[mine], pages[mine] // shard
        return positions[mine], pages[mine]

    def _kind_units(self, state_indices: Any, is_last: bool) -> dict[str, np.ndarray] | None:
        """The room's ``kind_units`` for this chunk (``state_kinds.kind_units``): V4's compressed KV
        pools on the pages given so far, every chunk; with the last, SGLang's state indices
        (checked against what kvbridge sends) made units. None once the room failed.

        Paged components (DSA's index K: the pages after the decode prefix; BLOCK_SCALE's scales:
        every page of the request) must be the KV's own pages: kvbridge moves them with the KV's
        page mapping (hard rule 3). MAMBA's index is the request's ``MambaPool`` slot; SWA's (and its
        MXFP8 scales') the window's pages in the SWA pool (``_swa_payload``: from ``floor((n - W) /
        page)``), said at ``init()`` to come with the last chunk (``kind_units={pool: None}``), and
        V4's C4 rings the SWA page of each of their pages; SWA_RING's ring rows the request row;
        DSA_TAIL's, DSV4_REQUEST_STATE's and REQUEST_ROW's the request row."""
        cache = getattr(self.kv_mgr, "cache", None)
        specs = getattr(cache, "kind_specs", {}) or {}
        state_of = getattr(cache, "state_of", {}) or {}
        if not specs and not (is_last and state_type_names(self.kv_mgr.kv_args)):
            return {}
        pages = np.concatenate(self._page_ids)
        types = state_type_names(self.kv_mgr.kv_args)
        if is_last and not self._paged_state_follows(types, state_indices, pages):
            return None
        try:
            return kind_units(specs, state_of, types, state_indices, num_tokens=self._tokens_given if is_last else None,
                              kv_pages=pages, page_size=self.kv_mgr.page_size, last=is_last,
                              request_row=self.request_row if self.request_row is not None else 0)
        except KVBridgeError as exc:
            self.fail(f"{exc.reason}: decode's copy would not be written")
            return None

    def _paged_state_follows(self, types: list[str], state_indices: Any, pages: np.ndarray) -> bool:
        """The paged components' indices are the KV's own pages (hard rule 3); False once failed."""
        given = list(state_indices or [])
        for at, st in enumerate(types):
            idx = given[at] if at < len(given) else None
            if STATE_KINDS.get(st) != "paged" or idx is None:
                continue
            got = np.asarray(idx, dtype=np.int64).reshape(-1)
            if st != "dsa":  # every page of the request: those after the decode prefix are the ones sent
                got = got[self._prefix_pages:]
            if not np.array_equal(got, pages):
                self.fail(f"the {st!r} state indices ({got.size} pages) are not the request's KV pages "
                          f"({pages.size}): kvbridge moves them with the KV's page mapping (hard rule 3)")
                return False
        return True

    @property
    def room_stats(self) -> dict[str, Any]:
        """kvbridge's account of this room on this rank (``KVSender.stats``: ``slices`` and
        ``bytes`` posted, ``paths`` decode rank -> "direct"/"staged", staged ``chunks`` and
        ``bytes_staged``); SGLang's ``KVTransferMetric`` has no field for the path. Empty on a rank
        without an endpoint or a room never opened. Read it before ``clear()``."""
        return {} if self._handle is None else dict(self._handle.stats)

    def get_transfer_metric(self) -> KVTransferMetric:
        if self._handle is None:
            return KVTransferMetric()
        st = self._handle.stats
        if not st["bytes"]:
            return KVTransferMetric()  # this rank moved nothing (another CP rank did)
        return KVTransferMetric(transfer_latency_s=st["transfer_s"], transfer_total_bytes=st["bytes"])

"""``KVBridgeKVReceiver``: one request on one SGLang decode rank, on a kvbridge ``KVReceiver``.

SGLang's decode scheduler drives it (``DecodePreallocQueue.add`` ->
``_resolve_pending_reqs`` / ``_init_receiver`` -> ``_update_handshake_waiters`` ->
``pop_preallocated`` / ``_send_kv_metadata`` -> ``DecodeTransferQueue.pop_transferred``),
and all-reduces every attention TP rank's ``poll()`` with MIN:

    SGLang                                          kvbridge
    __init__(mgr, bootstrap_addr, room)             nothing yet: the prefill instance may be unknown
    init(prefill_dp_rank)                           ep.receiver(room, instance, dp_rank) at the daemon
                                                    of bootstrap_addr (manager.try_ensure_parallel_info)
    bind_request(req) (kvbridge's patch of          the request's digest and token count, presented with
      _create_receiver_and_enqueue)                 the claim (room_binding of req.origin_input_ids)
    send_metadata(page ids, aux_index, state,       receiver.init(page ids, aux_index, len(prompt), first_page=
                  decode_prefix_len)                prefix // page_size, binding=the digest): prefill refuses
                                                    a claim whose digest or count is not its room's, at once,
                                                    before anything is written; decode checks the count
                                                    against its pages before it asks
    poll()                                          poll(), but Failed only once pages_releasable
    failure_exception() / abort() / clear()         KVTransferError(room, reason) / abort() / close()

Hard rule 6: SGLang frees a request's pages (and its metadata row) as soon as it
sees Failed, so a failed room reads Transferring until no write of it can land;
prefill reports a failure to one decode rank only once nothing of the room is in
flight to any (the TP ranks' MIN makes one rank's Failed everyone's). A decode
prefix must be whole pages (kvbridge moves pages); the DSA state (index K) must be
the KV's own pages (hard rule 3); anything else fails the room, naming it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll, KVTransferDestination, StateType

from kvbridge import KVBridgeError
from kvbridge.integrations.sglang.handles import RoomHandle
from kvbridge.integrations.sglang.state_kinds import kind_units


class KVBridgeKVReceiver(RoomHandle, BaseKVReceiver):
    role = "decode"
    __kvbridge_receiver__ = True  # patches.py's decode hook sets num_tokens on these

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: Any = None) -> None:
        self._start(mgr, int(bootstrap_room or 0))
        self.bootstrap_addr = bootstrap_addr
        self.require_staging = False
        self.abort_notified = False
        self._prefill_dp_rank: int | None = None
        # self.num_tokens (RoomHandle): the request's token count, which SGLang's send_metadata does not
        # say: bind_request and kvbridge's decode hook (patches.py, DecodePreallocQueue._send_kv_metadata) set it
        if (unsigned := self._unsigned()) is not None:  # before init() claims the room
            self.fail(unsigned)

    # -- SGLang's calls -------------------------------------------------------------------

    def init(self, prefill_dp_rank: int) -> None:
        if self._failure is not None:
            return
        self._prefill_dp_rank = int(prefill_dp_rank)
        self._open()

    def _open(self) -> None:
        if self.kv_mgr.released:
            self.fail(self.kv_mgr.RELEASED)
            return
        found = self.kv_mgr.receiver_endpoint(self.bootstrap_addr)
        if found is None:
            self.fail(f"no kvbridge prefill instance known at bootstrap address {self.bootstrap_addr}")
            return
        ep, instance = found
        self._open_with(lambda: ep.receiver(self.bootstrap_room, instance, self._prefill_dp_rank))

    def send_metadata(self, kv_indices: Any, aux_index: Any = None, state_indices: Any = None,
                      decode_prefix_len: Any = None, destination: Any = KVTransferDestination.DEVICE) -> None:  # fmt: skip
        if self._failure is not None:
            return
        if self._handle is None:
            self.fail("send_metadata() before the receiver was opened (init(prefill_dp_rank) first)")
            return
        if destination not in (None, KVTransferDestination.DEVICE):
            self.fail(f"KV destination {destination!r}: kvbridge writes decode's device pools only")
            return
        page_size = self.kv_mgr.page_size
        prefix = int(decode_prefix_len or 0)
        if prefix % page_size:
            self.fail(f"decode prefix of {prefix} tokens is not whole pages of {page_size}: kvbridge moves the "
                      "pages after a page-aligned prefix")
            return
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        types = list(getattr(self.kv_mgr.kv_args, "state_types", None) or [])
        if StateType.DSA in types and state_indices and state_indices[types.index(StateType.DSA)] is not None:
            dsa = np.asarray(state_indices[types.index(StateType.DSA)], dtype=np.int64).reshape(-1)
            if not np.array_equal(dsa, pages):
                self.fail(f"the DSA state indices ({dsa.size} pages) are not the KV pages after the prefix "
                          f"({pages.size}): kvbridge moves index K with the KV's page mapping (hard rule 3)")
                return
        kind_pools = sorted(getattr(self.kv_mgr.cache, "kind_specs", {}) or {})
        num_tokens = None
        if kind_pools:
            if self.num_tokens is None:
                self.fail(f"pools {kind_pools} need the request's token count, which SGLang's send_metadata "
                          "does not say (kvbridge's decode hook, patches.py, sets it: is install() in place?)")
                return
            num_tokens = int(self.num_tokens)
        kind_units = self._kind_units(types, state_indices, pages, num_tokens)
        if kind_units is None:
            return
        try:
            self._handle.init(pages, int(aux_index), self.num_tokens if num_tokens is None else num_tokens,
                              first_page=prefix // page_size, binding=self.binding,
                              **({"kind_units": kind_units} if kind_units else {}))
        except KVBridgeError as exc:
            self.fail(str(exc))

    def _kind_units(self, types: list[Any], state_indices: Any, pages: np.ndarray,
                    num_tokens: int | None) -> dict[str, np.ndarray] | None:
        """The room's ``kind_units`` from SGLang's state indices and KV pages
        (``state_kinds.kind_units``: a MAMBA slot, the window's SWA pages, V4's compressed KV on
        the KV pages and its C4 rings on the SWA pages, the request row of a ring, tail or request
        state). None once failed."""
        cache = self.kv_mgr.cache
        specs = getattr(cache, "kind_specs", {}) or {}
        if not specs or num_tokens is None:
            return {}
        try:
            return kind_units(specs, getattr(cache, "state_of", {}) or {}, [str(getattr(t, "value", t)) for t in types],
                              state_indices, num_tokens=num_tokens, kv_pages=pages, page_size=self.kv_mgr.page_size,
                              request_row=self.request_row)
        except KVBridgeError as exc:
            self.fail(f"{exc.reason}: send_metadata cannot be handed to the room")
            return None

    def _room_state(self) -> int:
        state = self._handle.poll()
        if state == KVPoll.Failed and not self._handle.pages_releasable:
            return int(KVPoll.Transferring)  # a write may still land in these pages (hard rule 6)
        return int(state)

    @property
    def pages_releasable(self) -> bool:
        """True when no write of this room can land in its pages any more."""
        return self._handle is None or self._handle.pages_releasable

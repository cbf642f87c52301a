"""The decode rank's rooms, driven by the DecodeEndpoint loop (every method runs with the
endpoint's lock held; sockets go through ``ep.send``). The prefill peers the rooms talk to,
and their liveness, are in ``decode_liveness``. A loop that was itself frozen blames no
peer for the silence it did not listen to (``tick``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.errors import KVBridgeError, LayoutError, LedgerError, RoomInUse
from kvbridge.layout import TPRoute, tp_route
from kvbridge.transfer.channel import wire
from kvbridge.transfer.decode_liveness import Peer, PeerLiveness
from kvbridge.transfer.digest import page_digests
from kvbridge.transfer.lifecycle import Stage
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.receiver import Placement, RecvRoom

if TYPE_CHECKING:
    from kvbridge.bootstrap.schemas import LookupResponse
    from kvbridge.transfer.decode import DecodeEndpoint

log = logging.getLogger(__name__)

SCAN_S = 0.02  # every room is looked at on this period; events in between touch only their room
REFRESH_IDLE_S = 30.0  # a cached topology used within this long is refreshed before it expires
ABORT_RESEND_S = 1.0  # a failed room re-sends its Abort to ranks not yet quiet
MAX_PLACEMENTS = 1024  # DP groups whose last look-up answer is kept placed for our TP route


class RoomBook(PeerLiveness):
    def __init__(self, ep: DecodeEndpoint) -> None:
        self.ep = ep
        self.cfg = ep.config
        self.rooms: dict[int, RecvRoom] = {}
        self.peers: dict[str, Peer] = {}
        self.cache: dict[tuple[str, int], tuple[float, LookupResponse]] = {}
        self.dp_sizes: dict[str, int] = {}
        self.lookups_in_flight: set[tuple[str, int | None]] = set()  # rooms of a group wait for its one look-up
        self.refusals: dict[str, tuple[float, str, list[Any]]] = {}  # instance -> (when, reason, diff) of a 409
        self.cache_used: dict[tuple[str, int], float] = {}  # when a room last took a cached topology
        self.dirty: set[int] = set()  # rooms to advance at the next step
        self.next_scan = 0.0
        self.last_scan = 0.0
        self.page_size = next(iter(ep.specs.values())).page_size
        self.pools = sorted(ep.specs)
        self.routes: dict[int, TPRoute] = {}  # prefill tp size -> this rank's TP route
        self.placements: dict[tuple[str, int], Placement] = {}  # (instance, DP group) -> its last answer, placed
        self.released: deque[RecvRoom] = deque()  # rooms whose KVReceiver was dropped (appended without the lock)
        self.draining: set[int] = set()  # rooms whose handle let go: forgotten once final and quiet
        self.results: deque[Callable[[], None]] = deque()  # pool-thread results, applied by the loop

    # -- rooms from the engine --------------------------------------------------

    def open(self, room: int, prefill_instance: str, dp_rank: int | None) -> RecvRoom:
        old = self.rooms.get(room)
        if old is not None:  # OPEN or DRAINING: closed rooms are forgotten
            what = ("open: a KVReceiver still holds it" if old.life.stage == Stage.OPEN
                    else "draining: a prefill rank may still write its pages (hard rule 6)")
            raise RoomInUse(f"room {room} is {what} ({old.state.state.name}); close() the old receiver and wait "
                            "(receiver(room, ..., wait=...)), or use a new room id",
                            draining=old.life.stage == Stage.DRAINING, room=room, rank=self.cfg.rank_label,
                            field="room")
        r = self.rooms[room] = RecvRoom(room, prefill_instance, dp_rank)
        self.dirty.add(room)
        cached = self._cached(r)
        if cached is not None:
            self.topology_ready(r, cached)
        return r

    def close(self, r: RecvRoom) -> None:
        """The engine let go of the room: fail it if unfinished; forget it once quiet."""
        if r.life.stage != Stage.OPEN:
            return
        r.life.to(Stage.DRAINING)
        self.draining.add(r.room)
        self.fail(r, f"the engine closed room {r.room}'s receiver on {self.cfg.rank_label} before it finished",
                  level=logging.INFO)  # the engine's own decision: not a warning
        self.forget_if_quiet(r)

    def forget_if_quiet(self, r: RecvRoom) -> None:
        if r.life.stage != Stage.DRAINING or not r.state.final or not r.pages_releasable:
            return
        r.life.to(Stage.CLOSED)
        self.draining.discard(r.room)
        if self.rooms.get(r.room) is r:
            del self.rooms[r.room]
        self.ep._room_freed.notify_all()  # receiver(room, ..., wait=...) may open it now
        for s in r.senders.values():
            p = self.peers.get(s.control_endpoint)
            if p is not None:
                p.rooms.discard(r.room)

    def init(self, r: RecvRoom, pages: np.ndarray, aux_slot: int, num_tokens: int | None, first_page: int) -> None:
        if r.initialised:
            raise LayoutError("init() called twice", room=r.room, rank=self.cfg.rank_label, field="page_ids")
        if r.state.final:  # failed meanwhile (closed, timed out): poll() says why
            return
        r.page_ids, r.aux_slot, r.first_page = pages, aux_slot, first_page
        self.dirty.add(r.room)
        if num_tokens is not None:
            self.learn_num_tokens(r, num_tokens)

    def learn_num_tokens(self, r: RecvRoom, num_tokens: int, source: str = "init()") -> None:
        """The request's token count (from init(), or from the prefill rank with the aux row): it must
        end inside the last page, and agree with what is known."""
        if r.num_tokens is not None:
            if num_tokens != r.num_tokens:
                raise LedgerError(f"{source} says {num_tokens} tokens, the room has {r.num_tokens}", room=r.room,
                                  rank=self.cfg.rank_label, field="num_tokens")
            return
        low, high = (r.num_pages - 1) * self.page_size + 1, r.num_pages * self.page_size
        if not low <= num_tokens <= high:
            raise LedgerError(f"{source} says {num_tokens} tokens, outside [{low}, {high}] for a request of "
                              f"{r.num_pages} pages", room=r.room, rank=self.cfg.rank_label, field="num_tokens")
        r.num_tokens = num_tokens
        tokens = num_tokens - min(num_tokens, r.first_page * self.page_size)
        r.bytes_expected = sum(s.bytes_per_token * s.num_layers for s in self.ep.specs.values()) * tokens

    def lookup_key(self, r: RecvRoom) -> tuple[str, int | None]:
        """(instance, DP group) of a room; the group is None until the instance's dp_size is known."""
        dp = r.dp_rank
        if dp is None and r.prefill_instance in self.dp_sizes:
            dp = r.room % self.dp_sizes[r.prefill_instance]
        return r.prefill_instance, dp

    def _cached(self, r: RecvRoom) -> LookupResponse | None:
        key = self.lookup_key(r)
        hit = self.cache.get(key) if key[1] is not None else None
        now = time.monotonic()
        if hit and now - hit[0] < self.cfg.topology_ttl:
            self.cache_used[key] = now
            return hit[1]  # shared by the group's rooms, not copied per room (its ``room``: the one that looked up)
        return None

    def refresh_ahead(self, now: float) -> None:
        """Look up again, off the loop, every DP group whose cached topology is half way to expiry and
        that a room used lately: a room then never waits for a look-up (a few ms) only because the
        last room of its group came more than ``topology_ttl`` ago. Idle groups expire as before."""
        for key, (when, _) in list(self.cache.items()):
            if now - when < self.cfg.topology_ttl / 2 or key in self.lookups_in_flight:
                continue
            if now - self.cache_used.get(key, when) <= REFRESH_IDLE_S:
                self.ep.refresh_async(key)

    def refreshed(self, key: tuple[str, int], topo: LookupResponse | None) -> None:
        """A refresh's answer. A failed one changes nothing: the entry expires as it would have, and
        the next room looks up itself (meeting the error, or using ``stale`` while the daemon is away)."""
        self.lookups_in_flight.discard(key)
        if topo is not None and key in self.cache:
            self.cache[key] = (time.monotonic(), topo)
        self.wake_waiting(key[0])

    def stale(self, r: RecvRoom) -> LookupResponse | None:
        """The last answer for the room's DP group however old (the daemon is unreachable)."""
        key = self.lookup_key(r)
        hit = self.cache.get(key) if key[1] is not None else None
        return None if hit is None else hit[1]

    def topology_ready(self, r: RecvRoom, topo: LookupResponse, fresh: bool = False) -> None:
        """Use a topology; only a ``fresh`` answer from the daemon (re)starts the cache's clock,
        so under steady traffic the cache still expires every ``topology_ttl``."""
        if topo.topology.pp_size != 1:  # (the daemon keeps every rank's pp_rank below its pp_size)
            self.fail(r, f"prefill instance {r.prefill_instance!r} has pp_size {topo.topology.pp_size}; "
                         "pipeline-parallel prefill is not supported yet")
            return
        try:
            r.set_topology(self.placement(topo, self.route(topo.topology.tp_size), r.room))
        except KVBridgeError as exc:
            self.fail(r, f"prefill instance {r.prefill_instance!r} ({topo.topology.shape}): {exc.reason}")
            return
        if fresh:
            self.cache[(topo.instance, topo.dp_rank)] = (time.monotonic(), topo)
            self.refusals.pop(topo.instance, None)
            self.dp_sizes[topo.instance] = topo.topology.dp_size
        r.state.to(KVPoll.WaitingForInput)
        r.mark_bootstrapped()
        self.dirty.add(r.room)

    def placement(self, topo: LookupResponse, route: TPRoute, room: int) -> Placement:
        """The senders of ``topo`` for ``route``, placed once per look-up answer (TopologyError: the
        answer lacks a sender the route needs; nothing is kept then)."""
        key = (topo.instance, topo.dp_rank)  # one kept per DP group: a newer answer replaces it
        hit = self.placements.get(key)
        if hit is None or hit.topology is not topo or hit.route is not route:
            if key not in self.placements and len(self.placements) >= MAX_PLACEMENTS:
                self.placements.clear()
            hit = self.placements[key] = Placement.of(topo, route, room)
        return hit

    def route(self, prefill_tp: int) -> TPRoute:
        """Which prefill TP ranks send this rank what (TopologyError when the heads do not split)."""
        hit = self.routes.get(prefill_tp)
        if hit is None:
            hit = self.routes[prefill_tp] = tp_route(self.ep.specs, prefill_tp, self.cfg.tp_size, self.cfg.tp_rank)
        return hit

    def wake_waiting(self, instance: str) -> None:
        self.dirty.update(k for k, r in self.rooms.items()
                          if r.state.state == KVPoll.Bootstrapping and r.prefill_instance == instance)

    def refuse(self, r: RecvRoom) -> None:
        """Fail a room toward an instance whose contract differs (hard rule 7), keeping the diff."""
        _, reason, diff = self.refusals[r.prefill_instance]
        r.mismatch = list(diff)
        self.fail(r, reason)

    # -- failing and quiescence -------------------------------------------------

    def fail(self, r: RecvRoom, reason: str, level: int = logging.WARNING) -> None:
        if r.state.final:
            return
        r.state.to(KVPoll.Failed, reason)
        r.mark_bootstrapped()  # wait_bootstrapped() returns (and says why) instead of waiting on
        log.log(level, "room %d on %s failed: %s", r.room, self.cfg.rank_label, reason)
        if r.initialised:
            # pages are assigned: every sender of the DP group must stop before they are freed, also one
            # not asked yet, which another decode rank of this instance may have asked (its ranks free
            # pages together); an abort fails the room for every decode rank there, acked once quiet
            for key, s in r.senders.items():
                if key not in r.requested:
                    r.requested.add(key)
                    self._peer(s, r.prefill_instance).rooms.add(r.room)
        self._send_aborts(r)

    def _send_aborts(self, r: RecvRoom) -> None:
        for key in sorted(r.requested - r.quiet - r.abort_sent):
            s = r.senders[key]
            self.ep.send(s.control_endpoint, wire.Abort(room=r.room, decode_rank=self.cfg.rank_label,
                                                        reason=r.state.reason or "aborted"))
            r.abort_sent.add(key)
        r.last_abort = time.monotonic()

    def unquiet(self) -> bool:
        return any(r.state.state == KVPoll.Failed and not r.pages_releasable for r in self.rooms.values())

    # -- messages from prefill ranks --------------------------------------------

    def on_message(self, endpoint: str, msg: Any) -> None:
        peer = self.peers.get(endpoint)
        if peer is not None:
            peer.last_seen = time.monotonic()
        if isinstance(msg, KVBridgeError):
            log.warning("bad control message from %s: %s", endpoint, msg)
            return
        if isinstance(msg, wire.Heartbeat):
            return
        r = self.rooms.get(getattr(msg, "room", None))
        if r is None:
            if isinstance(msg, wire.ErrorReply):
                log.warning("prefill %s refused a %s: %s", endpoint, msg.ref_type, msg.reason)
            return
        cp = getattr(msg, "cp_rank", None)
        key = r.by_endpoint.get(endpoint)  # (cp, tp) of the sender on that connection
        if cp is not None and (key is None or key[0] != cp):
            self.fail(r, f"message from {endpoint} claims cp rank {cp}, which the topology does not place there")
            return
        try:
            self._dispatch(r, endpoint, key, msg)
        except KVBridgeError as exc:  # ledger violations and the like fail the room, never the loop
            self.fail(r, str(exc))
        self._maybe_commit(r)

    def _dispatch(self, r: RecvRoom, endpoint: str, key: tuple[int, int] | None, msg: Any) -> None:
        if isinstance(msg, wire.PagesDone) and msg.status == "ok" and not r.state.final:  # the common case first
            if self.ep.trace:
                log.info("trace room=%d rank=%s +%.2fms @%.6f report from cp%d pages=%d%s", r.room, self.cfg.rank_label,
                         r.age_ms, time.monotonic(), msg.cp_rank, len(msg.logical_pages) // 4, " +aux" if msg.aux else "")
            if msg.logical_pages:
                pages = np.frombuffer(msg.logical_pages, dtype="<i4")  # (decoding checked: whole int32s)
                r.ledger.record(msg.cp_rank, msg.pools, pages, tp_rank=key[1])
                if self.cfg.verify_digest:
                    if msg.digests is None:
                        raise LedgerError("digest check is on but the prefill rank sent no digests", room=r.room,
                                          rank=f"cp{msg.cp_rank}", field="digests")
                    r.digests.append((pages, np.frombuffer(msg.digests, dtype=np.uint64)))
            if msg.aux:  # the same write carried the aux row
                r.ledger.record_aux(msg.cp_rank, tp_rank=key[1])
                if msg.num_tokens and msg.num_tokens != r.num_tokens:
                    self.learn_num_tokens(r, msg.num_tokens, f"{self._label(msg, endpoint, key)} (with the aux row)")
        elif isinstance(msg, wire.AbortAck):
            r.quiet.add(key)
        elif isinstance(msg, wire.ErrorReply):
            if msg.ref_type == wire.TransferRequest.TAG:
                r.quiet.update(k for k, s in r.senders.items() if s.control_endpoint == endpoint)
            self.fail(r, f"{self._label(msg, endpoint, key)} refused our {msg.ref_type}: {msg.reason}")
        elif r.state.final:
            if getattr(msg, "status", "ok") == "failed":
                r.quiet.add(key)  # a failure report means its writes have drained
        elif isinstance(msg, wire.PagesDone):  # failed
            r.quiet.add(key)
            self.fail(r, f"{self._label(msg, endpoint, key)}: {msg.reason}")

    @staticmethod
    def _label(msg: Any, endpoint: str, key: tuple[int, int] | None) -> str:
        tp = f"/tp{key[1]}" if key is not None and key[1] else ""
        return f"prefill cp rank {getattr(msg, 'cp_rank', '?')}{tp} ({endpoint})"

    def _maybe_commit(self, r: RecvRoom) -> None:
        if r.state.final or r.ledger is None or not r.ledger.complete:
            return
        schema = self.ep.aux_schema
        read_at = time.monotonic()
        try:
            row = self.ep.aux.read_row(r.aux_slot)  # one copy to the host (a device row: one synchronisation)
            read_ms = (time.monotonic() - read_at) * 1e3
            echoed, problem = schema.head(row)  # what unpacking would refuse fails the room now; decoding waits
        except KVBridgeError as exc:
            self.fail(r, f"aux row in slot {r.aux_slot} is unreadable: {exc}")
            return
        if echoed != r.room:  # hard rule 4: a row written for another room
            self.fail(r, f"aux row in slot {r.aux_slot} carries room {echoed}, expected {r.room}")
            return
        if problem is not None:
            self.fail(r, f"aux row in slot {r.aux_slot} is unreadable: {problem}")
            return
        if self.cfg.verify_digest:
            if r.num_tokens is None:
                self.fail(r, "cannot check page digests: neither init() nor the prefill rank said the token count")
                return
            bad = self._digest_mismatch(r)
            if bad is not None:
                self.fail(r, f"digest mismatch on logical page {bad}: bytes differ from what prefill sent")
                return
        r.keep_aux_row(row, schema)
        r.state.advance_to(KVPoll.Success)
        if self.ep.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.6f committed pages_by_rank=%s aux_owner=cp%d aux_read=%.3fms",
                     r.room, self.cfg.rank_label, r.age_ms, time.monotonic(),
                     dict(sorted(r.ledger.pages_by_rank.items())), r.ledger.aux_owner, read_ms)

    def _digest_mismatch(self, r: RecvRoom) -> int | None:
        pages = np.concatenate([p for p, _ in r.digests])
        sent = np.concatenate([d for _, d in r.digests])
        mine = page_digests(self.ep.specs, self.ep.buffers.tensors, self.pools, pages, r.page_ids[pages - r.first_page],
                            r.num_tokens)
        bad = np.flatnonzero(mine != sent)
        return int(pages[bad[0]]) if bad.size else None

    # -- periodic work ----------------------------------------------------------

    def tick(self, now: float) -> None:
        while self.results:
            self.results.popleft()()
        while self.released:
            self.close(self.released.popleft())
        if now < self.next_scan:  # between scans only the rooms something happened to: O(events)
            while self.dirty:
                r = self.rooms.get(self.dirty.pop())
                if r is not None:
                    self._advance(r, now)
            return
        if self.last_scan and now - self.last_scan > self.cfg.peer_timeout / 2:
            # this loop itself was frozen (SIGSTOP, a stalled host): it heard nothing because it
            # listened to nothing, so no peer is blamed for the gap
            for p in self.peers.values():
                p.last_seen = max(p.last_seen, now)
        self.last_scan = now
        self.next_scan = now + SCAN_S  # every room: deadlines, retries, pings, liveness, forgetting
        self.dirty.clear()
        for r in list(self.rooms.values()):
            self._advance(r, now)
        self._liveness(now)
        self.refresh_ahead(now)
        for room in list(self.draining):
            r = self.rooms.get(room)
            if r is None:
                self.draining.discard(room)
            else:
                self.forget_if_quiet(r)

    def _advance(self, r: RecvRoom, now: float) -> None:
        st = r.state.state
        if st == KVPoll.Bootstrapping:
            if r.state.since() > self.cfg.bootstrap_timeout:
                self.fail(r, f"no prefill topology for instance {r.prefill_instance!r} within "
                             f"{self.cfg.bootstrap_timeout:.1f}s (bootstrap timeout)"
                             + (f"; last answer: {r.lookup_problem}" if r.lookup_problem else ""))
            elif not r.lookup_pending and now >= r.next_lookup:
                cached = self._cached(r)
                refused = self.refusals.get(r.prefill_instance)
                if cached is not None:
                    self.topology_ready(r, cached)
                elif refused is not None and now - refused[0] < self.cfg.topology_ttl:
                    self.refuse(r)
                elif self.lookup_key(r) not in self.lookups_in_flight:  # one look-up per DP group at a time
                    self.ep.lookup_async(r)
        elif st == KVPoll.WaitingForInput:
            if r.initialised:
                self._request(r)
            elif r.state.since() > self.cfg.waiting_timeout:
                self.fail(r, f"init() not called within {self.cfg.waiting_timeout:.1f}s (waiting timeout)")
        elif st == KVPoll.Transferring and r.state.since() > self.cfg.transfer_timeout:
            self.fail(r, f"not complete within {self.cfg.transfer_timeout:.1f}s (transfer timeout); "
                         f"missing {r.ledger.missing()}{'' if r.ledger.aux_done else ' and the aux row'}")
        elif st == KVPoll.Failed and not r.pages_releasable and now - r.last_abort >= ABORT_RESEND_S:
            r.abort_sent.clear()  # aborts are idempotent: ask again until every rank is quiet
            self._send_aborts(r)

    def request_if_ready(self, r: RecvRoom) -> bool:
        """Send the room's requests now if its topology is known and init() was called (any thread)."""
        if r.state.state != KVPoll.WaitingForInput or not r.initialised:
            return False
        self.dirty.discard(r.room)
        self._request(r)
        return True

    def _request(self, r: RecvRoom) -> None:
        """Send the TransferRequest to every sender of the prefill DP group: each CP rank, and
        in it each TP rank of this rank's TP route, for the pools that route takes from it (from
        the loop thread, or from the engine's thread in init())."""
        page_ids = r.page_ids.astype("<i4").tobytes()  # init() checked them inside int32 (registered pages)
        frames: dict[tuple[str, ...], bytes] = {}  # the CP ranks of one TP source get the same request: encoded once
        for key, s, pools in r.placement.asks:
            frame = frames.get(pools)
            if frame is None:
                frame = frames[pools] = self.ep.encode(wire.TransferRequest(
                    room=r.room, decode_rank=self.cfg.rank_label, decode_rank_id=self.ep.rank_id, page_ids=page_ids,
                    first_page=r.first_page, pools=list(pools), aux_slot=r.aux_slot, num_tokens=r.num_tokens or 0,
                    deadline_ms=int(self.cfg.transfer_timeout * 1000), want_digest=self.cfg.verify_digest,
                    fingerprint=r.topology.fingerprint, num_decode_ranks=self.cfg.tp_size,
                ))
            self.ep.send_frame(s.control_endpoint, frame)
        # the books after the requests went out, while they travel (the lock is held: no report of this
        # room is handled before they are written)
        r.start_ledger(self.pools, self.page_size)
        now = time.monotonic()
        for key, s, _ in r.placement.asks:
            peer = self._peer(s, r.prefill_instance)
            if not self._any_active(peer):  # liveness restarts now: a quiet spell between rooms is no death
                peer.last_seen = max(peer.last_seen, now)
            peer.rooms.add(r.room)
            r.requested.add(key)
        r.state.to(KVPoll.Transferring)
        if self.ep.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.6f requested from cp ranks %s", r.room, self.cfg.rank_label, r.age_ms, time.monotonic(),
                     sorted(r.requested))



"""What SGLang's sender and receiver share on kvbridge: one room handle, the request it is
bound to, a local failure and its reason, the retry of a room id still draining, and SGLang's error.

    sign      with KVBRIDGE_ROOM_KEY, the room id must be a signed room id (kvbridge.check_room_id:
              its tag, its expiry), checked when the handle is made: prefill before it opens the
              room, decode before it claims it; refused by name, nothing opened, written or read
    open      ep.sender(room) / ep.receiver(room, ...); RoomInUse on a draining id (the previous
              room's writes are still in flight) is retried from poll() for the bootstrap timeout
    bind      bind_request(req), right after SGLang made the handle (patches.py wraps the queue
              method that makes it): the digest of the request's prompt token ids and their count
              (kvbridge.room_binding). Prefill binds the room to it when it opens; decode presents
              it, and the count, with its claim: a room of another request refuses the claim at once
    fail      a local failure (a request kvbridge cannot move): the reason, and the handle aborted
    raise     failure_exception(): SGLang's KVTransferError, naming this rank and the cause; a rank
              that did not fail itself says so (is_from_another_rank: the MIN of its peers failed)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError

from kvbridge import KVBridgeError, RoomInUse, check_room_id, room_binding

log = logging.getLogger(__name__)


class RoomHandle:
    """Mixed into ``KVBridgeKVSender`` / ``KVBridgeKVReceiver`` (before SGLang's base class)."""

    role = ""  # "prefill" | "decode"

    def _start(self, mgr: Any, room: int) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = int(room)
        self.conclude_state: int | None = None
        self._handle: Any = None  # kvbridge's KVSender / KVReceiver
        self._failure: str | None = None
        self._retry_until = 0.0  # a draining room id is retried from poll() until then
        self.binding = b""  # the request's digest (bind_request); b"": not bound
        self.num_tokens: int | None = None  # the request's prompt tokens, once bound
        self.request: Any = None  # SGLang's Req, once bound (its request row: request_row)
        self._counted = False

    def _unsigned(self) -> str | None:
        """Why this room id may not be served under the cluster's room key (None: it may, or no key)."""
        key = self.kv_mgr.settings.room_key
        if not key:
            return None
        try:
            check_room_id(key, self.bootstrap_room, time.time())
        except KVBridgeError as exc:
            return f"{exc}; refused, nothing opened, written or read"
        return None

    def bind_request(self, req: Any) -> None:
        """Bind this handle to SGLang's request: the digest of ``req.origin_input_ids`` (a request
        given as embeddings has placeholder ids of its length: the digest then binds the count)."""
        self.request = req
        ids = getattr(req, "origin_input_ids", None)
        if ids is None or len(ids) == 0:
            return
        self.num_tokens = len(ids)
        self.binding = room_binding(ids, self.num_tokens)
        self._bound()

    @property
    def request_row(self) -> int | None:
        """The request's row in SGLang's request pool (``req.kv.req_pool_idx``) once bound and
        allocated; None before."""
        row = getattr(getattr(self.request, "kv", None), "req_pool_idx", None)
        return None if row is None else int(row)

    def _bound(self) -> None:
        """What a side does once it knows the binding (prefill: bind its open room)."""

    @property
    def label(self) -> str:
        return self.kv_mgr.settings.label

    def _open_with(self, open_room: Callable[[], Any]) -> None:
        try:
            self._handle = open_room()
            self._retry_until = 0.0
            if self.binding:
                self._bound()
        except RoomInUse as exc:
            timeout = self.kv_mgr.settings.bootstrap_timeout
            if not exc.draining:
                self.fail(str(exc))
            elif not self._retry_until:
                self._retry_until = time.monotonic() + timeout
            elif time.monotonic() > self._retry_until:
                self.fail(f"{exc} (still draining after {timeout:.0f}s)")
        except KVBridgeError as exc:
            self.fail(str(exc))

    @property
    def _retrying(self) -> bool:
        return self._handle is None and self._failure is None and bool(self._retry_until)

    def _open(self) -> None:
        raise NotImplementedError

    idle_state = KVPoll.Bootstrapping  # what a rank reports with no kvbridge room (yet, or at all)

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._retrying:
            self._open()
        if self._handle is None:
            if self._failure is not None:
                return int(KVPoll.Failed)
            return int(KVPoll.Bootstrapping if self._retrying else self.idle_state)
        return self._room_state()

    def _room_state(self) -> int:
        return int(self._handle.poll())

    def fail(self, reason: str) -> None:
        """Fail the request on this rank with ``reason``; kvbridge stops its writes first."""
        if self._failure is None:
            self._failure = reason
            log.warning("room %d on %s: %s", self.bootstrap_room, self.label, reason)
        if self._handle is not None:
            self._handle.abort(reason)

    def abort(self) -> None:
        self.fail("aborted by SGLang (AbortReq)")

    def clear(self) -> None:
        if self._handle is not None:
            self._handle.close()

    def failure_exception(self) -> None:
        reason = self._failure or (self._handle.failure_reason if self._handle is not None else None)
        self.conclude_state = int(KVPoll.Failed)
        self.clear()
        if reason is not None and not self._counted:  # SGLang asks once per failed request and rank
            self._counted = True
            self.kv_mgr.counters.count(reason)
        if reason is None:
            raise KVTransferError(self.bootstrap_room, f"failed on another rank (kvbridge {self.role} rank "
                                  f"{self.label} itself did not fail)", is_from_another_rank=True)  # fmt: skip
        raise KVTransferError(self.bootstrap_room, f"kvbridge {self.role} rank {self.label}: {reason}")

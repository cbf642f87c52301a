"""The connector's scheduler side: one per vLLM engine (EngineCore), no I/O.

It follows vLLM's P/D request flow and turns it into per-step metadata for the
workers (``meta.py``); the bytes move on the worker side.

    prefill (kv_producer)                            decode (kv_consumer)
    update_state_after_alloc: do_remote_decode       get_num_new_matched_tokens: do_remote_prefill
      -> the request's room (kvbridge_room given,      -> the prompt's tokens beyond the local
         else drawn from the request id)                  prefix hit, loaded asynchronously
    build_connector_meta: each scheduled step's      update_state_after_alloc: the pages after the
      newly computed pages (chunked prefill sends       hit (only the missing blocks move)
      as it goes), the last with the prompt's end    build_connector_meta: the Receive, once
    request_finished: blocks held until the room     request_finished: a room still in flight is
      is final (finished_sending); the params for       aborted, its blocks held until no write
      decode (PARAMS_TO_DECODE)                         can land (finished_recving)

A request's blocks are freed exactly once: vLLM frees them when ``request_finished``
returns False, else when a worker reports the request finished (every worker of the
engine: vLLM's output aggregator waits for all of them).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from kvbridge.integrations.vllm.meta import KVBridgeMetadata, Receive, SendChunk
from kvbridge.integrations.vllm.settings import Settings

ROOM, INSTANCE, NUM_TOKENS = "kvbridge_room", "kvbridge_instance", "kvbridge_num_tokens"
MAX_ROOM = (1 << 63) - 1


def room_of(request_id: str) -> int:
    """A 63-bit room id drawn from vLLM's request id (unique per cluster as request ids are)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") & MAX_ROOM or 1


def requested_room(params: dict[str, Any], request_id: str) -> int:
    room = params.get(ROOM)
    if room is None:
        return room_of(request_id)
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise ValueError(f"kv_transfer_params.{ROOM} {room!r} is not an integer in [0, 2**63)")
    return room


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Send:
    request: Any
    room: int
    num_tokens: int
    sent_pages: int = 0  # pages handed to the workers so far
    opened: bool = False  # a chunk reached the workers: their senders exist
    done: bool = False  # the last chunk reached them


class SchedulerSide:
    def __init__(self, settings: Settings, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.is_prefill = settings.role == "prefill"
        self.kv_cache_manager: Any = None
        self._sends: dict[str, _Send] = {}  # prefill: requests whose room is open or to open
        self._held: set[str] = set()  # blocks kept after request_finished, until a worker reports
        self._receives: list[Receive] = []  # decode: to hand out in the next metadata
        self._receiving: set[str] = set()  # decode: handed out, not reported finished yet
        self._aborts: list[str] = []

    # -- decode ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.is_prefill or not params or not params.get("do_remote_prefill") or ROOM not in params:
            return 0, False
        count = int(request.num_prompt_tokens) - int(num_computed_tokens)
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if self.is_prefill:
            if params.get("do_remote_decode") and request.request_id not in self._sends:
                try:
                    room = requested_room(params, request.request_id)
                except ValueError:
                    return  # not a kvbridge room: the request runs without a transfer
                self._sends[request.request_id] = _Send(request, room, int(request.num_prompt_tokens))
            return
        if not params.get("do_remote_prefill") or ROOM not in params:
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:
            return
        req_id = request.request_id
        local = int(request.num_prompt_tokens) - int(num_external_tokens)
        block_ids = list(blocks.get_block_ids()[0])
        error = ""
        try:
            room = requested_room(params, req_id)
            instance = str(params.get(INSTANCE) or "")
            if not instance:
                raise ValueError(f"kv_transfer_params.{INSTANCE} is missing (pass on what prefill returned)")
        except ValueError as exc:
            room, instance, error = 0, "", str(exc)
        if not error and local % self.block_size:
            error = (f"decode's local prefix hit of {local} tokens is not whole blocks of {self.block_size}: "
                     "kvbridge moves the blocks after a block-aligned prefix")
        first = local // self.block_size
        pages = tuple(block_ids[first:cdiv(int(request.num_prompt_tokens), self.block_size)])
        self._receives.append(Receive(req_id, room, instance, pages, first, error))

    # -- both ------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        meta = KVBridgeMetadata(aborts=self._aborts)
        self._aborts = []
        if not self.is_prefill:
            meta.receives, self._receives = self._receives, []
            self._receiving.update(r.req_id for r in meta.receives)
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, s in self._sends.items():
            if s.done or req_id not in scheduled:
                continue
            ready = min(int(s.request.num_computed_tokens) + int(scheduled[req_id]), s.num_tokens)
            is_last = ready >= s.num_tokens
            upto = cdiv(ready, self.block_size)
            if upto <= s.sent_pages and not is_last:
                continue
            block_ids = self._block_ids(req_id, scheduler_output)
            meta.sends.append(SendChunk(req_id, s.room, tuple(block_ids[s.sent_pages:upto]), s.sent_pages, ready,
                                        s.num_tokens, is_last))
            s.sent_pages, s.opened, s.done = upto, True, is_last
        return meta

    def _block_ids(self, req_id: str, scheduler_output: Any) -> list[int]:
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        ids = state.get_block_ids(req_id) if state is not None else None
        if ids is None:
            ids = self.kv_cache_manager.get_block_ids(req_id)
        return list(ids[0])

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if self.is_prefill:
            s = self._sends.pop(req_id, None)
            if s is None or not s.opened:
                return False, None  # no worker holds a room of it
            self._held.add(req_id)
            if s.done and not _aborted(request):
                return True, {"do_remote_prefill": True, "do_remote_decode": False, ROOM: s.room,
                              INSTANCE: self.settings.instance, NUM_TOKENS: s.num_tokens}
            self._aborts.append(req_id)
            return True, None
        pending = [r for r in self._receives if r.req_id == req_id]
        if pending:  # never handed out: nothing was asked of prefill
            self._receives = [r for r in self._receives if r.req_id != req_id]
            return False, None
        if req_id in self._receiving:  # in flight: abort, free once no write can land
            self._aborts.append(req_id)
            self._held.add(req_id)
            return True, None
        return False, None

    def update_connector_output(self, output: Any) -> None:
        for req_id in output.finished_recving or ():
            self._receiving.discard(req_id)
            self._held.discard(req_id)
        for req_id in output.finished_sending or ():
            self._held.discard(req_id)

    @property
    def has_pending_work(self) -> bool:
        """Blocks held for a room: the engine must keep stepping so workers report them."""
        return bool(self._held) or bool(self._aborts)


def _aborted(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR) \
        if hasattr(RequestStatus, "FINISHED_ERROR") else request.status == RequestStatus.FINISHED_ABORTED

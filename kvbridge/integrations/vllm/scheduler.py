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

A room is bound to its request: prefill opens it with the digest of the prompt's token ids
(``kvbridge.room_binding``) and decode presents the digest of its own prompt with the claim, so
a room id taken from another request, or a longer prompt ending in the same block, is refused
by prefill at once with nothing written. Before anything is loaded decode also checks its prompt's
token count against ``kvbridge_num_tokens``; with ``room_key`` the params prefill returns are
signed (room, expiry, binding) and decode refuses them unsigned, forged or expired, and a
router-chosen ``kvbridge_room`` must carry the router's signature. A room id already open on this
engine is refused before the request runs (fallback params returned: never another request's room).
Every refusal is counted by reason (``refusals``) and logged.

Nothing needed, and fallbacks. A decode request that needs nothing of its room (a local prefix
hit of the whole prompt, ``prompt_logprobs``, which vLLM computes locally, or a request that
finished before it loaded) releases it: the workers tell prefill at once (``ReleaseRoom``), and
prefill frees the room's blocks then, not after ``target_timeout``. A prefill request whose room
was refused (here, or by a worker: the room did not open, a send failed; ``KVBridgeWorkerMeta``)
is answered with fallback params (``kvbridge_fallback``: the reason; no room, no
``do_remote_prefill``): decode then computes the prompt itself. A worker's refusal reaches vLLM's
scheduler in the same step's output as the request's end, but after ``request_finished``: the
params returned in that step are rewritten in place by ``update_connector_output``, which runs
before the step's outputs leave the engine core. Every fallback is counted by reason.

A request's blocks are freed exactly once: vLLM frees them when ``request_finished``
returns False, else when a worker reports the request finished (every worker of the
engine: vLLM's output aggregator waits for all of them).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvbridge import KVBridgeError, room_binding, sign_room, verify_room
from kvbridge.integrations.vllm.hybrid import GroupLayout, window_gap
from kvbridge.integrations.vllm.meta import KVBridgeMetadata, KVBridgeWorkerMeta, Receive, ReleaseRoom, SendChunk
from kvbridge.integrations.vllm.settings import Settings
from kvbridge.integrations.vllm.stats import KVBridgeStats

log = logging.getLogger(__name__)

ROOM, INSTANCE, NUM_TOKENS = "kvbridge_room", "kvbridge_instance", "kvbridge_num_tokens"
BACKED_OFF = "_kvbridge_backed_off"  # prefill, Mamba: the prompt's last token was dropped (once: preemption)
SIG, EXPIRES = "kvbridge_room_sig", "kvbridge_room_expires"
FALLBACK = "kvbridge_fallback"  # prefill's params: why no room (decode computes the prompt itself)
MAX_ROOM = (1 << 63) - 1


def prompt_binding(request: Any) -> bytes:
    """The digest of the request's prompt (token ids and count); b"" for a prompt given as
    embeddings (no ids: the room is then unbound)."""
    ids, n = getattr(request, "prompt_token_ids", None), int(request.num_prompt_tokens)
    return room_binding(ids, n) if ids is not None and n > 0 else b""


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
    binding: bytes = b""
    claim: int = 0  # the prompt's tokens decode's claim must match (Mamba: num_tokens + 1; 0: num_tokens)
    sent_pages: int = 0  # pages handed to the workers so far
    opened: bool = False  # a chunk reached the workers: their senders exist
    done: bool = False  # the last chunk reached them


class SchedulerSide:
    def __init__(self, settings: Settings, block_size: int, groups: GroupLayout | None = None) -> None:
        self.settings = settings
        self.block_size = block_size
        self.groups = groups  # hybrid manager: the paged group and the window groups (hybrid.py)
        self._local: dict[str, str] = {}  # decode, hybrid: request -> why decode computes it (no room moved)
        self._whole: dict[str, tuple[bytes, int]] = {}  # prefill, Mamba: request -> (binding, n) before backoff
        self.is_prefill = settings.role == "prefill"
        self.kv_cache_manager: Any = None
        self._sends: dict[str, _Send] = {}  # prefill: requests whose room is open or to open
        self._held: set[str] = set()  # blocks kept after request_finished, until a worker reports
        self._receives: list[Receive] = []  # decode: to hand out in the next metadata
        self._receiving: set[str] = set()  # decode: handed out, not reported finished yet
        self._aborts: list[str] = []
        self._open_rooms: dict[int, str] = {}  # prefill: room -> the request whose room it is, until freed
        self._room_of: dict[str, int] = {}
        self.refusals: Counter[str] = Counter()  # reason -> requests refused a transfer or computed locally
        self._releases: list[ReleaseRoom] = []  # decode: rooms to release in the next metadata
        self._fallback: dict[str, str] = {}  # prefill: request -> why its room was refused (answered without one)
        self._answered: dict[str, dict[str, Any]] = {}  # prefill: params returned since the last worker output
        self.stats = KVBridgeStats()  # the same, since vLLM last took them (get_kv_connector_stats)

    def on_new_request(self, request: Any) -> None:
        """Prefill with a Mamba group (``GroupLayout.backoff``): drop the prompt's last token before
        it is scheduled, so the state the room carries is h(n - 1), what decode needs (it computes
        token n - 1 itself: hybrid.py). The room stays bound to the whole prompt and claims n."""
        params = request.kv_transfer_params
        backoff = self.groups.backoff if self.groups is not None else 0
        if not (self.is_prefill and backoff and params and params.get("do_remote_decode")):
            return
        n, ids = int(request.num_prompt_tokens), getattr(request, "prompt_token_ids", None)
        if params.get(BACKED_OFF) or n <= backoff or not isinstance(ids, list) or \
                getattr(request, "skip_reading_prefix_cache", False):
            return  # (prompt embeds, a one-token prompt, prompt logprobs: the room is refused at open)
        self._whole[request.request_id] = (prompt_binding(request), n)
        del ids[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens = n - backoff
        request.max_tokens = 1
        params[BACKED_OFF] = True

    # -- decode ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.is_prefill or not params or not params.get("do_remote_prefill") or ROOM not in params:
            return 0, False
        backoff = self.groups.backoff if self.groups is not None else 0  # Mamba: decode computes token n - 1
        count = int(request.num_prompt_tokens) - backoff - int(num_computed_tokens)
        if count > 0 and self.groups is not None:
            why = self._hybrid_local(int(request.num_prompt_tokens), int(num_computed_tokens))
            if why:
                self._local[request.request_id] = why
                return 0, False
        return (count, True) if count > 0 else (0, False)

    def _hybrid_local(self, n: int, computed: int) -> str:
        """Decode, hybrid groups: why the room cannot fill what decode's first step reads ("": it
        can). A local prefix hit (the window and paged groups' rooms start at page 0), or a window
        group whose block of token n - W vLLM does not allocate (hybrid.window_gap)."""
        if computed:
            return "local_compute_hybrid_prefix"
        managers = getattr(getattr(self.kv_cache_manager, "coordinator", None), "single_type_managers", None)
        for g, _, w in self.groups.windows:
            skip = getattr(managers[g], "get_num_skipped_tokens", None) if managers else None
            if window_gap(n, w, self.block_size, None if skip is None else int(skip(n))):
                return "local_compute_window"
        return ""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if self.is_prefill:
            if params.get("do_remote_decode") and request.request_id not in self._sends:
                self._open(request, params)
            return
        if not params.get("do_remote_prefill") or ROOM not in params:
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:
            local = "prompt_logprobs: computed here" if getattr(request, "skip_reading_prefix_cache", False) else \
                f"a local prefix hit of {int(request.num_computed_tokens)} of {int(request.num_prompt_tokens)} tokens"
            hybrid = self._local.pop(request.request_id, "")
            if hybrid:
                local = _LOCAL[hybrid]
                self._count(hybrid, request.request_id, local)
            elif getattr(request, "skip_reading_prefix_cache", False):
                self.refusals["local_compute_prompt_logprobs"] += 1
                self.stats.count("local_compute_prompt_logprobs")
            self._release(request, params, f"decode needs nothing of the room ({local})")
            return
        req_id = request.request_id
        self._local.pop(req_id, None)
        backoff = self.groups.backoff if self.groups is not None else 0  # Mamba: token n - 1 is decode's own
        local = int(request.num_prompt_tokens) - backoff - int(num_external_tokens)
        group_ids = blocks.get_block_ids()
        block_ids = list(group_ids[self.groups.paged if self.groups is not None else 0])
        error, windows, num_tokens = "", (), 0
        binding = prompt_binding(request)
        try:
            room = requested_room(params, req_id)
            instance = str(params.get(INSTANCE) or "")
            if not instance:
                raise ValueError(f"kv_transfer_params.{INSTANCE} is missing (pass on what prefill returned)")
            self._check_claim(params, request, room, binding)
        except (ValueError, KVBridgeError) as exc:
            room, instance, error = 0, "", str(exc)
            self._count("decode_params_refused", req_id, error)
        if not error and local % self.block_size:
            error = (f"decode's local prefix hit of {local} tokens is not whole blocks of {self.block_size}: "
                     "kvbridge moves the blocks after a block-aligned prefix")
        if self.groups is not None:  # the window groups' blocks; one vLLM did not allocate fails the load
            num_tokens = int(request.num_prompt_tokens) - self.groups.backoff
            windows, gap = self.groups.window_blocks(group_ids, num_tokens, self._null_block())
            if gap and not error:
                error = f"{gap}: decode's first step would read a key no room can fill; nothing loaded"
            states, why = self.groups.state_blocks(group_ids, self._null_block())
            windows += states
            if why and not error:
                error = f"{why}; nothing loaded"
        first = local // self.block_size
        pages = tuple(block_ids[first:cdiv(num_tokens or int(request.num_prompt_tokens), self.block_size)])
        self._receives.append(Receive(req_id, room, instance, pages, first, error, binding, num_tokens, windows))

    def _null_block(self) -> int | None:
        """vLLM's null block id (a skipped sliding-window block), None before the manager is bound."""
        pool = getattr(self.kv_cache_manager, "block_pool", None)
        return None if pool is None else int(pool.null_block.block_id)

    def _release(self, request: Any, params: dict[str, Any], reason: str) -> None:
        """Decode: tell the room's prefill ranks it is not needed (the workers send the release).
        Params that do not check out (no instance, another prompt's count, a bad signature) release
        nothing: the room is not this request's to end."""
        binding = prompt_binding(request)
        try:
            room = requested_room(params, request.request_id)
            instance = str(params.get(INSTANCE) or "")
            if not instance:
                raise ValueError(f"kv_transfer_params.{INSTANCE} is missing")
            self._check_claim(params, request, room, binding)
        except (ValueError, KVBridgeError) as exc:
            log.info("kvbridge decode: request %s releases no room: %s", request.request_id, exc)
            return
        self._releases.append(ReleaseRoom(request.request_id, room, instance, binding, reason))

    def _check_claim(self, params: dict[str, Any], request: Any, room: int, binding: bytes) -> None:
        """Decode, before anything is loaded: the room carries this prompt's token count, and with
        ``room_key`` the params are prefill's, unexpired and bound to this prompt."""
        n, claimed = int(request.num_prompt_tokens), params.get(NUM_TOKENS)
        if isinstance(claimed, bool) or not isinstance(claimed, int):
            raise ValueError(f"kv_transfer_params.{NUM_TOKENS} {claimed!r} is missing or not an integer (pass on "
                             f"what prefill returned)")
        if claimed != n:
            raise ValueError(f"room {room} carries {claimed} tokens ({NUM_TOKENS}) but decode's prompt has {n}: "
                             "another prompt's room; nothing loaded")
        if self.settings.room_key:
            verify_room(self.settings.room_key, room, params.get(EXPIRES), params.get(SIG), now=time.time(),
                        binding=binding)

    def _open(self, request: Any, params: dict[str, Any]) -> None:
        """Prefill: the room of a ``do_remote_decode`` request, bound to its prompt; refused (the
        request runs without a transfer and returns fallback params) when the room id is bad, unsigned
        under ``room_key``, or already open on this engine."""
        req_id = request.request_id
        binding = prompt_binding(request)
        try:
            room = requested_room(params, req_id)
            if ROOM in params and self.settings.room_key:  # a router's room: signed, unexpired
                verify_room(self.settings.room_key, room, params.get(EXPIRES), params.get(SIG), now=time.time(),
                            binding=binding)
        except (ValueError, KVBridgeError) as exc:
            self._count("room_refused", req_id, str(exc))
            self._fallback[req_id] = "room_refused"
            return
        whole = self._whole.pop(req_id, None)
        if self.groups is not None and self.groups.backoff and whole is None:
            reason = ("a Mamba group's state needs prefill to stop one token short, which this prompt does not "
                      "allow (prompt embeds, one token, or prompt logprobs)")
            self._count("room_refused", req_id, reason)
            self._fallback[req_id] = "room_refused"
            return
        holder = self._open_rooms.get(room)
        if holder is not None:
            self._count("room_in_use", req_id, f"room {room} is already open for request {holder} on this engine")
            self._fallback[req_id] = "room_in_use"
            return
        self._open_rooms[room], self._room_of[req_id] = req_id, room
        self._sends[req_id] = _Send(request, room, int(request.num_prompt_tokens), whole[0] if whole else binding,
                                    claim=whole[1] if whole else 0)

    def _count(self, reason: str, req_id: str, detail: str) -> None:
        self.refusals[reason] += 1
        self.stats.count(reason)
        log.warning("kvbridge %s: request %s: no transfer (%s, %d so far): %s", self.settings.role, req_id, reason,
                    self.refusals[reason], detail)

    def _free_room(self, req_id: str) -> None:
        room = self._room_of.pop(req_id, None)
        if room is not None:
            del self._open_rooms[room]

    # -- both ------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        meta = KVBridgeMetadata(aborts=self._aborts)
        self._aborts = []
        self._answered.clear()  # their step's outputs left the engine core: never rewritten after
        if not self.is_prefill:
            meta.receives, self._receives = self._receives, []
            meta.releases, self._releases = self._releases, []
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
            group_ids = self._group_ids(req_id, scheduler_output)
            block_ids = list(group_ids[self.groups.paged if self.groups is not None else 0])
            windows: tuple = ()
            if self.groups is not None and (is_last or self.groups.states):  # state slots: on every chunk
                windows, gap = self.groups.window_blocks(group_ids, s.num_tokens, self._null_block()) if is_last \
                    else ((), "")
                states, why = self.groups.state_blocks(group_ids, self._null_block())
                windows, gap = windows + states, gap or why
                if gap:  # (vLLM keeps the window's blocks until the prompt's last step: not expected)
                    log.warning("kvbridge prefill: request %s: no room: %s", req_id, gap)
                    self._fallback[req_id] = "window_blocks"
                    s.done = True
                    continue
            meta.sends.append(SendChunk(req_id, s.room, tuple(block_ids[s.sent_pages:upto]), s.sent_pages, ready,
                                        s.num_tokens, is_last, s.binding, windows))
            s.sent_pages, s.opened, s.done = upto, True, is_last
        return meta

    def _group_ids(self, req_id: str, scheduler_output: Any) -> tuple[list[int], ...]:
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        ids = state.get_block_ids(req_id) if state is not None else None
        if ids is None:
            ids = self.kv_cache_manager.get_block_ids(req_id)
        return tuple(list(g) for g in ids)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if self.is_prefill:
            self._whole.pop(req_id, None)
            s = self._sends.pop(req_id, None)
            refused = self._fallback.pop(req_id, None)
            if s is None or not s.opened:
                self._free_room(req_id)
                return False, (None if refused is None or _aborted(request) else self._fallen_back(req_id, refused))
            self._held.add(req_id)
            if refused is not None:  # a worker could not open or send the room: no room to name
                self._aborts.append(req_id)
                return True, None if _aborted(request) else self._fallen_back(req_id, refused)
            if s.done and not _aborted(request):
                params = {"do_remote_prefill": True, "do_remote_decode": False, ROOM: s.room,
                          INSTANCE: self.settings.instance, NUM_TOKENS: s.claim or s.num_tokens}
                if self.settings.room_key:
                    expires = int(time.time() + self.settings.room_ttl_s)
                    params.update({SIG: sign_room(self.settings.room_key, s.room, expires, s.binding),
                                   EXPIRES: expires})
                self._answered[req_id] = params  # a worker's refusal in this step's output rewrites it
                return True, params
            self._aborts.append(req_id)
            return True, None
        self._local.pop(req_id, None)
        pending = [r for r in self._receives if r.req_id == req_id]
        if pending:  # never handed out: nothing was asked of prefill, which is told to free the room
            self._receives = [r for r in self._receives if r.req_id != req_id]
            r = pending[0]
            if not r.error:
                self._releases.append(ReleaseRoom(req_id, r.room, r.prefill_instance, r.binding,
                                                  "the decode request finished before it loaded"))
            return False, None
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and ROOM in params:  # finished before it was scheduled
            params["do_remote_prefill"] = False
            self._release(request, params, "the decode request finished before it was scheduled")
        if req_id in self._receiving:  # in flight: abort, free once no write can land
            self._aborts.append(req_id)
            self._held.add(req_id)
            return True, None
        return False, None

    def _fallen_back(self, req_id: str, reason: str) -> dict[str, Any]:
        """Prefill's answer for a request whose room was refused: no room, decode computes it."""
        self.refusals[f"fallback_{reason}"] += 1
        self.stats.count(f"fallback_{reason}")
        log.warning("kvbridge prefill: request %s answered without a room (%s): decode computes its prompt", req_id,
                    reason)
        return {"do_remote_prefill": False, "do_remote_decode": False, FALLBACK: reason}

    def _worker_refusals(self, meta: Any) -> None:
        """Prefill: rooms a worker could not open or send this step. A request still running is
        answered without a room when it finishes; one answered in this very step (vLLM calls
        request_finished before it hands the connector the step's output) has its params rewritten
        now, before they leave the engine core."""
        if not isinstance(meta, KVBridgeWorkerMeta):
            return
        for req_id, reason in meta.refused.items():
            params = self._answered.pop(req_id, None)
            if params is not None:
                params.clear()
                params.update(self._fallen_back(req_id, reason))
                self._aborts.append(req_id)  # the workers end what is left of the room
            elif req_id in self._sends:
                self._fallback.setdefault(req_id, reason)
            else:
                self.stats.count("refused_after_answer")
                log.error("kvbridge prefill: request %s's room failed on a worker (%s) after its params were "
                          "returned: decode's claim will fail by name", req_id, reason)

    def update_connector_output(self, output: Any) -> None:
        if self.is_prefill:
            self._worker_refusals(getattr(output, "kv_connector_worker_meta", None))
            self._answered.clear()
        for req_id in output.finished_recving or ():
            self._receiving.discard(req_id)
            self._held.discard(req_id)
        for req_id in output.finished_sending or ():
            self._held.discard(req_id)
            self._free_room(req_id)

    @property
    def has_pending_work(self) -> bool:
        """Blocks held for a room: the engine must keep stepping so workers report them."""
        return bool(self._held) or bool(self._aborts)


_LOCAL = {  # decode, hybrid groups: why decode computes the prompt itself (the room is released)
    "local_compute_hybrid_prefix": "a local prefix hit under hybrid KV cache groups (the rooms of window pools "
                                   "start at page 0)",
    "local_compute_window": "vLLM's decode holds no sliding-window block for token n - W, which the recomputed "
                            "last prompt token attends (n - W + 1 is a multiple of the block size)",
}


def _aborted(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR) \
        if hasattr(RequestStatus, "FINISHED_ERROR") else request.status == RequestStatus.FINISHED_ABORTED

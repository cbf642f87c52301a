"""Prefill side of one room: the engine-facing :class:`KVSender`, and the room's
state that the :class:`~kvbridge.transfer.prefill.PrefillEndpoint` loop drives.

A room on a prefill CP rank holds the chunks of owned pages the engine handed
in, and one :class:`Target` per decode rank that asked for the room. The loop
posts every chunk to every target (one plan per chunk and target), collects
the completions and reports them; nothing here touches a socket.

    send(chunk 0) ... send(chunk n, is_last)      engine thread
          |                     |
       chunks[0]  ...       chunks[n] (+ held partial page) (+ aux row)
          |                     |
     target A: posted 0..n, in flight {handle: pages}, pages done, aux done
     target B: ...
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.errors import LayoutError
from kvbridge.layout import BufferDesc, OwnerLanes
from kvbridge.layout.plan import PairedBuffers
from kvbridge.transfer.poll import KVPoll, RoomState

if TYPE_CHECKING:
    from kvbridge.layout import AuxRow
    from kvbridge.transfer.prefill import PrefillEndpoint


@dataclass
class Target:
    """One decode rank that receives this room."""

    decode_rank: str
    ident: bytes  # ZMQ routing id of the decode rank's connection
    session: str
    dst_pages: np.ndarray  # logical page -> destination physical page
    dst_bufs: list[BufferDesc]
    pools: tuple[str, ...]
    aux_addr: int | None  # destination address of the aux row slot
    deadline: float  # monotonic
    want_digest: bool
    paired: PairedBuffers  # our buffers paired with the decode rank's, checked once
    posted: int = 0  # chunks posted so far
    inflight: dict[int, tuple[np.ndarray, bool]] = field(default_factory=dict)  # handle -> (logical pages, aux row too)
    aux_posted: bool = False
    aux_done: bool = False
    num_pages_done: int = 0
    failure: str | None = None
    abort_reason: str | None = None  # decode asked to abort
    closed: bool = False  # final report (success, failure or abort ack) sent

    @property
    def active(self) -> bool:
        return self.failure is None and self.abort_reason is None


class SendRoom:
    """Everything the prefill rank knows about one room."""

    def __init__(self, room: int, cp_rank: int, lanes: OwnerLanes, page_size: int) -> None:
        self.room = room
        self.cp_rank = cp_rank
        self.lanes = lanes
        self.page_size = page_size
        self.state = RoomState()
        self.num_tokens: int | None = None
        self.chunks: list[tuple[np.ndarray, np.ndarray]] = []
        self.held: tuple[np.ndarray, np.ndarray] | None = None  # partial last page until is_last
        self.is_last = False
        self.aux_row: np.ndarray | None = None  # packed structured row
        self.targets: dict[str, Target] = {}
        self.num_expected_targets: int | None = None
        self.created = time.monotonic()
        self.engine_done = False  # the engine dropped its KVSender (room may be forgotten)
        self.num_slices = 0  # posted for this room, all targets
        self.num_bytes = 0

    # -- derived --------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        assert self.num_tokens is not None
        return -(-self.num_tokens // self.page_size)

    @property
    def owns_last_token(self) -> bool:
        return self.num_tokens is not None and self.lanes.owner_of_token(
            self.num_tokens - 1, self.page_size, self.num_pages
        ) == self.cp_rank

    @property
    def age_ms(self) -> float:
        return (time.monotonic() - self.created) * 1000

    @property
    def num_owned_pages(self) -> int:
        # the pages this rank *sends* (under "replicated" every rank stores all pages, rank 0 sends them)
        return int(self.lanes.owned_pages(self.cp_rank, self.num_pages).size) if self.num_tokens else 0

    @property
    def num_inflight(self) -> int:
        return sum(len(t.inflight) for t in self.targets.values())

    def target_complete(self, t: Target) -> bool:
        """Every page (and the aux row, if this rank owns it) written to ``t``."""
        return (
            self.is_last
            and t.active
            and not t.inflight
            and t.posted == len(self.chunks)
            and t.num_pages_done == self.num_owned_pages
            and (t.aux_done or not self.owns_last_token)
        )

    # -- engine input ---------------------------------------------------------

    def set_num_tokens(self, num_tokens: int, source: str) -> None:
        if not isinstance(num_tokens, (int, np.integer)) or num_tokens <= 0:
            raise LayoutError(f"num_tokens must be a positive integer, got {num_tokens!r}", room=self.room, field="num_tokens")
        if self.num_tokens is not None and self.num_tokens != num_tokens:
            raise LayoutError(
                f"{source} says {num_tokens} tokens, but the room was started with {self.num_tokens}",
                room=self.room, rank=f"cp{self.cp_rank}", field="num_tokens",
            )
        self.num_tokens = int(num_tokens)

    def add_chunk(self, logical: np.ndarray, local: np.ndarray, is_last: bool, aux_row: np.ndarray | None) -> None:
        """Check a chunk from the engine and queue it; raises before queueing anything."""
        ctx = dict(room=self.room, rank=f"cp{self.cp_rank}")
        if self.num_tokens is None:
            raise LayoutError("send() before init(num_tokens)", field="num_tokens", **ctx)
        if self.is_last:
            raise LayoutError("send() after the last chunk", field="is_last", **ctx)
        logical = np.asarray(logical, dtype=np.int64).reshape(-1)
        local = np.asarray(local, dtype=np.int64).reshape(-1)
        if logical.shape != local.shape:
            raise LayoutError(f"{logical.size} logical pages but {local.size} local pages", field="local_pages", **ctx)
        num_pages = self.num_pages
        if logical.size:
            if logical.min() < 0 or logical.max() >= num_pages:
                raise LayoutError(f"logical pages must lie in [0, {num_pages})", field="logical_pages", **ctx)
            owner, _ = self.lanes.owners(logical, num_pages)
            if (owner != self.cp_rank).any():
                bad = int(logical[owner != self.cp_rank][0])
                raise LayoutError(f"logical page {bad} is owned by cp rank {int(owner[owner != self.cp_rank][0])}, not this rank",
                                  field="logical_pages", **ctx)
        seen = np.concatenate([c[0] for c in self.chunks] + ([self.held[0]] if self.held else []) + [logical])
        if np.unique(seen).size != seen.size:
            raise LayoutError("a logical page was sent twice", field="logical_pages", **ctx)
        if is_last:
            if seen.size != self.num_owned_pages:
                raise LayoutError(f"last chunk leaves {self.num_owned_pages - seen.size} owned pages unsent",
                                  field="logical_pages", **ctx)
            if self.owns_last_token and aux_row is None:
                raise LayoutError("this rank owns the last valid token: the last send() must carry the aux row",
                                  field="aux", **ctx)
            if not self.owns_last_token and aux_row is not None:
                raise LayoutError("aux row given, but another cp rank owns the last valid token (hard rule 4)",
                                  field="aux", **ctx)
        elif aux_row is not None:
            raise LayoutError("the aux row goes with the last chunk", field="aux", **ctx)
        # The partial last page travels only with the last chunk (its rows may still grow).
        last_page = num_pages - 1
        partial = self.num_tokens % self.page_size != 0
        if partial and not is_last and (logical == last_page).any():
            keep = logical != last_page
            self.held = (logical[~keep], local[~keep])
            logical, local = logical[keep], local[keep]
        if is_last and self.held is not None:
            logical = np.concatenate([logical, self.held[0]])
            local = np.concatenate([local, self.held[1]])
            self.held = None
        if logical.size:
            self.chunks.append((logical, local))
        self.is_last = is_last
        if is_last:
            self.aux_row = aux_row


class KVSender:
    """Engine-facing sender of one room on one prefill CP rank (thread-safe)."""

    def __init__(self, endpoint: PrefillEndpoint, room: int) -> None:
        self._ep = endpoint
        self.room = room
        # once the engine drops this object, a final room may be forgotten
        weakref.finalize(self, endpoint._release, room)

    def init(self, num_tokens: int) -> None:
        self._ep._init_room(self.room, num_tokens)

    def send(self, logical_pages: np.ndarray, local_pages: np.ndarray, *, is_last: bool = False,
             aux: AuxRow | np.ndarray | None = None) -> None:
        """Queue owned pages (a partial last page is held until ``is_last``);
        the owner of the last valid token passes the aux row (an AuxRow, or a
        row packed with the aux schema) with the last chunk."""
        self._ep._send(self.room, logical_pages, local_pages, is_last, aux)

    def poll(self) -> KVPoll:
        return self._ep._poll(self.room)

    @property
    def failure_reason(self) -> str | None:
        return self._ep._reason(self.room)

    @property
    def stats(self) -> dict[str, int]:
        """Slices and bytes this rank posted for the room (every decode target)."""
        return self._ep._stats(self.room)

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._ep._abort(self.room, reason)

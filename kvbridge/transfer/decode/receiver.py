"""KVReceiver: the decode engine's handle on one room (thread-safe: every call takes the
endpoint's lock). The room's states and page arithmetic are in ``decode/room.py``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from kvbridge.errors import ContractMismatch, TransferError, TransferTimeout
from kvbridge.layout import AuxRow, OwnerLanes
from kvbridge.transfer.decode.config import DecodeConfig
from kvbridge.transfer.decode.room import DecodeRoom
from kvbridge.transfer.rooms import RoomHandle

T = TypeVar("T")


class Endpoint(Protocol):
    """What a KVReceiver needs of its endpoint (the DecodeEndpoint; named here, not imported:
    the endpoint imports this module)."""

    config: DecodeConfig

    def locked(self, fn: Callable[[], T]) -> T: ...
    def init_room(self, r: DecodeRoom, page_ids: Any, aux_slot: int, num_tokens: int | None,
                  first_page: int, binding: bytes = b"", kind_units: Any = None) -> None: ...
    def abort_room(self, r: DecodeRoom, reason: str) -> None: ...


class KVReceiver(RoomHandle):
    """Engine-facing receiver of one room on one decode rank (thread-safe).

    ``close()`` (or leaving a ``with`` block, or dropping the handle) ends the room (one not
    yet final fails, and its prefill ranks are told); until then its final state, failure
    reason and aux row stay readable."""

    _ep: Endpoint
    _room: DecodeRoom

    def init(self, page_ids: Any, aux_slot: int, num_tokens: int | None = None, *, first_page: int = 0,
             binding: bytes = b"", kind_units: dict[str, Any] | None = None) -> None:
        """Where the room goes: ``num_tokens`` valid tokens (None: only the pages are known; the
        request has ``first_page + len(page_ids)`` pages and prefill says the count); this rank
        already holds logical pages ``[0, first_page)``; logical page ``first_page + i`` goes to
        physical page ``page_ids[i]`` (one mapping for every pool); the aux row goes to row
        ``aux_slot`` of the aux buffers. ``binding``: the request's digest
        (``kvbridge.room_binding``), presented with the claim; a room bound to another request
        fails this one at once (RoomBindingError's reason), nothing written.

        ``kind_units``: for the compressed, state and ring-window pools (units of their own),
        this rank's physical units of what decode needs of ``num_tokens`` tokens
        (``kvbridge.needed_extent``: the complete entries' pages from the extent's first; a
        state or ring pool: its one slot, the request row). Window pools on pages receive the
        window's pages of ``page_ids``. ``num_tokens`` is required with any such pool. A state
        slot that a failed room's writes may still reach is refused (hard rule 6)."""
        self._ep.init_room(self._room, page_ids, aux_slot, num_tokens, first_page, binding, kind_units)

    def wait_bootstrapped(self, timeout: float) -> OwnerLanes:
        """Block until the prefill topology is known; its owner lanes (allocate pages lane-major
        with ``lanes.lane_major(n)``). TransferTimeout after ``timeout`` s; ContractMismatch
        (with ``.diff``) or TransferError when the room failed before."""
        r = self._room
        rank = self._ep.config.rank_label
        booting = self._ep.locked(r.boot_waiter)
        if booting is not None and not booting.wait(timeout):
            raise TransferTimeout(f"prefill topology of instance {r.prefill_instance!r} not known within "
                                  f"{timeout:.1f}s", room=r.room, rank=rank, field="bootstrap")
        lanes, reason, diff = self._ep.locked(lambda: (r.lanes, r.state.reason, list(r.mismatch)))
        if lanes is not None:
            return lanes
        if diff:
            raise ContractMismatch(reason or "contract mismatch", diff=diff, room=r.room, rank=rank)
        raise TransferError(f"room failed before its topology was known: {reason}", room=r.room, rank=rank)

    @property
    def aux(self) -> AuxRow | None:
        """The decoded standard aux row, after Success (``aux_regions`` for any schema)."""
        return self._ep.locked(lambda: self._room.aux)

    @property
    def aux_regions(self) -> dict[str, np.ndarray] | None:
        """Every region of the received aux row (stored form), after Success."""
        return self._ep.locked(lambda: self._room.aux_regions)

    @property
    def lanes(self) -> OwnerLanes | None:
        """The prefill instance's owner lanes, once the topology is known (see wait_bootstrapped)."""
        return self._ep.locked(lambda: self._room.lanes)

    @property
    def mismatch(self) -> list[Any]:
        """The field diff when the prefill instance's contract differed (hard rule 7)."""
        return self._ep.locked(lambda: list(self._room.mismatch))

    @property
    def pages_releasable(self) -> bool:
        return self._ep.locked(lambda: self._room.pages_releasable)

    @property
    def stats(self) -> dict[str, Any]:
        return self._ep.locked(lambda: self._room.stats(time.monotonic()))

    def abort(self, reason: str = "aborted by decode") -> None:
        self._ep.abort_room(self._room, reason)

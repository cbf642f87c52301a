"""KVSender: the prefill engine's handle on one room (thread-safe: every call takes the
endpoint's lock). Chunk boundaries and heterogeneous TP: ``prefill/room.py``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from kvbridge.layout import AuxRow
from kvbridge.transfer.prefill.room import PrefillRoom
from kvbridge.transfer.rooms import RoomHandle

T = TypeVar("T")


class Endpoint(Protocol):
    """What a KVSender needs of its endpoint (the PrefillEndpoint; named here, not imported:
    the endpoint imports this module)."""

    def locked(self, fn: Callable[[], T]) -> T: ...
    def init_room(self, r: PrefillRoom, num_tokens: int | None, num_pages: int | None,
                  first_page: int = 0, binding: bytes = b"", kind_units: Any = None) -> None: ...
    def kind_units(self, r: PrefillRoom, kind_units: Any) -> None: ...
    def send_chunk(self, r: PrefillRoom, logical: Any, local: Any, num_tokens_ready: int | None, is_last: bool,
                   aux: Any, aux_slot: int | None, ready_event: Any = None, layers: Any = None) -> None: ...
    def abort_room(self, r: PrefillRoom, reason: str) -> None: ...


class KVSender(RoomHandle):
    """Engine-facing sender of one room on one prefill CP rank (thread-safe).

    ``close()`` (or leaving a ``with`` block, or dropping the handle) ends the room;
    until then its final state, and the reason of a failure, stay readable."""

    _ep: Endpoint
    _room: PrefillRoom

    def init(self, num_tokens: int | None = None, *, num_pages: int | None = None, first_page: int = 0,
             binding: bytes = b"", kind_units: dict[str, Any] | None = None) -> None:
        """The request's length: its valid token count, or, for an engine that only knows pages
        (SGLang), ``num_pages`` alone; then the last ``send()`` says the token count in its
        ``num_tokens_ready``, and the last page waits for it, so that only its valid rows
        travel (hard rule 1). A rank with nothing to send (no owned page, not the owner of the
        last page) is done once the decode ranks asked: no send() needed.

        ``first_page``: this engine sends only logical pages from ``first_page`` on, because
        every decode rank holds the ones below (pass ``decode_first_page``). Counts and
        ``num_tokens_ready`` stay the request's own (tokens ``[0, t)``, prefix included). A
        decode rank that asks later with a shorter prefix is refused, naming both.

        ``binding``: the request's digest (``kvbridge.room_binding(prompt token ids)``); a decode
        rank whose claim presents another digest is refused at once, nothing written or read;
        one that claimed first with another digest makes this call raise RoomBindingError.
        b"" binds nothing (any claim is served).

        ``kind_units``: for the compressed, state and ring-window pools (units of their own, not
        the room's pages), this rank's physical unit of each logical unit: a compressed pool's
        entry pages from logical page 0, a state or ring pool's one slot (the request row).
        Window pools on pages use the pages given to ``send()``. ``send(kind_units=)`` replaces
        them (an engine that allocates as it computes)."""
        self._ep.init_room(self._room, num_tokens, num_pages, first_page, binding, kind_units)

    @property
    def decode_first_page(self) -> int:
        """The decode prefix, in pages, that every decode rank of this room holds (they asked
        for logical pages from it on): readable once they all asked, which ``poll()`` shows as
        WaitingForInput. Before that, or when they hold different prefixes (decode TP ranks
        whose prefix caches differ), a LayoutError names the room, the ranks and their first
        pages (field ``decode_first_page`` / ``first_page``)."""
        return self._ep.locked(lambda: self._room.decode_first_page)

    def send(self, logical_pages: Any, local_pages: Any, *, num_tokens_ready: int | None = None,
             is_last: bool = False, aux: AuxRow | np.ndarray | dict | None = None, aux_slot: int | None = None,
             ready_event: Any = None, layers: tuple[int, int] | None = None,
             kind_units: dict[str, Any] | None = None) -> None:
        """Queue owned pages: ``logical_pages[i]`` is stored at this rank's physical page
        ``local_pages[i]``. ``num_tokens_ready`` (required unless ``is_last``): tokens
        ``[0, t)`` exist; a page not complete within them is held until a later chunk
        completes it. The owner of the last valid token passes the aux row with the last
        chunk: ``aux`` (an AuxRow, a ``{region: value}`` mapping or a packed row) or
        ``aux_slot`` (a slot of the aux buffers given to the endpoint).

        ``ready_event``: when the chunk's KV (or the aux row in your aux buffers) is written
        by GPU work still queued, a CUDA event (``torch.cuda.Event``) recorded on that stream
        after the writes; no byte of the chunk is read before it completes (the copy stream
        waits on it on the GPU, or the engine's thread waits on the host; ``send()`` never
        blocks on it). Without it, the pages must be complete when ``send()`` is called.

        ``layers=(start, end)``: only target layers ``[start, end)`` of these pages, sent as the
        forward pass computes them (layer by layer), each pool's layers by the pipeline-stage
        rule (index K follows the target ids; the range that ends at the last target layer
        carries the draft layers). The pages must be complete within ``num_tokens_ready``; a
        page counts as sent, and reaches a decode rank's ledger, once every layer of every pool
        did. A range sent twice for a page, outside the rank's layers, or pages still missing
        layers when the last chunk comes raise LayerRangeError (nothing queued). The last send
        may carry the last range, or no pages at all (then the aux row and any page held from
        an earlier chunk)."""
        if kind_units is not None:  # (before the chunk: it may complete units of them)
            self._ep.kind_units(self._room, kind_units)
        self._ep.send_chunk(self._room, logical_pages, local_pages, num_tokens_ready, is_last, aux, aux_slot,
                            ready_event, layers)

    @property
    def owned_pages(self) -> np.ndarray:
        """Logical pages this rank sends, ascending (after init)."""
        return self._ep.locked(lambda: self._room.owned.copy())

    @property
    def writes_aux(self) -> bool:
        """True when this rank's CP rank owns the last valid token: pass the aux row with the last
        chunk (after init). With prefill TP > 1 every TP rank of that CP rank passes it; each writes
        it only to the decode ranks whose first source it is (``kvbridge.layout.tp_route``)."""
        return self._ep.locked(lambda: self._room.owns_last_token)

    def select(self, page_table: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(logical, local)`` pages this rank sends, from its page table (see ``PrefillRoom.select``)."""
        return self._ep.locked(lambda: self._room.select(page_table))

    @property
    def num_tokens(self) -> int | None:
        """The request's valid token count, once known (init(num_tokens) or the last chunk)."""
        return self._ep.locked(lambda: self._room.num_tokens)

    @property
    def stats(self) -> dict[str, Any]:
        """What this rank did for the room (every decode target): ``slices`` and ``bytes`` posted;
        ``seconds`` spent in each poll state it left; ``transfer_s``, from the first write posted
        to Success or Failed (to now while in flight; None before any write); ``total_s``, since
        the room was opened. Staged transfers: ``paths`` (decode rank -> "direct" or "staged"),
        ``chunks`` landed, ``bytes_staged``, ``plan_slices`` (the slices staging packed; ``slices``
        counts the wire pieces posted); ``layer_sends``, the layer-range sends the engine handed in."""
        return self._ep.locked(lambda: self._room.stats(time.monotonic()))

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._ep.abort_room(self._room, reason)

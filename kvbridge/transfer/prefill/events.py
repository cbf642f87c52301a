"""What goes in and out of prefill's room machine (``machine.py``): the door's vocabulary.

Events are frozen records fed through ``PrefillRooms.feed(event)``; ``EVENTS`` lists every
type the door takes (its own, the shared ones of ``transfer/actions.py``, and the answers the
shell feeds back for the admission and staged-writes machines, which the room machine books
and passes on). Actions are what ``feed`` returns for the shell to carry out: ``PostWrite``,
``SendDigested`` and ``ReleaseAux`` here, ``Send`` and ``FreeRoom`` (``transfer/actions.py``),
``Resolve`` (``targets.py``), ``WriteNonce`` (``admission.py``), ``Gather`` and ``PostChunk``
(``staged.py``), ``ReadDecider`` (``tickets.py``, answered with ``DeciderRead``). Plain data both ways: no callable, no pointer back into a machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.transfer.actions import AbortRoom, CloseRoom, Shutdown, Tick
from kvbridge.transfer.aux_rows import RegionAddr
from kvbridge.transfer.channel import wire
from kvbridge.transfer.engine import WriteStatus
from kvbridge.transfer.prefill.admission import NonceWritten
from kvbridge.transfer.prefill.staged import ChunkPostFailed, ChunkPosted, SetMode
from kvbridge.transfer.prefill.targets import Target
from kvbridge.transfer.prefill.tickets import DeciderRead, RegisteredAs

if TYPE_CHECKING:
    from kvbridge.bootstrap.schemas import RankDetail
    from kvbridge.transfer.prefill.room import PrefillRoom

__all__ = [
    "EVENTS", "AuxFrom", "Chunk", "KindUnits", "Closing", "EngineInit", "Gc", "Message", "Post", "PostFailed", "PostWrite",
    "Posted", "ProofReadBack", "ReleaseAux", "Resolved", "SendDigested", "Serving", "WriteFinal",
]


# -- actions ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PostWrite:
    """Submit write ``write`` (the machine's id) of room ``room`` to ``target`` (its session):
    ``src``/``dst``/``length`` slices, after the events ``after``. Answer with ``Posted(action,
    handle, now)``, or ``PostFailed(action, reason, now)``; a write of a target that failed
    meanwhile is not submitted (``PostFailed(action, None, now)``)."""

    write: int
    room: int
    target: Target
    session: str
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    after: Any


@dataclass(frozen=True, slots=True)
class SendDigested:
    """Send ``msg`` (a PagesDone) to connection ``to`` with ``digests`` filled in: the digests
    of ``pages`` (logical) held in our ``local`` pages of ``pools``, over ``num_tokens``; and
    ``kind_digests``: per ``(pool, logical units, our units)`` of ``kinds``, the digests of the
    units the report names (``kind_unit_digests`` over ``kind_tokens``, the request's length)."""

    to: bytes
    msg: wire.PagesDone
    pools: tuple[str, ...]
    pages: np.ndarray
    local: np.ndarray
    num_tokens: int
    kinds: tuple[tuple[str, np.ndarray, np.ndarray], ...] = ()
    kind_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ReleaseAux:
    """The room is final: its aux staging slot may be reused."""

    room: int


# -- events ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AuxFrom:
    """Where a room's aux row is written from (the shell staged it, or it is a slot of the
    engine's own registered rows): the rows' regions, the slot, the packed row base (None: by
    region), the events the row's write waits on besides the chunk's (None: none), and the row's
    bytes where the shell has them final (``send(aux=...)``; None: it is only in memory)."""

    regions: Mapping[str, RegionAddr]
    slot: int
    row_base: int | None = None
    after: Any = None
    row: bytes | None = None  # the row's packed bytes, final now (a decode rank that asks gets it in the report)


@dataclass(frozen=True, slots=True)
class Serving:
    """Our control endpoint, as decode ranks dial it (what their KeyProofs sign)."""

    endpoint: str


@dataclass(frozen=True, slots=True)
class Closing:
    """The endpoint is closing: no new room opens."""


@dataclass(frozen=True, slots=True)
class EngineInit:
    """KVSender.init(): the request's length, and the pages every decode rank already holds."""

    room: PrefillRoom
    num_tokens: int | None
    num_pages: int | None
    now: float
    first_page: int = 0
    binding: bytes = b""  # the request's digest (transfer/binding.py); b"" when the room is not bound


@dataclass(frozen=True, slots=True)
class KindUnits:
    """KVSender.init/send(kind_units=), checked by the shell: our physical units of the room's
    compressed, state and ring-window pools (``prefill/kinds.py``)."""

    room: PrefillRoom
    units: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Chunk:
    """KVSender.send(), checked by the shell: queue the chunk (raises, keeping nothing, when it is
    bad); a ``Post`` posts it. ``layers``: target layers ``[start, end)`` of its pages only."""

    room: PrefillRoom
    logical: Any
    local: np.ndarray
    num_tokens_ready: int | None
    is_last: bool
    aux_row: np.ndarray | None
    aux_slot: int | None
    ready_event: Any = None
    layers: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Post:
    """Post what room ``room`` has queued to the decode ranks that asked; ``aux``: where its aux
    row is written from, once the shell staged it."""

    room: PrefillRoom
    now: float
    aux: AuxFrom | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """A message on connection ``ident`` (or the channel's error for a bad one); ``hello``: the
    registration the connection named in its Hello (None: none)."""

    ident: bytes
    msg: Any
    hello: str | None
    now: float


@dataclass(frozen=True, slots=True)
class Resolved:
    """The daemon's answer to a ``Resolve``, and the kind of engine our writes to that session go
    through (choose_path's ``engine``)."""

    rank_id: str
    detail: RankDetail | None
    problem: str | None
    now: float
    engine_kind: str = "local"
    by_read: bool = False  # our engine reads that session: its memory is proven by read (admission.py)


@dataclass(frozen=True, slots=True)
class ProofReadBack:
    """The shell's answer to a ``ReadProof`` (admission.py): the bytes read from the registrant's
    scratch (``problem`` None), or why they could not be read."""

    ident: bytes
    data: bytes
    problem: str | None
    now: float


@dataclass(frozen=True, slots=True)
class Posted:
    """The shell submitted ``action``: the engine's ``handle`` reports it; ``submit_s``: how long
    the engine's submit took (traced: the post's own share of planning and submitting)."""

    action: PostWrite
    handle: int
    now: float
    submit_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PostFailed:
    """``action`` was refused at submission (``reason``), or not submitted because its target
    failed meanwhile (None): nothing of it is in flight."""

    action: PostWrite
    reason: str | None
    now: float


@dataclass(frozen=True, slots=True)
class WriteFinal:
    """The engine's write ``handle`` is done or failed."""

    handle: int
    status: WriteStatus
    now: float


@dataclass(frozen=True, slots=True)
class Gc:
    """Housekeeping: forget quiet rooms no handle holds; prune tombstones and silent connections."""

    now: float


EVENTS = (
    Serving, Closing, EngineInit, Chunk, Post, AbortRoom, CloseRoom, Shutdown, Message, Resolved, NonceWritten, ProofReadBack,
    Posted, PostFailed, ChunkPosted, ChunkPostFailed, WriteFinal, SetMode, Tick, Gc, RegisteredAs, DeciderRead,
    KindUnits,
)

"""What goes in and out of decode's room machine (``machine.py``): the door's vocabulary.

Events are frozen records fed through ``DecodeRooms.feed(event)``; ``EVENTS`` lists every type
the door takes (its own and the shared ones of ``transfer/actions.py``). Actions are what
``feed`` returns for the shell to carry out: ``LookUp``, ``Refresh``, ``EchoScratch``,
``WriteAuxRow``, ``ReadForCommit``, ``Rename`` and ``DropRegistration`` here, ``Send`` and
``FreeRoom`` (``transfer/actions.py``), ``CheckLease`` and ``DropPeer`` (``peers.py``), ``Scatter``
(``staging.py``). The machine reads no memory: what it needs read or written (an aux row and
page digests at commit, an aux row a report carried, a nonce in our scratch region) goes out as
an action over plain data, and what was done comes back as an event (``CommitRead``,
``AuxRowWritten``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.transfer.actions import AbortRoom, CloseRoom, Shutdown, Tick
from kvbridge.transfer.decode.topologies import Key

if TYPE_CHECKING:
    from kvbridge.bootstrap.schemas import LookupResponse
    from kvbridge.transfer.decode.room import DecodeRoom

__all__ = [
    "EVENTS", "AuxRowWritten", "CommitRead", "DigestRead", "KindDigestRead", "EchoScratch", "Init", "InitKinds",
    "DropRegistration", "LeaseChecked", "LookUp", "LookedUp", "Message", "ReadForCommit", "Refresh", "Refreshed",
    "Registered", "Release", "Rename", "ScatterFailed", "Scattered", "SetStaging", "WriteAuxRow", "WriteProof",
]


# -- actions ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LookUp:
    """Ask the daemon for the topology of ``room``'s prefill DP group (off the loop); answer
    with ``LookedUp(room, key, topo, error, now)``."""

    room: int
    instance: str
    dp_rank: int | None
    key: Key


@dataclass(frozen=True, slots=True)
class Refresh:
    """Look ``key`` = (instance, DP group) up again ahead of expiry; answer with
    ``Refreshed(key, topo, now)`` (topo None when it failed)."""

    key: tuple[str, int]


@dataclass(frozen=True, slots=True)
class WriteProof:
    """A prefill rank's Challenge with a nonce (proof by read): write ``proof`` (our proof key's
    signature over it) into our own scratch region at ``offset``, then send ``endpoint`` a
    ChallengeEcho carrying its SHA-256; the prefill rank reads the proof back. An offset outside the
    region: nothing written, no echo, a warning. Nothing to answer."""

    endpoint: str
    offset: int
    proof: bytes
    via: str | None = None  # the registration of the connection that challenged (the echo goes back on it)


@dataclass(frozen=True, slots=True)
class EchoScratch:
    """A prefill rank wrote a nonce into our scratch region: read the ``NONCE_BYTES`` at
    ``offset`` and send them back to ``endpoint`` as a ChallengeEcho (an offset outside the
    region: no echo, a warning; that prefill rank then refuses us, naming why). Nothing to answer."""

    endpoint: str
    offset: int
    via: str | None = None  # the registration of the connection that challenged (the echo goes back on it)


@dataclass(frozen=True, slots=True)
class Rename:
    """This rank registered again as ``rank_id``: its control connections say it in their Hello
    from now on; those of the earlier registrations in ``keep`` stay open (rooms asked on them still
    need them: a prefill rank answers a room only on the connection that asked), every other one closes."""

    rank_id: str
    keep: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class DropRegistration:
    """No room needs the connections of earlier registration ``rank_id`` any more: close them."""

    rank_id: str


@dataclass(frozen=True, slots=True)
class DigestRead:
    """Digests of our ``physical`` pages holding logical ``pages`` of ``pools``, over ``num_tokens``
    (``layers``: a pipeline stage's layer ids per pool; None: every layer)."""

    pools: tuple[str, ...]
    pages: np.ndarray
    physical: np.ndarray
    num_tokens: int
    layers: Any = None


@dataclass(frozen=True, slots=True)
class KindDigestRead:
    """Digests of our ``units`` holding logical units ``logical`` of window, compressed or state
    pool ``pool`` (``kind_unit_digests`` over ``num_tokens``; ``layers``: a pipeline stage's layer
    ids of the pool; None: every layer)."""

    pool: str
    logical: np.ndarray
    units: np.ndarray
    num_tokens: int
    layers: Any = None


@dataclass(frozen=True, slots=True)
class ReadForCommit:
    """Room ``room``'s pages are all written: read its aux row (slot ``aux_slot``, one copy to the
    host), or write ``row`` there when a report carried it, and read the digests ``digests`` asks
    for; answer with ``CommitRead``."""

    room: int
    aux_slot: int
    digests: tuple[DigestRead | KindDigestRead, ...]
    row: np.ndarray | None = None  # the aux row its report carried: written into the slot, not read from it
    row_written: bool = False  # that row is in the slot already (``WriteAuxRow``): nothing to write


@dataclass(frozen=True, slots=True)
class WriteAuxRow:
    """A report carried room ``room``'s aux row (checked) before its last pages landed: write it
    into slot ``aux_slot`` now, while the pages' writes run, not at the commit; answer with
    ``AuxRowWritten``."""

    room: int
    aux_slot: int
    row: np.ndarray


# -- events ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Registered:
    """This rank's registration id at the daemon (requests and pings name it; it changes when the
    lease keeper re-registers)."""

    rank_id: str | None


@dataclass(frozen=True, slots=True)
class SetStaging:
    """What rooms requested from now on offer (auto, always, never)."""

    mode: str


@dataclass(frozen=True, slots=True)
class Init:
    """KVReceiver.init(), checked by the shell: where the room's pages and aux row go."""

    room: DecodeRoom
    pages: np.ndarray
    aux_slot: int
    num_tokens: int | None
    first_page: int
    now: float


@dataclass(frozen=True, slots=True)
class InitKinds:
    """KVReceiver.init(kind_units=), checked by the shell (``kind_rooms.py``): the room's units of
    its compressed, state and ring pools; fed before its ``Init``."""

    room: DecodeRoom
    units: Any


@dataclass(frozen=True, slots=True)
class Release:
    """KVReceiver.release(): this rank needs nothing of the room (``reason``); its prefill ranks are
    told (``wire.Release``, presenting the room's binding) as soon as the topology is known."""

    room: DecodeRoom
    reason: str
    now: float


@dataclass(frozen=True, slots=True)
class Message:
    """A message from the prefill rank at ``endpoint`` (or the channel's error for a bad one), on
    the connection of registration ``via`` (None: this rank's registration now)."""

    endpoint: str
    msg: Any
    now: float
    via: str | None = None


@dataclass(frozen=True, slots=True)
class LookedUp:
    """The answer to a ``LookUp``: a topology, or the error the daemon (or the way to it) gave."""

    room: int
    key: Key
    topo: LookupResponse | None
    error: BaseException | None
    now: float


@dataclass(frozen=True, slots=True)
class Refreshed:
    key: tuple[str, int]
    topo: LookupResponse | None
    now: float


@dataclass(frozen=True, slots=True)
class LeaseChecked:
    """The daemon's answer to a ``CheckLease``."""

    endpoint: str
    rank_id: str
    gone: bool
    now: float


@dataclass(frozen=True, slots=True)
class Scattered:
    """The shell carried out a ``Scatter``: the slot is free, and the room may commit."""

    room: int
    slot: int
    now: float


@dataclass(frozen=True, slots=True)
class ScatterFailed:
    """A ``Scatter`` could not run: the room fails (its pages were not written), then the slot is free."""

    room: int
    slot: int
    reason: str
    now: float


@dataclass(frozen=True, slots=True)
class AuxRowWritten:
    """The answer to a ``WriteAuxRow``: the seconds the write took, or the ``error`` that stopped it."""

    room: int
    write_s: float
    error: str | None
    now: float


@dataclass(frozen=True, slots=True)
class CommitRead:
    """The answer to a ``ReadForCommit``: the aux row as it landed and the seconds the read took,
    and the digests asked for (one array per ``DigestRead``), or the ``error`` that stopped the read."""

    room: int
    row: np.ndarray | None
    read_s: float
    digests: tuple[np.ndarray, ...]
    error: str | None
    now: float


EVENTS = (
    Registered, SetStaging, Init, AbortRoom, CloseRoom, Shutdown, Message, LookedUp, Refreshed, LeaseChecked,
    Scattered, ScatterFailed, CommitRead, AuxRowWritten, Tick, InitKinds, Release,
)

"""What both sides' room state machines take and give besides their own (``prefill/events.py``,
``decode/machine.py``): small frozen records. Events go in through a machine's one door,
``feed(event)``; actions come out of it and are carried out by the endpoint's shell in the order
they were emitted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# -- events both machines take -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AbortRoom:
    """The engine aborts room ``room`` (its room record) for ``reason``."""

    room: Any
    reason: str
    now: float


@dataclass(frozen=True, slots=True)
class CloseRoom:
    """The engine let go of room ``room`` (its room record): fail it if unfinished, forget it once quiet."""

    room: Any
    now: float


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The endpoint closes: fail every room for ``reason``."""

    reason: str
    now: float


@dataclass(frozen=True, slots=True)
class Tick:
    """The clock: post or advance what events queued; deadlines, liveness."""

    now: float


# -- actions both machines give ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` to each peer of ``to`` (decode: control endpoints; prefill: connection
    ids), encoded once. ``via`` (decode): the registration whose connections carry it, the one
    the message acts for (None: this rank's registration now)."""

    to: tuple[Any, ...]
    msg: Any
    via: str | None = None


@dataclass(frozen=True, slots=True)
class FreeRoom:
    """Room ``room`` was forgotten: its id may be opened again (wake ``open_waiting``)."""

    room: int

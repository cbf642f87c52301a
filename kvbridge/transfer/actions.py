"""What both sides' room state machines ask their endpoint to do, besides their own
actions (``prefill/machine.py``, ``decode/machine.py``): small frozen records, carried out
by the endpoint's shell in the order they were emitted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` to each peer of ``to`` (decode: control endpoints; prefill: connection
    ids), encoded once."""

    to: tuple[Any, ...]
    msg: Any


@dataclass(frozen=True, slots=True)
class FreeRoom:
    """Room ``room`` was forgotten: its id may be opened again (wake ``open_waiting``)."""

    room: int

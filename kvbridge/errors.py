"""kvbridge's one exception tree.

    KVBridgeError                      root: every error kvbridge raises on purpose
    ├── ConfigError                    bad flag, environment variable or config file
    ├── LayoutError                    geometry and planning (kvbridge.layout)
    │   ├── BufferSpecError            a buffer does not match its pool spec (dtype, bytes per page)
    │   ├── PaddingError               row-domain counts do not add up; padding provenance missing
    │   ├── PageRangeError             a page index outside a registered region (hard rule 5)
    │   ├── PairingError               buffers cannot be paired by (pool, layer id) (hard rule 8)
    │   └── LayerRangeError            a layer-range send outside the rank's layers, sent twice, or left
    │                                  incomplete by the last chunk
    ├── ContractError                  runtime contract problems
    │   ├── ContractMismatch           fingerprints differ; carries the field diff (hard rule 7)
    │   └── TopologyError              sizes that may differ, but not like this
    ├── BootstrapError                 talking to the bootstrap daemon
    │   ├── BootstrapUnavailable       daemon unreachable after retries
    │   ├── UnknownInstance            no such instance registered (404)
    │   ├── InstanceIncomplete         not every rank registered yet (503); carries .missing
    │   ├── Unauthorized               missing or wrong bearer token (401) or lease secret (403)
    │   ├── LeaseHeld                  a live rank holds these coordinates (409); carries .retry_after
    │   ├── ClaimHeld                  a live rank holds this transport session or address range (409); .holder
    │   ├── EndpointError              an endpoint a registration names is malformed, ambiguous or not allowed here (400)
    │   └── LimitExceeded              a daemon limit refused the request (429)
    └── TransferError                  the data path
        ├── EngineError                the transfer engine refused or failed a write
        ├── ProtocolError              malformed, unknown, oversized or unauthenticated message
        ├── PeerLost                   a peer's heartbeat or lease expired
        ├── TransferTimeout            a room overstayed a state's deadline
        ├── LedgerError                pages missing, reported twice, or aux row wrong
        ├── Aborted                    the room was aborted by either side
        ├── RoomInUse                  a room id still open or draining on this endpoint (never reattached)
        ├── RoomBindingError           a claim of a room bound to another request, or a room signature that
        │                              does not verify or has expired (transfer/binding.py)
        ├── RoomEnded                  send() on a room that already reached its final state (logged:
        │                              nothing queued, never raised on the engine's thread)
        └── StagingSlotError           a staging-slot event its table does not allow (a caller's bug)

Every message names what it can of the room, the rank and the field involved:
pass them as keywords and they are appended as ``[room=.. rank=.. field=..]``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "KVBridgeError",
    "ConfigError",
    "LayoutError",
    "BufferSpecError",
    "PaddingError",
    "PageRangeError",
    "PairingError",
    "LayerRangeError",
    "ContractError",
    "ContractMismatch",
    "TopologyError",
    "BootstrapError",
    "BootstrapUnavailable",
    "UnknownInstance",
    "InstanceIncomplete",
    "Unauthorized",
    "LeaseHeld",
    "ClaimHeld",
    "EndpointError",
    "LimitExceeded",
    "TransferError",
    "EngineError",
    "ProtocolError",
    "PeerLost",
    "TransferTimeout",
    "LedgerError",
    "StagingSlotError",
    "Aborted",
    "RoomInUse",
    "RoomBindingError",
    "RoomEnded",
]


class KVBridgeError(Exception):
    """Root of kvbridge's errors; ``room``, ``rank`` and ``field`` give context."""

    def __init__(
        self,
        message: str,
        *,
        room: int | None = None,
        rank: str | int | None = None,
        field: str | None = None,
    ) -> None:
        self.reason = message
        self.room = room
        self.rank = rank
        self.field = field
        super().__init__(self._render())

    def _render(self) -> str:
        ctx = [f"{k}={v}" for k, v in (("room", self.room), ("rank", self.rank), ("field", self.field)) if v is not None]
        return f"{self.reason} [{' '.join(ctx)}]" if ctx else self.reason


class ConfigError(KVBridgeError):
    pass


class LayoutError(KVBridgeError):
    pass


class BufferSpecError(LayoutError):
    pass


class PaddingError(LayoutError):
    pass


class PageRangeError(LayoutError):
    pass


class PairingError(LayoutError):
    pass


class LayerRangeError(LayoutError):
    pass


class ContractError(KVBridgeError):
    pass


class ContractMismatch(ContractError):
    """Fingerprints differ. ``diff`` is a list of field-level differences."""

    def __init__(self, message: str, *, diff: list[Any] | None = None, **ctx: Any) -> None:
        self.diff = list(diff or [])
        super().__init__(message, **ctx)


class TopologyError(ContractError):
    pass


class BootstrapError(KVBridgeError):
    pass


class BootstrapUnavailable(BootstrapError):
    pass


class UnknownInstance(BootstrapError):
    pass


class InstanceIncomplete(BootstrapError):
    """Not every sender rank of the instance registered; ``missing`` lists their labels."""

    def __init__(self, message: str, *, missing: list[str] | None = None, **ctx: Any) -> None:
        self.missing = list(missing or [])
        super().__init__(message, **ctx)


class Unauthorized(BootstrapError):
    pass


class LeaseHeld(BootstrapError):
    """Registering coordinates a live rank holds needs that rank's lease secret (or the admin
    token); ``retry_after`` is when its lease runs out if it is not renewed."""

    def __init__(self, message: str, *, retry_after: float = 0.0, **ctx: Any) -> None:
        self.retry_after = retry_after
        super().__init__(message, **ctx)


class ClaimHeld(BootstrapError):
    """A registration claims a transport session or an address range (pool buffers, aux,
    scratch) that another live rank holds; ``holder`` names that rank (its id and label)."""

    def __init__(self, message: str, *, holder: str = "", **ctx: Any) -> None:
        self.holder = holder
        super().__init__(message, **ctx)


class EndpointError(BootstrapError):
    """A session or control endpoint that is not one canonical address (bootstrap/endpoints.py):
    malformed, a name that resolves to none or several addresses, or an address this daemon's
    mode refuses (loopback in network mode, anything else in local mode)."""


class LimitExceeded(BootstrapError):
    """A daemon limit (ranks per instance, instances, look-ups per second) refused the request;
    ``retry_after`` is set when waiting helps."""

    def __init__(self, message: str, *, retry_after: float | None = None, **ctx: Any) -> None:
        self.retry_after = retry_after
        super().__init__(message, **ctx)


class TransferError(KVBridgeError):
    pass


class EngineError(TransferError):
    pass


class ProtocolError(TransferError):
    pass


class PeerLost(TransferError):
    pass


class TransferTimeout(TransferError):
    pass


class LedgerError(TransferError):
    pass


class Aborted(TransferError):
    pass


class RoomInUse(TransferError):
    """``sender(room)``/``receiver(room)`` on an id whose previous room is still open (its
    handle is alive) or draining (closed, but writes of it may still land). ``draining``
    says which: True means the id frees itself once those writes are over (retry, or pass
    ``wait=`` to ``sender()``/``receiver()``); False means a handle still holds it (close it)."""

    def __init__(self, message: str, *, draining: bool = False, **ctx: Any) -> None:
        self.draining = draining
        super().__init__(message, **ctx)


class RoomBindingError(TransferError):
    pass


class RoomEnded(TransferError):
    """``KVSender.send()`` on a room that already reached its final state (Success, or Failed:
    an abort or a lost peer that ``poll()`` shows): nothing of the call is queued, and the
    message names the room, the rank, the state and why it ended. Logged as a warning, never
    raised: the engine may call send() before it polls the room's end (an idle CP rank's empty
    send after a success is not logged at all)."""


class StagingSlotError(TransferError):
    """A slot event the staging area's table does not allow (a bug in the caller): names the
    slot, its state, the event and the room."""

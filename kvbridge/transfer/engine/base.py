"""The transfer-engine interface: what the sender and receiver need from a data path.

A write is posted with :meth:`TransferEngine.submit_write` (never blocks on the
network) and collected with :meth:`~TransferEngine.poll` (a dict look-up) or
:meth:`~TransferEngine.wait`. One handle covers every slice of the call; the
engine splits it into calls of at most ``max_slices_per_call`` slices.

    PENDING --> DONE      every slice landed
            \\-> FAILED    at least one slice did not; ``reason`` says which call and why

DONE and FAILED are final and mean *no slice of the handle is still in flight*:
a FAILED handle may have written some of its slices (Mooncake writes the good
slices of a failed batch), but nothing of it will land later. Once poll() or
wait() has returned a final status, the handle is forgotten.

Source bytes written by GPU work still queued (the pages of the chunk just computed):
``submit_write(..., after=event)`` takes a CUDA event (``torch.cuda.Event``, or a
sequence of them) recorded on the producer's stream after those writes. No slice is
read before it completes: an engine that copies on a CUDA stream makes that stream
wait on the event (``cudaStreamWaitEvent``: nothing blocks on the host); any other
engine waits for it on its own thread (``synchronize()``), never on the caller's.
Without ``after`` the caller guarantees the bytes are complete when it submits.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvbridge.errors import EngineError


class WriteState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class WriteStatus:
    """State of one submitted write; ``reason`` is set when FAILED."""

    state: WriteState
    reason: str = ""

    PENDING: ClassVar[WriteStatus]
    DONE: ClassVar[WriteStatus]

    @classmethod
    def failed(cls, reason: str) -> WriteStatus:
        return cls(WriteState.FAILED, reason)

    @property
    def is_final(self) -> bool:
        return self.state is not WriteState.PENDING


WriteStatus.PENDING = WriteStatus(WriteState.PENDING)
WriteStatus.DONE = WriteStatus(WriteState.DONE)


class TransferEngine(ABC):
    """Moves bytes from local registered memory into a peer's registered memory."""

    max_slices_per_call: int
    # True where one call copies any number of scattered slices at memory speed (the IPC engine's
    # kernel): staging them first would only copy every byte twice more, so "auto" never stages
    direct_only: bool = False

    @property
    @abstractmethod
    def transport(self) -> str:
        """The family of sessions this engine writes to and is written by: both sides of a transfer
        must share it (the runtime contract's ``transport``; the engine's registry entry carries the
        same label). Abstract on purpose: an engine that does not say what it is does not construct
        (a class attribute, ``transport = "nixl"``, declares it)."""

    @property
    @abstractmethod
    def session_id(self) -> str:
        """What a peer passes as ``session`` to write into this engine's memory."""

    @property
    def metadata(self) -> bytes:
        """What a peer must load (``add_peer``) before it writes into this engine: published with the
        rank's registration. Empty for engines whose session id is enough (Mooncake)."""
        return b""

    def add_peer(self, session: str, metadata: bytes) -> None:
        """Learn a peer from the ``metadata`` it published (its registration's); a no-op for engines
        that need none. EngineError when the metadata does not belong to ``session``."""

    @abstractmethod
    def register(self, ptr: int, nbytes: int) -> None:
        """Expose ``[ptr, ptr + nbytes)``; overlapping an earlier region is an EngineError."""

    @abstractmethod
    def unregister(self, ptr: int) -> None:
        """Withdraw the region that starts at ``ptr``; an unknown ``ptr`` is an EngineError."""

    @abstractmethod
    def submit_write(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
                     after: Any = None) -> int:
        """Post ``length[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]``; returns a handle.
        ``after``: CUDA event(s) the source bytes wait on (see the module docstring)."""

    @abstractmethod
    def poll(self, handle: int) -> WriteStatus:
        """Non-blocking; a final status releases the handle."""

    @abstractmethod
    def wait(self, handle: int, timeout: float) -> None:
        """Block until the handle is final: EngineError(reason) if FAILED, TransferTimeout if still pending."""

    @abstractmethod
    def set_notify(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` whenever a handle becomes final: from an engine thread, holding no
        lock of the engine (it may poll() and submit), or from the thread inside submit_write()
        when a write fails at once. A prefill endpoint reports completions from it."""

    def take_final(self) -> list[int] | None:
        """Handles that became final since the last call, recorded while a notify callback is set,
        so a caller polls those instead of every handle in flight; None: not tracked (poll all)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Fail what is queued, wait for what is in flight, unregister everything. Idempotent."""

    def write(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, timeout: float = 60.0, *,
              after: Any = None) -> None:
        """Synchronous convenience: submit and wait; raises EngineError or TransferTimeout."""
        self.wait(self.submit_write(session, src, dst, length, after=after), timeout)

    def reads(self, session: str) -> bool:
        """Whether ``probe_read`` reaches ``session`` (the ownership proof reads there instead of
        writing a nonce: docs/security.md, "Ownership proof")."""
        return False

    def probe_read(self, session: str, dst: np.ndarray, src: np.ndarray, length: np.ndarray,
                   timeout: float = 5.0) -> None:
        """A small control-plane read: the peer's ``src[i]`` into our registered ``dst[i]``,
        synchronous; EngineError when this engine cannot read or the read fails."""
        raise EngineError(f"{type(self).__name__} cannot read from session {session}", field="session")

    def probe_write(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray,
                    timeout: float = 5.0) -> None:
        """A small control-plane write (an ownership nonce): synchronous like ``write``, and
        outside any fault plan, which counts and holds KV writes only."""
        self.write(session, src, dst, length, timeout)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ready_events(after: Any) -> list[Any]:
    """``after`` as a list of events: None, one event, or a sequence of them (Nones skipped)."""
    if after is None:
        return []
    if isinstance(after, (list, tuple)):
        return [a for a in after if a is not None]
    return [after]


def is_ready(after: Any) -> bool:
    """True when every event of ``after`` completed (an event without ``query()`` counts as not)."""
    return all(bool(getattr(ev, "query", lambda: False)()) for ev in ready_events(after))


def wait_ready(after: Any) -> None:
    """Block until every event of ``after`` completed."""
    for ev in ready_events(after):
        ev.synchronize()

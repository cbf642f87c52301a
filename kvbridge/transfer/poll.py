"""Poll states of a room, and the transitions each side allows.

Written down once; every state change of a sender or receiver goes through
:class:`RoomState`, which refuses transitions not in the table. The rooms' state
machines pass the time in (``now``); without it the clock is read.

    receiver:  Bootstrapping -> WaitingForInput -> Transferring -> Success
    sender:    Bootstrapping -> WaitingForInput -> Transferring -> Success
               (any non-final state) -> Failed
"""

from __future__ import annotations

import enum
import threading
import time


class KVPoll(enum.IntEnum):
    """Values as in SGLang's PD connectors, so engines can map them 1:1."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


FINAL = frozenset({KVPoll.Failed, KVPoll.Success})

TRANSITIONS: dict[KVPoll, frozenset[KVPoll]] = {
    KVPoll.Bootstrapping: frozenset({KVPoll.WaitingForInput, KVPoll.Failed}),
    KVPoll.WaitingForInput: frozenset({KVPoll.Transferring, KVPoll.Failed}),
    KVPoll.Transferring: frozenset({KVPoll.Success, KVPoll.Failed}),
    KVPoll.Success: frozenset(),
    KVPoll.Failed: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A bug in kvbridge: a state change the table does not allow."""


class RoomState:
    """Current state, the failure reason, and when each state was entered."""

    __slots__ = ("state", "reason", "entered", "_done")

    def __init__(self, now: float | None = None) -> None:
        self.state = KVPoll.Bootstrapping
        self.reason: str | None = None
        self.entered: dict[KVPoll, float] = {KVPoll.Bootstrapping: time.monotonic() if now is None else now}
        self._done: threading.Event | None = None  # made by the first waiter; set once the state is final

    def waiter(self) -> threading.Event | None:
        """An event set once the state is final, or None when it already is (call it where state
        changes are serialised: the endpoint's lock)."""
        if self.state in FINAL:
            return None
        if self._done is None:
            self._done = threading.Event()
        return self._done

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def since(self, now: float | None = None) -> float:
        """Seconds spent in the current state (until ``now``; the clock when None)."""
        return (time.monotonic() if now is None else now) - self.entered[self.state]

    def to(self, new: KVPoll, reason: str | None = None, now: float | None = None) -> bool:
        """Move to ``new``; returns False (no change) if already there or, for
        Failed, if already final. A table violation raises IllegalTransition."""
        if new == self.state or (new == KVPoll.Failed and self.final):
            return False
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.state.name} -> {new.name}")
        if new == KVPoll.Failed:  # (before the state: a lock-free poll may read the state at once)
            self.reason = reason or "failed"
        self.entered[new] = time.monotonic() if now is None else now
        self.state = new
        if new in FINAL and self._done is not None:
            self._done.set()
        return True

    def advance_to(self, target: KVPoll, now: float | None = None) -> None:
        """Walk forward through intermediate states up to ``target``."""
        order = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success)
        while self.state != target and not self.final and order.index(self.state) < order.index(target):
            self.to(order[order.index(self.state) + 1], now=now)

    def durations(self) -> dict[str, float]:
        """Seconds from each state's entry to the next state's (ms precision)."""
        items = sorted(self.entered.items(), key=lambda kv: kv[1])
        out = {}
        for (s, t), (_, t_next) in zip(items, items[1:]):
            out[s.name] = round(t_next - t, 6)
        return out
